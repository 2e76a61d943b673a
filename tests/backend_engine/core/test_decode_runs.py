"""Decode runs (``backend_engine.core.decode_runs``), driven by hand through the scheduler: when a
step becomes a run, the lookahead room it takes, and its tokens taken back under the stop rule."""

from __future__ import annotations

import itertools

import pytest

from backend_engine.core.decode_runs import decode_run_length
from backend_engine.core.kv_cache_manager import KVCacheManager
from backend_engine.core.request import Request
from backend_engine.core.scheduler import Scheduler, SchedulerOutput
from backend_engine.sampling_params import SamplingParams

EOS = 0
BLOCK_SIZE = 4
GREEDY: dict[str, object] = {"temperature": 0.0}


class Harness:
    """A scheduler over a small KV cache, runs of up to ``max_steps``; the test plays the
    runner."""

    def __init__(
        self,
        num_blocks: int = 64,
        max_steps: int = 4,
        max_model_len: int = 1024,
        enable_caching: bool = False,
    ) -> None:
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=enable_caching)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            max_model_len=max_model_len,
            watermark=0.0,
            eos_token_ids=frozenset({EOS}),
        )
        self.scheduler.max_decode_steps = max_steps
        self.arrivals = itertools.count()

    def add(self, rid: str, num_prompt: int = 6, max_tokens: int = 16, **params: object) -> Request:
        arrival = next(self.arrivals)
        request = Request(
            rid,
            [1000 * (arrival + 1) + i for i in range(num_prompt)],
            SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
            max_tokens=max_tokens,
            arrival_seq=arrival,
        )
        self.scheduler.add_request(request)
        return request

    def step(self, tokens: dict[str, list[int]] | None = None) -> SchedulerOutput:
        """Schedule, then give each item ``tokens[id]`` (a run's, in order; default 7s)."""
        out = self.scheduler.schedule()
        runs = {
            s.request_id: (tokens or {}).get(s.request_id, [7] * s.num_steps)
            for s in out.scheduled
            if s.do_sample
        }
        self.scheduler.update_from_output(
            out,
            {rid: run[-1] for rid, run in runs.items()},
            {rid: run[:-1] for rid, run in runs.items() if len(run) > 1},
        )
        return out


def decoding(h: Harness, rid: str = "a", **kw: object) -> Request:
    """A greedy request past its prefill (6 prompt tokens, one token sampled)."""
    request = h.add(rid, **{**GREEDY, **kw})  # type: ignore[arg-type]
    while not request.output_token_ids:
        h.step()
    assert request.num_tokens - request.num_computed_tokens == 1
    return request


def test_a_lone_greedy_decode_runs_with_lookahead_room() -> None:
    h = Harness(max_steps=4)
    request = decoding(h)  # 7 tokens: positions 0-5 prompt, 6 the first output
    out = h.scheduler.schedule()
    [item] = out.scheduled
    assert (item.num_steps, item.token_ids, item.start_position) == (4, [7], 6)
    assert h.kv.block_table("a") == [0, 1, 2]  # positions 6-9: the run's 4 steps
    h.scheduler.update_from_output(out, {"a": 24}, {"a": [21, 22, 23]})
    assert request.output_token_ids == [7, 21, 22, 23, 24]
    assert request.num_computed_tokens == 10  # the last token's KV is the next step's


def test_a_run_stops_where_step_by_step_decoding_would() -> None:
    h = Harness(num_blocks=8, max_steps=8)
    request = decoding(h)
    out = h.step({"a": [21, EOS, 22, 23, 24, 25, 26, 27]})
    assert out.scheduled[0].num_steps == 8
    assert request.output_token_ids == [7, 21, EOS]
    assert request.finish_reason == "stop"
    assert h.kv.num_free_blocks == 8  # the run's lookahead blocks went back too


def test_runs_are_capped_by_max_tokens_and_the_model_length() -> None:
    h = Harness(max_steps=8)
    decoding(h, max_tokens=4)  # one of 4 output tokens so far
    [item] = h.step().scheduled
    assert item.num_steps == 3

    h = Harness(max_steps=8, max_model_len=10)
    request = decoding(h)  # 7 tokens of 10
    [item] = h.step().scheduled
    assert item.num_steps == 3
    assert request.finish_reason == "length"

    h = Harness(max_steps=8)
    decoding(h, max_tokens=2)
    assert h.step().scheduled[0].num_steps == 1  # one token left: a plain step


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.7},
        {"logprobs": 2},
        {"presence_penalty": 0.5},
        {"logit_bias": {5: 1.0}},
    ],
)
def test_only_greedy_decodes_with_plain_logits_run(params: dict[str, object]) -> None:
    h = Harness()
    decoding(h, "a")
    decoding(h, "b", **params)
    out = h.step()
    assert [s.num_steps for s in out.scheduled] == [1, 1]


def test_a_batch_of_greedy_decodes_runs_as_one() -> None:
    h = Harness(max_steps=4)
    a, b = decoding(h, "a"), decoding(h, "b", max_tokens=3)
    out = h.step({"a": [21, 22], "b": [31, 32]})
    assert [s.num_steps for s in out.scheduled] == [2, 2]  # b's two tokens left cap both
    assert a.output_token_ids[-2:] == [21, 22]
    assert b.output_token_ids[-2:] == [31, 32]


def test_no_run_while_a_request_waits_or_prefills() -> None:
    h = Harness()
    decoding(h, "a")
    h.add("b", num_prompt=6, **GREEDY)  # type: ignore[arg-type]
    out = h.step()  # b is admitted and prefilled in this step
    assert [s.num_steps for s in out.scheduled] == [1, 1]
    out = h.step()  # both decode now, nobody waits
    assert [s.num_steps for s in out.scheduled] == [4, 4]


def test_no_run_without_the_blocks_and_no_table_grows() -> None:
    h = Harness(num_blocks=3, max_steps=8)  # a holds 2 blocks; a run of 8 needs 2 more
    decoding(h, "a")
    out = h.step()
    assert out.scheduled[0].num_steps == 1
    assert h.kv.block_table("a") == [0, 1]


def test_max_decode_steps_of_one_is_off() -> None:
    h = Harness(max_steps=1)
    decoding(h)
    assert h.step().scheduled[0].num_steps == 1


def test_a_runs_blocks_are_offered_to_the_prefix_cache_once_its_tokens_are_taken() -> None:
    h = Harness(max_steps=4, enable_caching=True)
    request = decoding(h, max_tokens=8)  # positions 0-6 known
    h.step({"a": [21, 22, 23, 24]})  # positions 7-10: blocks 0 and 1 full of known KV
    assert request.num_computed_tokens == 10
    assert len(request.block_hashes) == 2


def test_decode_run_length_fits_the_time_limit() -> None:
    assert decode_run_length(None, 0.05, 8) == 1  # not timed yet
    assert decode_run_length(0.005, 0.05, 8) == 8
    assert decode_run_length(0.02, 0.05, 8) == 2
    assert decode_run_length(0.08, 0.05, 8) == 1
