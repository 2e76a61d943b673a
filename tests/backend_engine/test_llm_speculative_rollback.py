"""Speculative decoding's rollback and failure isolation, through the engine.

Rollback: a proposer whose drafts the target mostly rejects (a scripted one, see
``tests.support.scripted_proposer``) leaves the KV blocks and the prefix cache as a run
without speculation does, and no step ever leaves a block in the cache that holds a token
the target has not verified. Isolation: a proposer that raises for one request fails that
request alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from backend_engine import LLM, SamplingParams
from backend_engine.config import EngineConfig
from backend_engine.core.request import Request
from backend_engine.outputs import RequestOutput, SpeculativeCounts
from backend_engine.speculative.speculator import Proposer, Speculator
from engine_protocol.block_hash import hash_block
from tests.support.scripted_proposer import ScriptedProposer

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 96  # room for every test's requests at once: nothing is evicted
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SPECULATIVE: dict[str, Any] = {
    "speculative_proposer": "ngram",
    "speculative_ngram_min": 1,
    "num_speculative_tokens": 4,
    "speculative_crossover_batch_size": 64,
    "speculative_draft_cost": 0.0,  # drafts free: k follows acceptance alone
}


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 400, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_llm(path: Path, *, speculative: bool, **options: Any) -> LLM:
    settings: dict[str, Any] = {"dtype": "float32", "block_size": BLOCK_SIZE, **options}
    return LLM(model=str(path), **settings, **(SPECULATIVE if speculative else {}))


def speculator_of(llm: LLM) -> Speculator:
    speculator = llm.engine.speculator
    assert speculator is not None
    return speculator


def always_speculate(llm: LLM, proposer: Proposer) -> None:
    """Install ``proposer``, and keep every sequence at the full k however many drafts the
    target rejects."""
    speculator = speculator_of(llm)
    speculator.proposer = proposer
    speculator.settings = replace(speculator.settings, fixed_k=True)


@pytest.fixture(scope="module")
def checkpoint(demo_checkpoint: Callable[..., Path]) -> Path:
    return demo_checkpoint(size="tiny")


PROMPTS = [
    random_prompt(37, seed=1),
    random_prompt(16, seed=2),  # ends on a block boundary
    random_prompt(50, seed=3),
    random_prompt(21, seed=4),
]


def chain_hashes(token_ids: list[int], extra_key: bytes) -> list[bytes]:
    """The prefix-cache hash of each full block of ``token_ids``."""
    hashes: list[bytes] = []
    for end in range(BLOCK_SIZE, len(token_ids) + 1, BLOCK_SIZE):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[end - BLOCK_SIZE : end], extra_key))
    return hashes


def check_no_unverified_block_is_cached(
    llm: LLM, requests: list[Request], verified: dict[str, list[int]]
) -> None:
    """Every cached block of a running request lies within its computed tokens, holds its
    verified tokens (the reference run's), and is cached under their hash."""
    kv = llm.engine.kv_cache
    for request in requests:
        if request.is_finished:
            continue
        reference = verified[request.request_id]
        assert request.all_token_ids == reference[: request.num_tokens]
        assert request.num_computed_tokens <= request.num_tokens
        expected = chain_hashes(reference[: request.num_tokens], kv.extra_key)
        for index, block_id in enumerate(kv.block_table(request.request_id)):
            block_hash = kv.pool.blocks[block_id].block_hash
            if block_hash is None:
                continue
            assert (index + 1) * BLOCK_SIZE <= request.num_computed_tokens, (
                f"{request.request_id}: block {index} cached before its tokens were verified"
            )
            assert block_hash == expected[index]


def run_checked(llm: LLM, references: list[RequestOutput]) -> list[list[int]]:
    """Run ``PROMPTS`` step by step, checking the cache after every step; the outputs."""
    engine = llm.engine
    requests = [
        engine.make_request(f"rollback-{i}", prompt, GREEDY) for i, prompt in enumerate(PROMPTS)
    ]
    verified = {
        r.request_id: [*prompt, *ref.token_ids]
        for r, prompt, ref in zip(requests, PROMPTS, references, strict=True)
    }
    for request in requests:
        engine.add(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.new_token_ids)
        check_no_unverified_block_is_cached(llm, requests, verified)
    return [tokens[r.request_id] for r in requests]


def spoil_most(position: int, index: int) -> bool:
    """Keep 0 to 3 of a step's drafts (how many: a hash of the step's first position), never
    all four."""
    first = position - index
    return index >= ((first * 2654435761) >> 9) % 4


def test_after_heavy_rejection_the_blocks_and_the_cache_match_no_speculation(
    checkpoint: Path,
) -> None:
    plain = make_llm(checkpoint, speculative=False, num_kv_blocks=NUM_KV_BLOCKS)
    refs = plain.generate(PROMPTS, GREEDY)
    llm = make_llm(checkpoint, speculative=True, num_kv_blocks=NUM_KV_BLOCKS)
    vocab_size = llm.engine.model_config.vocab_size
    references = {tuple(p): r.token_ids for p, r in zip(PROMPTS, refs, strict=True)}
    always_speculate(llm, ScriptedProposer(references, vocab_size, spoil=spoil_most))
    outputs = run_checked(llm, refs)
    assert outputs == [r.token_ids for r in refs]
    counts = llm.engine.stats().speculative["scripted"]
    assert counts.num_draft_tokens >= 100
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens / 2, counts
    kv, plain_kv = llm.engine.kv_cache, plain.engine.kv_cache
    assert kv.num_used_blocks == plain_kv.num_used_blocks == 0
    assert kv.num_free_blocks == plain_kv.num_free_blocks
    assert kv.pool.cached_hashes == plain_kv.pool.cached_hashes
    # The same prompts again hit the same cached prefixes.
    again = llm.generate(PROMPTS, GREEDY)
    plain_again = plain.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in again] == [r.token_ids for r in refs]
    assert [o.num_cached_tokens for o in again] == [o.num_cached_tokens for o in plain_again]


