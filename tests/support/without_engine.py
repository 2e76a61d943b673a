"""Run Python in a fresh interpreter where the engine's dependencies cannot be imported.

A gateway-only install (``pip install tollway``) has no torch, triton or safetensors. The
tests that check what the gateway does there run their code behind a ``sys.meta_path`` finder
that refuses those imports, in whichever environment the suite runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.launcher.engine_install import ENGINE_INSTALL_COMMAND, is_engine_installed

ENGINE_DEPENDENCIES = ("torch", "triton", "safetensors")
REPO_ROOT = Path(__file__).resolve().parents[2]

_NO_ENGINE = f"""
import importlib.abc
import sys


class _NoEngine(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {ENGINE_DEPENDENCIES!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _NoEngine())
"""


def run_without_engine(
    code: str, *args: str, cwd: Path | None = None, timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python -c code *args`` with torch, triton and safetensors unimportable."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-c", _NO_ENGINE + code, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=cwd,
        env=env,
    )


def run_tollway_without_engine(
    *args: str, cwd: Path | None = None, timeout_s: float = 120
) -> subprocess.CompletedProcess[str]:
    """The ``tollway`` command, as a gateway-only install runs it."""
    return run_without_engine(
        "from gateway.launcher.cli import app\napp(prog_name='tollway')\n",
        *args,
        cwd=cwd,
        timeout_s=timeout_s,
    )


needs_engine = pytest.mark.skipif(
    not is_engine_installed(), reason=f"needs the engine: {ENGINE_INSTALL_COMMAND}"
)
"""For a gateway test that runs the engine itself (its process, its commands, its weights)."""
