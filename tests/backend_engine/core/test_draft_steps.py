"""The scheduler's speculative side (``backend_engine.core.draft_steps``), driven by hand
through the scheduler: drafts scheduled after a decode's last token (``schedule_drafts``) and
the kept ones taken under the stop rule (``take_verified``), the rest trimmed."""

from __future__ import annotations

import itertools

from backend_engine.core.kv_cache_manager import KVCacheManager
from backend_engine.core.request import Request
from backend_engine.core.scheduler import Scheduler, SchedulerOutput
from backend_engine.sampling_params import SamplingParams

EOS = 0
BLOCK_SIZE = 4


class Harness:
    """A scheduler over a small KV cache; the test plays the runner."""

    def __init__(
        self,
        num_blocks: int = 64,
        budget: int = 64,
        max_model_len: int = 1024,
        watermark: float = 0.0,
    ) -> None:
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=8,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            watermark=watermark,
            eos_token_ids=frozenset({EOS}),
        )
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

    def step(self, token: int = 7, accepted: dict[str, list[int]] | None = None) -> SchedulerOutput:
        out = self.scheduler.schedule()
        sampled = {s.request_id: token for s in out.scheduled if s.do_sample}
        self.scheduler.update_from_output(out, sampled, accepted)
        return out


def decoding(h: Harness, rid: str = "a", **kw: object) -> Request:
    """A request past its prefill (6 prompt tokens in blocks 0 and 1, one token sampled)."""
    request = h.add(rid, **kw)  # type: ignore[arg-type]
    while not request.output_token_ids:  # a small budget prefills in chunks
        h.step()
    assert request.num_tokens - request.num_computed_tokens == 1
    return request


def test_drafts_follow_the_last_token_in_one_chunk() -> None:
    h = Harness()
    request = decoding(h)
    request.draft_token_ids = (21, 22, 23)
    out = h.scheduler.schedule()
    [item] = out.scheduled
    assert (item.start_position, item.num_tokens) == (6, 4)
    assert item.token_ids == [7, 21, 22, 23]
    assert item.draft_token_ids == (21, 22, 23)
    assert item.do_sample
    assert request.draft_token_ids == ()  # proposed for this step only
    assert h.kv.block_table("a") == [0, 1, 2]  # room for positions 6 to 9


def test_drafts_are_capped_by_max_tokens_the_budget_and_the_model_length() -> None:
    h = Harness()
    near_end = decoding(h, "a", max_tokens=3)  # one output token, two more allowed
    near_end.draft_token_ids = (21, 22, 23)
    [item] = h.scheduler.schedule().scheduled
    assert item.draft_token_ids == (21,)  # the target's own token is the last one

    h = Harness(budget=3)
    request = decoding(h)
    request.draft_token_ids = (21, 22, 23, 24)
    [item] = h.scheduler.schedule().scheduled
    assert item.draft_token_ids == (21, 22)

    h = Harness(max_model_len=9)
    request = decoding(h)  # 7 tokens of 9
    request.draft_token_ids = (21, 22, 23, 24)
    [item] = h.scheduler.schedule().scheduled
    assert item.draft_token_ids == (21, 22)


def test_drafts_without_room_above_the_watermark_are_dropped_not_preempting() -> None:
    h = Harness(num_blocks=4)
    a = decoding(h, "a")  # blocks 0, 1
    b = h.add("b", num_prompt=4)  # block 2
    h.step()
    a.draft_token_ids = (21, 22, 23, 24, 25, 26)  # would need two more blocks; one is free
    b.draft_token_ids = (31,)
    out = h.scheduler.schedule()
    assert not out.preempted_request_ids
    by_id = {s.request_id: s for s in out.scheduled}
    assert by_id["a"].draft_token_ids == ()
    assert by_id["a"].num_tokens == 1
    assert by_id["b"].draft_token_ids == (31,)


def test_a_prefilling_request_schedules_no_drafts() -> None:
    h = Harness(budget=4)
    request = h.add("a", num_prompt=10)
    h.step()  # 4 of 10 prompt tokens
    request.draft_token_ids = (21, 22)
    [item] = h.scheduler.schedule().scheduled
    assert item.draft_token_ids == ()
    assert item.num_tokens == 4


