"""The engine on an int8 KV cache (``kv_cache_dtype="int8"``): its size, its prefix-cache key,
and its answers next to a float32 cache's, with prefix caching and with preemption.

Tolerances, measured on the demo checkpoints (random weights, so flatter and closer
distributions than a trained model's): prompt logprobs within 0.15 nats of float32's (seen:
<= 0.08) and 0.04 on a prompt's average (seen: <= 0.022; a scale per token instead of per
block would halve it); greedy tokens equal wherever float32's choice
is clear, i.e. the first token that differs is one float32 itself rated within 0.25 nats of
its pick. The perplexity of a real model (docs/benchmarks.md, "int8 KV cache") is the
quality figure; these tests catch a broken cache (a stale or lost scale, a misread block).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from backend_engine import LLM, SamplingParams
from backend_engine.config import EngineConfig
from backend_engine.llm_engine import LLMEngine
from backend_engine.outputs import RequestOutput
from backend_engine.worker.model_runner import ModelRunner, plan_model_runner

MAX_PROMPT_LOGPROB_ERROR = 0.15
MAX_MEAN_PROMPT_LOGPROB_ERROR = 0.04
CLOSE_CALL = 0.25  # nats between float32's pick and the int8 cache's, where they may differ
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def checkpoint(demo_checkpoint: Callable[..., Path]) -> str:
    return str(demo_checkpoint(size="small"))


def prompts(lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in lengths]


def assert_prompt_logprobs_close(want: RequestOutput, got: RequestOutput) -> None:
    assert want.prompt_logprobs is not None
    assert got.prompt_logprobs is not None
    errors = [
        abs(w.logprob - g.logprob)
        for w, g in zip(want.prompt_logprobs[1:], got.prompt_logprobs[1:], strict=True)
        if w is not None and g is not None
    ]
    assert max(errors) <= MAX_PROMPT_LOGPROB_ERROR
    assert sum(errors) / len(errors) <= MAX_MEAN_PROMPT_LOGPROB_ERROR


def assert_same_clear_choices(want: RequestOutput, got: RequestOutput) -> None:
    """Equal tokens up to the first difference, which must be a close call for ``want``."""
    assert want.logprobs is not None
    for position, (w, g) in enumerate(zip(want.token_ids, got.token_ids, strict=True)):
        if w != g:
            alternatives = dict(want.logprobs[position].top)
            assert g in alternatives, f"token {position}: {g} is not among float32's top 5"
            assert alternatives[w] - alternatives[g] <= CLOSE_CALL, f"token {position}"
            return


def test_an_int8_cache_holds_over_3_5x_the_tokens_under_its_own_prefix_cache_key(
    checkpoint: str,
) -> None:
    budget = 8 * 1024 * 1024
    engines = {
        kv: LLMEngine(
            EngineConfig(
                model=checkpoint,
                dtype="float32",
                kv_cache_dtype=kv,
                kv_cache_memory_bytes=budget,
                show_progress=False,
            )
        )
        for kv in ("auto", "int8")
    }
    float_blocks = engines["auto"].kv_cache.num_blocks
    int8_blocks = engines["int8"].kv_cache.num_blocks
    assert int8_blocks >= 3.5 * float_blocks
    runner = engines["int8"].runner
    assert isinstance(runner, ModelRunner)
    key_cache, value_cache = runner.kv_caches[0]
    assert key_cache.dtype == value_cache.dtype == torch.int8
    assert key_cache.shape[:2] == (int8_blocks, 16 + 1)  # block_size 16 and its scale row
    # Blocks of one cache type never answer a lookup from the other.
    assert engines["int8"].kv_cache.extra_key != engines["auto"].kv_cache.extra_key
    config = engines["int8"].config
    assert plan_model_runner(config, engines["int8"].model_config).kv_dtype == "int8"


def test_greedy_tokens_and_prompt_logprobs_stay_close_to_a_float32_cache(checkpoint: str) -> None:
    batch = prompts([5, 23, 40, 70, 130, 250])
    params = SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True, logprobs=5, prompt_logprobs=0
    )
    want = LLM(model=checkpoint, dtype="float32").generate(batch, params)
    got = LLM(model=checkpoint, dtype="float32", kv_cache_dtype="int8").generate(batch, params)
    for w, g in zip(want, got, strict=True):
        assert_prompt_logprobs_close(w, g)
        assert_same_clear_choices(w, g)
    assert sum(w.token_ids == g.token_ids for w, g in zip(want, got, strict=True)) >= 3


def test_prefix_cached_int8_blocks_give_the_answer_computed_without_them(checkpoint: str) -> None:
    prefix, first_tail, second_tail = prompts([48, 7, 9], seed=1)
    cached = LLM(model=checkpoint, dtype="float32", kv_cache_dtype="int8")
    cached.generate([prefix + first_tail], GREEDY)
    second = cached.generate([prefix + second_tail], GREEDY)[0]
    assert second.num_cached_tokens == 48  # three whole blocks of 16
    uncached = LLM(
        model=checkpoint, dtype="float32", kv_cache_dtype="int8", enable_prefix_caching=False
    )
    alone = uncached.generate([prefix + second_tail], GREEDY)[0]
    assert alone.num_cached_tokens == 0
    assert second.token_ids == alone.token_ids
    assert second.logprobs is not None
    assert alone.logprobs is not None
    for a, b in zip(second.logprobs, alone.logprobs, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)


def test_preempted_requests_and_reused_blocks_keep_their_answers(checkpoint: str) -> None:
    """A pool too small for the batch: requests are preempted, their blocks freed and
    rewritten by others (stale scales), and they are recomputed; every answer stays as the
    same int8 cache's with room to spare."""
    batch = prompts([30, 45, 60, 20, 75, 50], seed=2)
    roomy = LLM(model=checkpoint, dtype="float32", kv_cache_dtype="int8", block_size=8)
    want = roomy.generate(batch, GREEDY)
    tight = LLM(
        model=checkpoint, dtype="float32", kv_cache_dtype="int8", block_size=8, num_kv_blocks=24
    )
    got = tight.generate(batch, GREEDY)
    assert tight.engine.scheduler.num_preemptions > 0
    for w, g in zip(want, got, strict=True):
        assert_same_clear_choices(w, g)
    assert sum(w.token_ids == g.token_ids for w, g in zip(want, got, strict=True)) >= 4
