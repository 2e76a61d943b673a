"""The ``system_fingerprint`` of an engine's answers: which build served which weights.

OpenAI's clients compare it to tell whether two answers to the same seeded request may
differ because the backend changed. Here it is derived from the engine's package version
and the model's identity (the checkpoint's fingerprint and the KV cache's dtype, the
prefix cache's key: `LLMEngine`'s ``kv_cache.extra_key``), so it changes when either does,
and stays the same across restarts of one build on one checkpoint. Computed once per engine.
"""

from __future__ import annotations

import hashlib
from importlib import metadata

from backend_engine.async_engine import AsyncEngine

DISTRIBUTION = "tollway"


def engine_build() -> str:
    """The installed package's version (``"unknown"`` when run from a bare source tree)."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"


def system_fingerprint(build: str, model_identity: bytes) -> str:
    """``"fp_"`` and 10 hex characters of a hash over the build and the model's identity."""
    digest = hashlib.blake2b(build.encode() + b"|" + model_identity, digest_size=5)
    return f"fp_{digest.hexdigest()}"


def engine_fingerprint(engine: AsyncEngine) -> str:
    """The fingerprint of the answers ``engine`` gives."""
    return system_fingerprint(engine_build(), engine.engine.kv_cache.extra_key)