def test_kept_drafts_then_the_sampled_token_are_appended_and_the_rest_trimmed() -> None:
    h = Harness()
    request = decoding(h)
    request.draft_token_ids = (21, 22, 23, 24, 25, 26)  # positions 7 to 12: blocks 2 and 3
    h.step(token=30, accepted={"a": [21, 22]})
    assert request.output_token_ids == [7, 21, 22, 30]
    assert request.num_computed_tokens == 9  # 7 (the last token), 21, 22
    assert h.kv.block_table("a") == [0, 1, 2]  # block 3 only held rejected drafts
    assert h.kv.num_free_blocks == 61
    out = h.step(token=31)  # the next step computes 30 and samples on
    assert out.scheduled[0].token_ids == [30]
    assert request.output_token_ids == [7, 21, 22, 30, 31]


def test_all_drafts_rejected_keep_only_the_target_token() -> None:
    h = Harness()
    request = decoding(h)
    request.draft_token_ids = (21, 22, 23, 24, 25, 26)
    h.step(token=30, accepted={})
    assert request.output_token_ids == [7, 30]
    assert request.num_computed_tokens == 7
    assert h.kv.block_table("a") == [0, 1]
    assert h.kv.num_free_blocks == 62


def test_a_stop_token_among_the_kept_drafts_ends_the_request_there() -> None:
    h = Harness()
    request = decoding(h, stop_token_ids=[22])
    request.draft_token_ids = (21, 22, 23)
    h.step(token=30, accepted={"a": [21, 22, 23]})
    assert request.is_finished
    assert request.finish_reason == "stop"
    assert request.stop_token_id == 22
    assert request.output_token_ids == [7, 21, 22]
    assert h.kv.num_used_blocks == 0
    assert "a" not in h.scheduler.requests


def test_eos_among_the_kept_drafts_ends_the_request_unless_ignored() -> None:
    h = Harness()
    request = decoding(h)
    request.draft_token_ids = (21, EOS, 23)
    h.step(token=30, accepted={"a": [21, EOS, 23]})
    assert (request.finish_reason, request.output_token_ids) == ("stop", [7, 21, EOS])

    h = Harness()
    request = decoding(h, ignore_eos=True)
    request.draft_token_ids = (21, EOS, 23)
    h.step(token=30, accepted={"a": [21, EOS, 23]})
    assert not request.is_finished
    assert request.output_token_ids == [7, 21, EOS, 23, 30]


def test_max_tokens_is_reached_on_the_target_token_after_the_drafts() -> None:
    h = Harness()
    request = decoding(h, max_tokens=4)  # 1 output token; 3 more allowed: 2 drafts + 1
    request.draft_token_ids = (21, 22, 23)
    h.step(token=30, accepted={"a": [21, 22]})
    assert request.output_token_ids == [7, 21, 22, 30]
    assert request.finish_reason == "length"
    assert h.kv.num_used_blocks == 0


def test_an_item_that_got_no_token_keeps_no_draft() -> None:
    """The runner left it out (no token): no draft is known to be right."""
    h = Harness()
    request = decoding(h)
    request.draft_token_ids = (21, 22, 23, 24, 25, 26)
    out = h.scheduler.schedule()
    updated = h.scheduler.update_from_output(out, {}, {"a": [21, 22]})
    assert updated == []
    assert request.output_token_ids == [7]
    assert request.num_computed_tokens == 7
    assert h.kv.block_table("a") == [0, 1]


def test_the_model_length_stops_on_the_last_kept_draft() -> None:
    h = Harness(max_model_len=9)
    request = decoding(h)  # 7 tokens of 9
    request.draft_token_ids = (21, 22, 23)
    h.step(token=30, accepted={"a": [21, 22]})
    assert request.output_token_ids == [7, 21, 22]  # 9 tokens: the target's own is dropped
    assert request.finish_reason == "length"
    assert h.kv.num_used_blocks == 0
