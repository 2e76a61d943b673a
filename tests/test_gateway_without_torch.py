"""A gateway-only install imports without torch, triton or safetensors.

The layer contracts (``[tool.importlinter]`` in pyproject.toml, `lint-imports` in `make test`)
check which of our packages may import which; they see a third-party package's name but not
what it imports in turn. So every module of the packages a gateway-only install holds
(``gateway/``, ``policies/``, the shared packages and the planner) is also imported here, in a
fresh interpreter where those imports fail (`tests.support.without_engine`): a module that
pulls in the engine's heavy dependencies through any import fails the test. It runs in both
the full and the gateway-only environment.
"""

from __future__ import annotations

import json

import pytest

from tests.support.without_engine import run_without_engine

IMPORT_EVERY_MODULE = """
import importlib
import json
import pkgutil
import sys

package = importlib.import_module(sys.argv[1])
names = [sys.argv[1]] + [
    info.name for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
]
failures = {}
for name in names:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failures[name] = f"{type(exc).__name__}: {exc}"
heavy = sorted(m for m in sys.modules if m.partition(".")[0] in ("torch", "triton", "safetensors"))
print(json.dumps({"modules": names, "failures": failures, "heavy": heavy}))
"""


@pytest.mark.parametrize(
    ("package", "min_modules"),
    [
        ("gateway", 40),
        ("policies", 5),
        ("openai_protocol", 3),
        ("engine_protocol", 1),
        ("model_files", 4),
        ("capacity_planner", 8),
    ],
)
def test_every_module_imports_without_the_engine(package: str, min_modules: int) -> None:
    result = run_without_engine(IMPORT_EVERY_MODULE, package)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["failures"] == {}
    assert report["heavy"] == []
    assert len(report["modules"]) >= min_modules  # the walk found the package's modules


def test_the_check_catches_a_module_that_needs_torch() -> None:
    result = run_without_engine(IMPORT_EVERY_MODULE, "backend_engine")
    assert result.returncode == 0, result.stderr
    failures = json.loads(result.stdout)["failures"]
    assert "backend_engine.worker.model_runner" in failures
    assert "torch" in failures["backend_engine.worker.model_runner"]
