"""One request's failure fails only that request: the engine step isolates per-request work.

Each case batches a poisoned request with twelve others (greedy and seeded) and checks that
the poisoned one finishes with ``finish_reason="error"`` while the twelve produce exactly
the tokens they produce alone. Poisons are set past ``SamplingParams``' own checks
(``object.__setattr__``), or injected into one request's detokenizer, stop strings or
forward pass, so the tests hold whatever validation runs before the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from backend_engine.config import EngineConfig
from backend_engine.core.scheduler import ScheduledRequest
from backend_engine.llm_engine import LLMEngine
from backend_engine.sampling_params import SamplingParams
from backend_engine.text import output_processor
from backend_engine.text.detokenizer import IncrementalDetokenizer
from backend_engine.text.stop_strings import StopStringMatcher

NUM_OTHERS = 12
MAX_TOKENS = 24
POISON = "poison"
POISON_PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24] * 3


@pytest.fixture(scope="module")
def engine(demo_checkpoint: Callable[..., Path]) -> LLMEngine:
    config = EngineConfig(
        model=str(demo_checkpoint(size="tiny")), dtype="float32", show_progress=False
    )
    return LLMEngine(config)


@dataclass
class Outcome:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    num_completion_tokens: int = 0


def run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]]) -> dict:
    """Queue ``requests`` together and step until all finish; each one's outcome."""
    outcomes = {rid: Outcome() for rid, _, _ in requests}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for delta in engine.step():
            outcome = outcomes[delta.request_id]
            outcome.token_ids += delta.new_token_ids
            outcome.text += delta.new_text
            if delta.finished:
                outcome.finish_reason = delta.finish_reason
                outcome.error = delta.error
                outcome.num_completion_tokens = delta.num_completion_tokens
    assert not engine.has_unfinished()
    return outcomes


def others() -> list[tuple[str, list[int], SamplingParams]]:
    """Twelve requests of another tenant: half greedy, half seeded with top-k/top-p."""
    requests = []
    for i in range(NUM_OTHERS):
        if i % 2:
            params = SamplingParams(
                max_tokens=MAX_TOKENS,
                temperature=0.9,
                top_k=40,
                top_p=0.95,
                seed=1000 + i,
                ignore_eos=True,
            )
        else:
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        requests.append((f"other-{i}", [3 + i, 40 + 2 * i, 17, 90 + i, 8 * i + 1], params))
    return requests


@pytest.fixture(scope="module")
def alone(engine: LLMEngine) -> dict[str, list[int]]:
    """The twelve's tokens, each run on its own."""
    return {rid: run(engine, [(rid, p, sp)])[rid].token_ids for rid, p, sp in others()}


