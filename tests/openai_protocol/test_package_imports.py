"""`openai_protocol` stands alone: both processes import it, so it imports neither of them,
nor torch. Each module is imported in a fresh interpreter where importing torch, triton,
`backend_engine` or `gateway` raises."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import openai_protocol

MODULES = sorted(
    f"openai_protocol.{path.stem}"
    for path in Path(openai_protocol.__file__).parent.glob("*.py")
    if path.stem != "__init__"
)
FORBIDDEN = ("torch", "triton", "backend_engine", "gateway")

IMPORT_ALONE = f"""
import importlib
import importlib.abc
import sys

FORBIDDEN = {FORBIDDEN!r}


class Forbidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in FORBIDDEN:
            raise ImportError(f"{{name}} was imported")
        return None


sys.meta_path.insert(0, Forbidden())
importlib.import_module(sys.argv[1])
"""


def _import_alone(module: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", IMPORT_ALONE, module],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_every_module_is_checked() -> None:
    assert {"openai_protocol.errors", "openai_protocol.sse", "openai_protocol.field_rules"} <= set(
        MODULES
    )


@pytest.mark.parametrize("module", MODULES)
def test_module_imports_neither_process_nor_torch(module: str) -> None:
    result = _import_alone(module)
    assert result.returncode == 0, result.stderr


def test_the_check_catches_a_module_that_imports_the_engine() -> None:
    result = _import_alone("backend_engine.server.errors")
    assert result.returncode != 0
    assert "was imported" in result.stderr
