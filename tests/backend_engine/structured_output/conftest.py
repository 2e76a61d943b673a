"""A grammar compiler on SmolLM2's 49k-token vocabulary (the tokenizer of the shipped GGUF)."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend_engine.structured_output.grammar_compiler import GrammarCompiler
from model_files.checkpoint import load_tokenizer
from model_files.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf: Path) -> Tokenizer:
    return load_tokenizer(smollm2_gguf)


@pytest.fixture
def compiler(smollm2_tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(smollm2_tokenizer, smollm2_tokenizer.vocab_size)