def test_when_every_draft_is_rejected(checkpoint: Path) -> None:
    plain = make_llm(checkpoint, speculative=False, num_kv_blocks=NUM_KV_BLOCKS)
    refs = plain.generate(PROMPTS, GREEDY)
    llm = make_llm(checkpoint, speculative=True, num_kv_blocks=NUM_KV_BLOCKS)
    vocab_size = llm.engine.model_config.vocab_size
    references = {tuple(p): r.token_ids for p, r in zip(PROMPTS, refs, strict=True)}
    spoil_all = ScriptedProposer(references, vocab_size, spoil=lambda position, index: True)
    always_speculate(llm, spoil_all)
    assert run_checked(llm, refs) == [r.token_ids for r in refs]
    counts = llm.engine.stats().speculative["scripted"]
    assert counts.num_draft_tokens >= 100
    assert counts.num_accepted_tokens == 0
    assert llm.engine.kv_cache.num_free_blocks == plain.engine.kv_cache.num_free_blocks
    assert llm.engine.kv_cache.pool.cached_hashes == plain.engine.kv_cache.pool.cached_hashes


class RaisingProposer:
    """Delegates to another proposer, but raises for one prompt once it has ``after`` tokens."""

    name = "ngram"

    def __init__(self, inner: Proposer, prompt: list[int], after: int) -> None:
        self.inner = inner
        self.prompt = prompt
        self.after = after

    def propose(self, request: Request, k: int) -> tuple[int, ...]:
        if request.prompt_token_ids == self.prompt and request.num_output_tokens >= self.after:
            raise RuntimeError("the proposer broke")
        return self.inner.propose(request, k)

    def forget(self, request_id: str) -> None:
        self.inner.forget(request_id)


@pytest.mark.parametrize("after", [1, 6], ids=["first-decode", "later"])
def test_a_proposer_that_raises_fails_its_request_alone(checkpoint: Path, after: int) -> None:
    looping = [random_prompt(12, seed=s) * 4 for s in (11, 12, 13)]
    prompts = [looping[0], looping[1], looping[2]]
    plain = make_llm(checkpoint, speculative=False)
    refs = plain.generate(prompts, GREEDY)
    llm = make_llm(checkpoint, speculative=True)
    speculator = speculator_of(llm)
    speculator.proposer = RaisingProposer(speculator.proposer, prompts[1], after)
    outputs = llm.generate(prompts, GREEDY)
    failed = outputs[1]
    assert failed.finish_reason == "error"
    assert failed.error is not None
    assert "the proposer broke" in failed.error
    assert failed.token_ids == refs[1].token_ids[: len(failed.token_ids)]
    assert len(failed.token_ids) >= after
    for out, ref in [(outputs[0], refs[0]), (outputs[2], refs[2])]:
        assert (out.token_ids, out.text, out.finish_reason) == (
            ref.token_ids,
            ref.text,
            "length",
        )
    counts: SpeculativeCounts = llm.engine.stats().speculative["ngram"]
    assert counts.num_accepted_tokens > 0
    assert llm.engine.kv_cache.num_used_blocks == 0
    assert not llm.engine.scheduler.requests


def test_the_last_steps_kept_drafts_reach_the_prefix_cache(checkpoint: Path) -> None:
    """A 16-token prompt and 17 to 20 new tokens: the output's first block is full once the
    16th output token is computed, which a drafting run does in its last step."""
    plain = make_llm(checkpoint, speculative=False, num_kv_blocks=NUM_KV_BLOCKS)
    llm = make_llm(checkpoint, speculative=True, num_kv_blocks=NUM_KV_BLOCKS)
    vocab_size = llm.engine.model_config.vocab_size
    for max_tokens in range(17, 21):
        prompt = random_prompt(BLOCK_SIZE, seed=100 + max_tokens)
        params = replace(GREEDY, max_tokens=max_tokens)
        [ref] = plain.generate([prompt], params)
        always_speculate(llm, ScriptedProposer({tuple(prompt): ref.token_ids}, vocab_size))
        [out] = llm.generate([prompt], params)
        assert out.token_ids == ref.token_ids
        assert llm.engine.stats().speculative["scripted"].num_accepted_tokens > 0
        expected = chain_hashes([*prompt, *ref.token_ids[:-1]], llm.engine.kv_cache.extra_key)
        assert plain.engine.kv_cache.pool.cached_hashes >= set(expected)
        assert llm.engine.kv_cache.pool.cached_hashes == plain.engine.kv_cache.pool.cached_hashes


def test_speculation_refuses_an_int8_kv_cache() -> None:
    """A rejected draft written into an int8 block beside verified tokens can grow the block's
    scale and requantize them (kernels/int8_kv_cache.py), which trimming cannot undo: the
    outputs would differ from a run without speculation (3 of 10 did, measured)."""
    with pytest.raises(ValueError, match="speculative decoding needs a float KV cache"):
        EngineConfig(model="m", kv_cache_dtype="int8", speculative_proposer="ngram")
