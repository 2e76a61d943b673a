"""A grammar compiler on SmolLM2's 49k-token vocabulary (the tokenizer of the shipped GGUF)."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend_engine.config import EngineConfig
from backend_engine.structured_output.grammar_compiler import (
    GrammarCompiler,
    GrammarCompilerSettings,
)
from model_files.checkpoint import load_tokenizer
from model_files.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf: Path) -> Tokenizer:
    return load_tokenizer(smollm2_gguf)


def engine_settings(**overrides: float) -> GrammarCompilerSettings:
    """The engine's defaults (``EngineConfig``), with ``overrides``."""
    defaults = EngineConfig(model="unused")
    values = {
        "cache_size": defaults.grammar_cache_size,
        "compile_timeout_s": defaults.grammar_compile_timeout_s,
        **overrides,
    }
    return GrammarCompilerSettings(**values)  # type: ignore[arg-type]


@pytest.fixture
def compiler(smollm2_tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(smollm2_tokenizer, smollm2_tokenizer.vocab_size, engine_settings())
