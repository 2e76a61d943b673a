"""The engine never imports the gateway: dependencies point one way (docs/architecture.md).

Every module of ``backend_engine`` and ``kernels`` is imported in a fresh interpreter, which
must then hold no ``gateway`` module: the engine runs as its own process
(``python -m backend_engine``) and shares only ``openai_protocol`` with the gateway.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

IMPORT_EVERY_MODULE = """
import importlib, json, pkgutil, sys
names = []
for package in ("backend_engine", "kernels"):
    root = importlib.import_module(package)
    names.append(package)
    names += [m.name for m in pkgutil.walk_packages(root.__path__, package + ".")]
for name in names:
    importlib.import_module(name)
gateway = sorted(m for m in sys.modules if m.partition(".")[0] == "gateway")
print(json.dumps({"modules": names, "gateway": gateway}))
"""


def test_no_engine_module_imports_the_gateway() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        "TRITON_INTERPRET": "1",  # the Triton kernels import without a GPU
    }
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_EVERY_MODULE],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO_ROOT,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert len(report["modules"]) > 40  # the walk found the packages' modules
    assert report["gateway"] == []
