"""The choices of an ``n`` > 1 request: prefilled once, forked off the leader's KV blocks.

A fake model samples each item's and each fork's token from a table (7 by default), so every
case checks exact block ids, reference counts and what waits where, without torch.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from backend_engine.core.kv_cache_manager import BlockCopy, KVCacheManager
from backend_engine.core.request import Request, RequestStatus
from backend_engine.core.scheduler import Scheduler, SchedulerOutput
from backend_engine.sampling_params import SamplingParams

EOS = 0
BLOCK_SIZE = 4


class Harness:
    def __init__(
        self,
        num_blocks: int = 32,
        max_num_seqs: int = 16,
        budget: int = 64,
        caching: bool = True,
    ) -> None:
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=caching)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=1024,
            watermark=0.0,
            eos_token_ids=frozenset({EOS}),
        )
        self.arrivals = 0

    def add(self, rid: str, num_prompt: int, n: int = 1, max_tokens: int = 4) -> list[Request]:
        """A request of ``n`` choices as `LLMEngine.make_request` builds it: [leader, *forks]."""
        self.arrivals += 1
        prompt = [100 * self.arrivals + i for i in range(num_prompt)]
        params = SamplingParams(max_tokens=max_tokens)
        choices = [
            Request(
                rid if index == 0 else f"{rid}#{index}",
                prompt,
                params,
                max_tokens=max_tokens,
                arrival_seq=self.arrivals,
                group_id=rid,
                choice_index=index,
            )
            for index in range(n)
        ]
        choices[0].pending_forks = choices[1:]
        self.scheduler.add_request(choices[0])
        return choices

    def step(self, tokens: Mapping[str, int] | None = None) -> SchedulerOutput:
        """One step; ``tokens`` overrides the sampled token by request id."""
        tokens = tokens or {}
        out = self.scheduler.schedule()
        sampled: dict[str, int] = {}
        for item in out.scheduled:
            if item.do_sample:
                sampled[item.request_id] = tokens.get(item.request_id, 7)
                for fork in item.forks:
                    sampled[fork.request_id] = tokens.get(fork.request_id, 7)
        self.scheduler.update_from_output(out, sampled)
        return out

    def run_to_end(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.scheduler.requests:
                return
            self.step()
        raise AssertionError(f"still unfinished: {self.scheduler.requests}")

    def assert_all_blocks_free(self) -> None:
        assert self.kv.num_used_blocks == 0
        assert all(block.ref_cnt == 0 for block in self.kv.pool.blocks)


def test_forks_share_the_full_blocks_and_copy_the_partial_one() -> None:
    h = Harness()
    leader, one, two = h.add("a", num_prompt=10, n=3)
    assert one.status is RequestStatus.AWAITING_FORK
    assert [r.request_id for r in h.scheduler.waiting] == ["a"]  # the forks are not queued
    out = h.step(tokens={"a": 11, "a#1": 12, "a#2": 13})
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("a", 10)]
    assert [f.request_id for f in out.scheduled[0].forks] == ["a#1", "a#2"]
    assert [r.output_token_ids for r in (leader, one, two)] == [[11], [12], [13]]
    assert all(r.status is RequestStatus.RUNNING for r in (leader, one, two))
    assert one.num_computed_tokens == two.num_computed_tokens == 10
    table = h.kv.block_table("a")
    assert table == [0, 1, 2]
    assert h.kv.block_table("a#1") == [0, 1, 3]
    assert h.kv.block_table("a#2") == [0, 1, 4]
    assert [h.kv.pool.blocks[i].ref_cnt for i in range(5)] == [3, 3, 1, 1, 1]
    assert h.scheduler.num_computed_prompt_tokens == 10

    out = h.step()  # the copies come with the next step, before its forward pass
    assert out.block_copies == (BlockCopy(2, 3), BlockCopy(2, 4))
    assert [(s.request_id, s.token_ids, s.start_position) for s in out.decodes] == [
        ("a", [11], 10),
        ("a#1", [12], 10),
        ("a#2", [13], 10),
    ]
    assert h.step().block_copies == ()
    h.run_to_end()
    assert all(r.num_output_tokens == 4 for r in (leader, one, two))
    assert h.scheduler.num_computed_prompt_tokens == 10
    h.assert_all_blocks_free()


def test_a_prompt_that_fills_its_blocks_is_shared_whole() -> None:
    h = Harness()
    h.add("a", num_prompt=8, n=3)
    h.step()
    assert h.kv.block_table("a") == h.kv.block_table("a#1") == h.kv.block_table("a#2") == [0, 1]
    assert [h.kv.pool.blocks[i].ref_cnt for i in (0, 1)] == [3, 3]
    out = h.step()  # each writes its first token into a block of its own
    assert out.block_copies == ()
    assert [h.kv.block_table(rid)[2] for rid in ("a", "a#1", "a#2")] == [2, 3, 4]
    h.run_to_end()
    h.assert_all_blocks_free()


def test_the_leader_may_stop_on_its_first_token_its_forks_go_on() -> None:
    h = Harness()
    leader, one, two = h.add("a", num_prompt=10, n=3, max_tokens=3)
    h.step(tokens={"a": EOS})
    assert leader.finish_reason == "stop"
    assert h.kv.pool.blocks[2].ref_cnt == 0  # its partial block: free, but copied first
    assert [h.kv.pool.blocks[i].ref_cnt for i in (0, 1)] == [2, 2]
    out = h.step()
    assert out.block_copies == (BlockCopy(2, 3), BlockCopy(2, 4))
    h.run_to_end()
    assert [r.num_output_tokens for r in (one, two)] == [3, 3]
    h.assert_all_blocks_free()


def test_a_choice_that_stops_on_its_first_token_takes_no_blocks() -> None:
    h = Harness()
    _, one, _ = h.add("a", num_prompt=10, n=3)
    h.step(tokens={"a#1": EOS})
    assert one.finish_reason == "stop"
    assert one.stop_token_id == EOS
    assert h.kv.block_table("a#1") == []
    assert h.step().block_copies == (BlockCopy(2, 3),)  # a#2's only
    h.run_to_end()
    h.assert_all_blocks_free()


def test_a_choice_with_no_block_for_its_copy_waits_and_is_recomputed_from_the_cache() -> None:
    # 3 blocks: the leader's 10 prompt tokens take them all.
    h = Harness(num_blocks=3)
    leader, one = h.add("a", num_prompt=10, n=2, max_tokens=2)
    h.step(tokens={"a": 11, "a#1": 12})
    assert one.status is RequestStatus.WAITING
    assert one.output_token_ids == [12]  # its first token is kept
    assert list(h.scheduler.waiting) == [one]
    assert h.kv.block_table("a#1") == []
    h.step()  # the leader's last token: it finishes and frees its blocks
    assert leader.is_finished
    out = h.step()
    # The prefix cache has the two full blocks; the rest, and its first token, are computed.
    assert [(s.request_id, s.start_position, s.num_tokens) for s in out.scheduled] == [
        ("a#1", 8, 3)
    ]
    assert one.num_cached_tokens == leader.num_cached_tokens == 0  # the group's prompt's
    h.run_to_end()
    assert one.output_token_ids == [12, 7]
    h.assert_all_blocks_free()


def test_forks_beyond_max_num_seqs_wait() -> None:
    h = Harness(max_num_seqs=2)
    _, one, two = h.add("a", num_prompt=6, n=3)
    h.step()
    assert (one.status, two.status) == (RequestStatus.RUNNING, RequestStatus.WAITING)
    assert len(h.scheduler.running) == 2
    h.run_to_end()
    assert two.num_output_tokens == 4
    h.assert_all_blocks_free()


def test_a_leader_aborted_before_its_prefill_ends_lets_its_choices_prefill_themselves() -> None:
    h = Harness(budget=4)
    leader, one, two = h.add("a", num_prompt=10, n=3)
    h.step()  # 4 of 10 prompt tokens
    h.scheduler.finish("a#2", "abort")  # a pending choice leaves its leader
    assert leader.pending_forks == [one]
    h.scheduler.finish("a", "abort")
    assert one.status is RequestStatus.WAITING
    assert one.fork_parent is None
    assert list(h.scheduler.waiting) == [one]
    out = h.step()
    # The leader's first block outlives it in the prefix cache.
    assert [(s.request_id, s.start_position) for s in out.scheduled] == [("a#1", 4)]
    h.run_to_end()
    assert one.num_output_tokens == 4
    assert two.num_output_tokens == 0
    h.assert_all_blocks_free()


def test_a_failed_leader_leaves_its_choices_their_sampled_tokens() -> None:
    """The runner sampled the choices' first tokens (their matchers and generators moved on)
    but the leader's own row failed: they keep those tokens and recompute from there."""
    h = Harness()
    leader, one = h.add("a", num_prompt=10, n=2)
    out = h.scheduler.schedule()
    h.scheduler.finish("a", "error")  # as LLMEngine does with a runner's failure
    updated = h.scheduler.update_from_output(out, {"a#1": 12})
    assert updated == [one]
    assert one.output_token_ids == [12]
    assert one.status is RequestStatus.WAITING
    h.run_to_end()
    assert one.output_token_ids == [12, 7, 7, 7]
    assert leader.finish_reason == "error"
    h.assert_all_blocks_free()


