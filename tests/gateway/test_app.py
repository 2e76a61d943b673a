"""The gateway process stays light: it never loads the engine's stack."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_gateway_app_imports_neither_torch_nor_the_engine() -> None:
    # A gateway that imported torch would take ~2 s longer to start and ~300 MB more memory
    # per worker, for nothing: it shares only the SSE helpers and the tokenizer with the engine.
    code = (
        "import sys, gateway.app, gateway.serve; "
        "loaded = [m for m in ('torch', 'transformers', 'backend_engine.llm_engine', "
        "'backend_engine.server.app') if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)
