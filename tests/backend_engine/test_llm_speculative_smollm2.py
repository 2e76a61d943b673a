"""Speculative decoding on SmolLM2 (the shipped GGUF), greedy: copy-heavy chat prompts give
the same tokens with the n-gram proposer as without it, as stored and dequantized."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from backend_engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
PARAGRAPH = (
    "The quick brown fox jumps over the lazy dog. The dog, startled, runs to the barn, "
    "where the farmer keeps three hens, two goats and an old grey horse named Pepper."
)
CODE = "def area(width, height):\n    return width * heigth\n\nprint(area(3, 4))\n"
QUESTIONS = [
    f"Repeat this paragraph word for word:\n\n{PARAGRAPH}",
    f"Fix the typo in this code and show the whole corrected code:\n\n{CODE}",
]


@pytest.mark.parametrize(
    ("dequantize", "questions"),
    [(False, QUESTIONS), (True, QUESTIONS[:1])],  # dequantized runs at float32's (slower) pace
    ids=["as-stored", "dequantized"],
)
def test_copy_heavy_chats_give_the_same_tokens(
    smollm2_gguf: Path, dequantize: bool, questions: list[str]
) -> None:
    # (a dict: LLM's EngineOptions does not list the speculative fields yet)
    speculative: dict[str, Any] = {
        "speculative_proposer": "ngram",
        "num_speculative_tokens": 4,
        "speculative_draft_cost": 0.0,  # drafts free: the as-stored target speculates too
    }
    llm = LLM(str(smollm2_gguf), dequantize=dequantize, **speculative)
    speculator = llm.engine.speculator
    assert speculator is not None
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    spec = llm.generate(prompts, GREEDY)
    counts = llm.engine.stats().speculative["ngram"]
    llm.engine.speculator = None  # the same engine, not speculating: the reference
    ref = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in ref]
    assert [o.text for o in spec] == [o.text for o in ref]
    assert counts.num_draft_tokens > 0
    assert counts.num_accepted_tokens >= 5, counts
    assert llm.engine.stats().speculative == {}
