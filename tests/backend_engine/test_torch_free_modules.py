"""The engine's loop is plain Python: it must import without torch. That is the scheduling
and KV bookkeeping, the engine that drives them (`LLMEngine`, `AsyncEngine`, which import the
model's runner only when they build one) and the HTTP server in front.

Each is imported in a fresh interpreter where importing torch raises, so an import anywhere
in its import graph (direct, through another engine module, or through the package's
``__init__``) fails the test.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

TORCH_FREE_MODULES = [
    "backend_engine.core.scheduler",
    "backend_engine.core.block_pool",
    "backend_engine.core.kv_cache_manager",
    "backend_engine.core.kv_event_log",  # the gateway imports it with hash_block
    "backend_engine.kv_event_fanout",
    "backend_engine.core.waiting_queue",
    "backend_engine.request_priority",
    "backend_engine.core.request",
    "backend_engine.core.stop_rules",
    "backend_engine.core.step_runner",
    "backend_engine.text.output_processor",
    "backend_engine.llm_engine",
    "backend_engine.async_engine",
    "backend_engine.server.app",
]

IMPORT_WITHOUT_TORCH = """
import importlib
import importlib.abc
import sys


class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch.") or name == "triton":
            raise ImportError(f"{name} was imported")
        return None


sys.meta_path.insert(0, NoTorch())
importlib.import_module(sys.argv[1])
assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules)
"""


@pytest.mark.parametrize("module", TORCH_FREE_MODULES)
def test_module_imports_without_torch(module: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_WITHOUT_TORCH, module],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_the_check_catches_a_module_that_imports_torch() -> None:
    """The guard itself works: a module that needs torch fails it."""
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_WITHOUT_TORCH, "backend_engine.worker.model_runner"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "torch was imported" in result.stderr
