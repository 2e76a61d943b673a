"""Whether the inference engine is installed here, and what to say when it is not.

``pip install tollway`` is the gateway alone; the engine needs torch, which comes with
``pip install 'tollway[engine]'``. Everything that would start or load an engine asks
`require_engine` first, so a gateway-only install says how to add the engine in one line
instead of failing later on an import. torch is looked up, never imported.
"""

from __future__ import annotations

import importlib.util

ENGINE_INSTALL_COMMAND = "pip install 'tollway[engine]'"


class EngineNotInstalledError(RuntimeError):
    """The engine's dependencies (torch) are missing; the message says how to add them."""


def is_engine_installed() -> bool:
    """Whether torch can be found (without importing it)."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def require_engine(purpose: str) -> None:
    """Raise `EngineNotInstalledError` naming ``purpose`` unless the engine is installed."""
    if not is_engine_installed():
        raise EngineNotInstalledError(
            f"{purpose} needs the inference engine, which is not installed "
            f"(this is a gateway-only install): {ENGINE_INSTALL_COMMAND}"
        )