def poisoned(**fields: Any) -> SamplingParams:
    """Valid params with ``fields`` set afterwards, past any check ``__post_init__`` makes."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True)
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


def assert_only_the_poison_failed(
    engine: LLMEngine, outcomes: dict[str, Outcome], alone: dict[str, list[int]]
) -> Outcome:
    failed = outcomes.pop(POISON)
    assert failed.finish_reason == "error"
    assert failed.error
    assert {rid: o.token_ids for rid, o in outcomes.items()} == alone
    assert all(o.finish_reason == "length" and o.error is None for o in outcomes.values())
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == stats.num_kv_blocks_used == 0
    return failed


@pytest.mark.parametrize(
    "fields",
    [
        {"seed": 2**64},
        {"seed": -(2**70)},
        {"top_k": 10**20},
        {"logprobs": 10**6},
        {"temperature": 0.0, "logprobs": 10**6},
    ],
    ids=["seed-past-64-bits", "negative-seed", "top-k-past-64-bits", "logprobs", "greedy-logprobs"],
)
def test_bad_sampling_params_fail_only_their_request(
    engine: LLMEngine, alone: dict[str, list[int]], fields: dict[str, Any]
) -> None:
    requests = others()
    requests.insert(5, (POISON, POISON_PROMPT, poisoned(**fields)))
    failed = assert_only_the_poison_failed(engine, run(engine, requests), alone)
    assert failed.token_ids == []
    assert failed.num_completion_tokens == 0


def test_a_failing_detokenizer_fails_only_its_request_after_what_it_delivered(
    engine: LLMEngine, alone: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    class Exploding(IncrementalDetokenizer):
        def add(self, token_id: int) -> str:
            if len(self.output_token_ids) == 3:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "exploded")
            return super().add(token_id)

    def detokenizer(tokenizer: Any, prompt: list[int], skip: bool) -> IncrementalDetokenizer:
        kind = Exploding if list(prompt) == POISON_PROMPT else IncrementalDetokenizer
        return kind(tokenizer, prompt, skip)

    monkeypatch.setattr(output_processor, "IncrementalDetokenizer", detokenizer)
    requests = others()
    requests.append((POISON, POISON_PROMPT, poisoned(temperature=0.0)))
    failed = assert_only_the_poison_failed(engine, run(engine, requests), alone)
    assert len(failed.token_ids) == failed.num_completion_tokens == 3
    assert "UnicodeDecodeError" in (failed.error or "")


def test_failing_stop_strings_fail_only_their_request(
    engine: LLMEngine, alone: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def feed(self: StopStringMatcher, delta: str) -> tuple[str, bool]:
        raise IndexError("stop strings exploded")

    monkeypatch.setattr(StopStringMatcher, "feed", feed)  # only the poison has stop strings
    requests = others()
    requests.insert(0, (POISON, POISON_PROMPT, poisoned(stop=["never-seen"])))
    failed = assert_only_the_poison_failed(engine, run(engine, requests), alone)
    assert "stop strings exploded" in (failed.error or "")


def fail_forward_when(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, is_bad: Callable[[list[str]], bool]
) -> list[list[str]]:
    """Make the model's forward pass raise whenever ``is_bad(request ids in the batch)``;
    returns the log of batches attempted."""
    runner = engine.runner
    batches: list[list[str]] = []
    prepare, forward = runner._prepare, runner.model.forward

    def recording_prepare(decodes: list[ScheduledRequest], prefills: list[ScheduledRequest]) -> Any:
        batches.append([s.request_id for s in (*decodes, *prefills)])
        return prepare(decodes, prefills)

    def failing_forward(*args: Any) -> torch.Tensor:
        if is_bad(batches[-1]):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return forward(*args)

    monkeypatch.setattr(runner, "_prepare", recording_prepare)
    monkeypatch.setattr(runner.model, "forward", failing_forward)
    return batches


def test_a_forward_pass_failing_with_one_request_in_the_batch_fails_only_it(
    engine: LLMEngine, alone: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    batches = fail_forward_when(engine, monkeypatch, lambda ids: POISON in ids)
    requests = others()
    requests.insert(7, (POISON, POISON_PROMPT, poisoned(temperature=0.0)))
    assert_only_the_poison_failed(engine, run(engine, requests), alone)
    assert POISON in batches[0]
    assert len(batches[0]) == NUM_OTHERS + 1
    assert [POISON] in batches  # then tried alone


def test_a_failed_prefill_leaves_no_unwritten_blocks_in_the_prefix_cache(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failed request's blocks were offered to the prefix cache when allocated, but its
    forward pass never wrote them: a later request with the same prompt must not reuse them."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    (reference,) = run(engine, [("reference", POISON_PROMPT, params)]).values()
    engine.kv_cache.pool.reset_prefix_cache()
    for keys, values in engine.runner.kv_caches:  # no stale copy of the right KV anywhere
        keys.zero_()
        values.zero_()
    with monkeypatch.context() as patch:
        fail_forward_when(engine, patch, lambda ids: "first" in ids)
        (first,) = run(engine, [("first", POISON_PROMPT, params)]).values()
    assert first.finish_reason == "error"
    (second,) = run(engine, [("second", POISON_PROMPT, params)]).values()
    assert second.token_ids == reference.token_ids


def test_a_failure_with_every_request_alone_fails_them_all_and_the_engine_goes_on(
    engine: LLMEngine, alone: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as patch:
        fail_forward_when(engine, patch, lambda ids: True)
        outcomes = run(engine, others()[:4])
    assert all(o.finish_reason == "error" and o.token_ids == [] for o in outcomes.values())
    assert engine.stats().num_kv_blocks_used == 0
    outcomes = run(engine, others())
    assert {rid: o.token_ids for rid, o in outcomes.items()} == alone


@pytest.fixture(autouse=True)
def _fresh_prefix_cache(engine: LLMEngine) -> Iterator[None]:
    yield
    engine.kv_cache.pool.reset_prefix_cache()


def test_a_request_aborted_before_admission_reports_no_cached_tokens(engine: LLMEngine) -> None:
    engine.add_request("never-admitted", [5, 6, 7], SamplingParams(max_tokens=4))
    (delta,) = engine.abort(["never-admitted"])
    assert delta.finished
    assert delta.finish_reason == "abort"
    assert delta.num_cached_tokens is None  # unknown, not a sentinel