def test_aborting_every_choice_frees_everything() -> None:
    h = Harness()
    choices = h.add("a", num_prompt=10, n=4)
    h.step()
    h.step()
    finished = h.scheduler.finish_many([r.request_id for r in choices], "abort")
    assert len(finished) == 4
    assert not h.scheduler.requests
    h.assert_all_blocks_free()


def test_a_leader_preempted_mid_prefill_keeps_its_pending_choices() -> None:
    # 4 blocks, 4 tokens a step: "old" decodes, and "a"'s prefill is chunked until its
    # third block is not there: the later arrival, "a", is preempted.
    h = Harness(num_blocks=4, budget=4)
    h.add("old", num_prompt=4, max_tokens=8)
    h.step()
    leader, one = h.add("a", num_prompt=12, n=2)
    preempted: list[str] = []
    for _ in range(6):
        preempted += h.step().preempted_request_ids
        if preempted:
            break
    assert preempted == ["a"]
    assert leader.pending_forks == [one]
    assert one.status is RequestStatus.AWAITING_FORK
    h.run_to_end()
    assert [leader.num_output_tokens, one.num_output_tokens] == [4, 4]
    h.assert_all_blocks_free()


def test_a_forked_choice_preempted_later_is_recomputed_like_any_request() -> None:
    h = Harness(num_blocks=6)
    leader, one, two = h.add("a", num_prompt=6, n=3, max_tokens=8)
    preempted: list[str] = []
    for _ in range(40):
        if not h.scheduler.requests:
            break
        preempted += h.step().preempted_request_ids
    assert preempted  # three sequences of 14 tokens do not fit in 6 blocks of 4
    assert h.scheduler.num_preemptions > 0
    assert [r.num_output_tokens for r in (leader, one, two)] == [8, 8, 8]
    h.assert_all_blocks_free()


