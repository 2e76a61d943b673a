"""Tollway's inference engine: paged KV cache, prefix caching, continuous batching.

The public names load lazily, so the pure-Python parts (scheduler, block pool)
import without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from backend_engine.async_engine import AsyncEngine
    from backend_engine.config import EngineConfig
    from backend_engine.llm import LLM, ChatOutput
    from backend_engine.outputs import RequestOutput, RequestOutputDelta, TokenLogprob
    from backend_engine.request_priority import Priority
    from backend_engine.sampling_params import SamplingParams
    from backend_engine.structured_output.constraint import OutputConstraint

_EXPORTS = {
    "LLM": "backend_engine.llm",
    "ChatOutput": "backend_engine.llm",
    "OutputConstraint": "backend_engine.structured_output.constraint",
    "AsyncEngine": "backend_engine.async_engine",
    "EngineConfig": "backend_engine.config",
    "Priority": "backend_engine.request_priority",
    "RequestOutput": "backend_engine.outputs",
    "RequestOutputDelta": "backend_engine.outputs",
    "SamplingParams": "backend_engine.sampling_params",
    "TokenLogprob": "backend_engine.outputs",
}

__all__ = [
    "LLM",
    "AsyncEngine",
    "ChatOutput",
    "EngineConfig",
    "OutputConstraint",
    "Priority",
    "RequestOutput",
    "RequestOutputDelta",
    "SamplingParams",
    "TokenLogprob",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'backend_engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
