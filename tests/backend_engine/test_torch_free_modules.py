"""The engine's loop is plain Python: it runs without torch.

The layer contract "The engine's loop is torch-free" (pyproject.toml, checked by
`lint-imports`) names the torch-free parts: the core, the text side, the server and the
engine that drives them (`LLMEngine` and `AsyncEngine` import the model's runner only when
they build one). It checks our own imports; this test reads the same list and imports every
module under it in a fresh interpreter where importing torch raises, so a third-party import
that pulls torch in fails too.
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from importlib import import_module
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO_ROOT = Path(__file__).resolve().parents[2]
CONTRACT = "The engine's loop is torch-free: torch comes only with the model's runner"


def _torch_free_modules() -> list[str]:
    settings = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in settings["contracts"] if c["name"] == CONTRACT]
    names: list[str] = []
    for source in contract["source_modules"]:
        names.append(source)
        module = import_module(source)
        if hasattr(module, "__path__"):  # a package: every module under it
            names += [m.name for m in pkgutil.walk_packages(module.__path__, source + ".")]
    return names


TORCH_FREE_MODULES = _torch_free_modules()

IMPORT_WITHOUT_TORCH = """
import importlib
import importlib.abc
import json
import sys


class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "triton"):
            raise ImportError(f"{name} was imported")
        return None


sys.meta_path.insert(0, NoTorch())
failures = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failures[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(failures))
"""


def _imports_without_torch(*modules: str) -> dict[str, str]:
    """Each module's import failure (none: ``{}``), all imported in one fresh interpreter."""
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_WITHOUT_TORCH, *modules],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    failures: dict[str, str] = json.loads(result.stdout)
    return failures


def test_the_contract_covers_the_engine_loop() -> None:
    assert {"backend_engine.core.scheduler", "backend_engine.server.app"} <= set(TORCH_FREE_MODULES)
    assert "backend_engine.llm_engine" in TORCH_FREE_MODULES


def test_every_module_of_the_engine_loop_imports_without_torch() -> None:
    assert _imports_without_torch(*TORCH_FREE_MODULES) == {}


def test_the_check_catches_a_module_that_imports_torch() -> None:
    """The guard itself works: a module that needs torch fails it."""
    failures = _imports_without_torch("backend_engine.worker.model_runner")
    assert "torch was imported" in failures["backend_engine.worker.model_runner"]