def test_the_prompt_is_computed_once_and_a_cached_prefix_not_at_all() -> None:
    h = Harness()
    h.add("a", num_prompt=10, n=4)
    h.run_to_end()
    assert h.scheduler.num_computed_prompt_tokens == 10
    h.arrivals -= 1  # the same prompt again: its two full blocks are cached
    h.add("b", num_prompt=10, n=4)
    h.run_to_end()
    assert h.scheduler.num_computed_prompt_tokens == 10 + 2
    h.assert_all_blocks_free()


def test_a_choice_id_already_in_use_is_refused_and_nothing_is_queued() -> None:
    h = Harness()
    h.add("a#1", num_prompt=4)
    with pytest.raises(ValueError, match="'a#1' is already in use"):
        h.add("a", num_prompt=4, n=2)
    assert list(h.scheduler.requests) == ["a#1"]


def test_a_fork_with_no_room_for_its_copy_takes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    params = SamplingParams()
    parent = Request("p", list(range(6)), params, max_tokens=4, arrival_seq=0)
    child = Request("c", list(range(6)), params, max_tokens=4, arrival_seq=0)
    assert kv.allocate_slots(parent, 6) is not None
    parent.num_computed_tokens = 6
    assert kv.fork(parent, child, num_reserved_blocks=2) is None  # 2 free, both reserved
    assert kv.block_table("c") == []
    assert [block.ref_cnt for block in kv.pool.blocks] == [1, 1, 0, 0]
    assert kv.fork(parent, child, num_reserved_blocks=1) == (BlockCopy(1, 2),)
    assert kv.block_table("c") == [0, 2]
    assert [block.ref_cnt for block in kv.pool.blocks] == [2, 1, 1, 0]
    kv.free(parent)
    kv.free(child)
    assert [block.ref_cnt for block in kv.pool.blocks] == [0, 0, 0, 0]
