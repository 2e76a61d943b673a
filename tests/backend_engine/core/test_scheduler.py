import itertools

from backend_engine.core.kv_cache_manager import KVCacheManager
from backend_engine.core.request import Request, RequestStatus
from backend_engine.core.scheduler import Scheduler, SchedulerOutput
from backend_engine.request_priority import Priority
from backend_engine.sampling_params import SamplingParams

EOS = 0


class Harness:
    """A scheduler plus a fake model that always samples token 7."""

    def __init__(self, num_blocks=64, block_size=4, max_num_seqs=8, budget=64, **kw):
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=kw.pop("caching", True))
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=kw.pop("max_model_len", 1024),
            eos_token_ids=frozenset({EOS}),
            **kw,
        )
        self.arrivals = itertools.count()

    def add(self, rid, num_prompt=4, max_tokens=4, tenant="t", priority=Priority.INTERACTIVE):
        arrival = next(self.arrivals)
        req = Request(
            rid,
            [1000 * (arrival + 1) + i for i in range(num_prompt)],
            SamplingParams(max_tokens=max_tokens),
            max_tokens=max_tokens,
            arrival_seq=arrival,
            tenant_id=tenant,
            priority=priority,
        )
        self.scheduler.add_request(req)
        return req

    def step(self, token=7) -> SchedulerOutput:
        out = self.scheduler.schedule()
        sampled = {s.request_id: token for s in out.scheduled if s.do_sample}
        self.scheduler.update_from_output(out, sampled)
        return out


def scheduled_ids(out):
    return [s.request_id for s in out.scheduled]


def test_prefill_then_decode_then_length_finish():
    h = Harness()
    req = h.add("a", num_prompt=6, max_tokens=2)
    out = h.step()
    assert [(s.request_id, s.num_tokens, s.start_position) for s in out.scheduled] == [("a", 6, 0)]
    assert out.scheduled[0].do_sample
    assert req.output_token_ids == [7]
    out = h.step()
    assert [(s.num_tokens, s.start_position, s.token_ids) for s in out.scheduled] == [(1, 6, [7])]
    assert req.is_finished
    assert req.finish_reason == "length"
    assert h.kv.num_used_blocks == 0


def test_eos_stops_unless_ignored():
    h = Harness()
    req = h.add("a", max_tokens=5)
    h.step(token=EOS)
    assert req.finish_reason == "stop"


def test_the_scheduler_records_the_stop_token_it_finished_on():
    """The output processor leaves this token out of the text on the scheduler's word."""
    h = Harness()
    on_eos = h.add("eos", max_tokens=5)
    h.step(token=EOS)
    assert on_eos.stop_token_id == EOS
    by_length = h.add("length", max_tokens=1)
    h.step()
    assert by_length.finish_reason == "length"
    assert by_length.stop_token_id is None


def test_the_output_says_which_items_are_decodes_and_which_prefills():
    h = Harness(budget=8)
    h.add("a", num_prompt=4, max_tokens=10)
    h.step()
    h.add("long", num_prompt=20, max_tokens=2)
    out = h.step()
    assert [(s.request_id, s.is_decode) for s in out.decodes] == [("a", True)]
    assert [(s.request_id, s.is_decode) for s in out.prefills] == [("long", False)]
    assert out.scheduled == out.decodes + out.prefills


def test_chunked_prefill_never_stalls_running_decodes():
    h = Harness(budget=8)
    a = h.add("a", num_prompt=4, max_tokens=10)
    h.step()  # a prefilled
    h.add("long", num_prompt=20, max_tokens=2)
    out = h.step()
    # a decodes (1 token) and the long prompt gets the remaining 7.
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("long", 7)]
    assert not out.scheduled[1].do_sample
    out = h.step()
    assert [(s.request_id, s.num_tokens, s.start_position) for s in out.scheduled] == [
        ("a", 1, 5),
        ("long", 7, 7),
    ]
    out = h.step()
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("long", 6)]
    assert out.scheduled[1].do_sample
    assert a.num_output_tokens == 4


def test_decodes_come_first_in_the_batch():
    h = Harness(budget=6)
    h.add("long", num_prompt=10, max_tokens=3)
    h.step()  # 6 of 10 prompt tokens
    h.add("b", num_prompt=2, max_tokens=3)
    out = h.step()  # long: 4 more, b: 2
    out = h.step()
    assert scheduled_ids(out) == ["long", "b"]
    assert all(s.num_tokens == 1 for s in out.scheduled)


def test_max_num_seqs_caps_running():
    h = Harness(max_num_seqs=2)
    for rid in "abc":
        h.add(rid)
    out = h.step()
    assert scheduled_ids(out) == ["a", "b"]
    assert len(h.scheduler.waiting) == 1


def test_interactive_is_admitted_before_batch():
    h = Harness(max_num_seqs=1)
    h.add("batch", priority=Priority.BATCH)
    h.add("inter", priority=Priority.INTERACTIVE)
    assert scheduled_ids(h.step()) == ["inter"]


def test_tenants_share_admission_fairly():
    h = Harness(max_num_seqs=4)
    for i in range(6):
        h.add(f"burst{i}", tenant="noisy")
    h.add("quiet0", tenant="quiet")
    h.add("quiet1", tenant="quiet")
    out = h.step()
    # Tenants alternate by fewest running requests, oldest first on ties.
    assert scheduled_ids(out) == ["burst0", "quiet0", "burst1", "quiet1"]


def test_preemption_frees_blocks_and_recomputes_ahead_of_later_arrivals():
    # 6 blocks of 4 tokens; two requests with 8-token prompts use 4 blocks.
    h = Harness(num_blocks=6, block_size=4, watermark=0.0)
    a = h.add("a", num_prompt=8, max_tokens=12)
    b = h.add("b", num_prompt=8, max_tokens=12)
    h.step()
    h.add("late", num_prompt=4, max_tokens=2)
    preempted = []
    for _ in range(12):
        out = h.step()
        preempted += out.preempted_request_ids
        if preempted:
            break
    assert preempted == ["b"]  # the later arrival is the victim
    assert b.status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert h.scheduler.num_preemptions == 1
    # b comes back before "late", which arrived after it.
    waiting = list(h.scheduler.waiting)
    assert [r.request_id for r in waiting] == ["b", "late"]
    while not a.is_finished:
        h.step()
    outputs_before = list(b.output_token_ids)
    out = h.step()
    assert scheduled_ids(out)[0] == "b"
    # Recompute covers prompt and the tokens generated so far (less any prefix hit).
    first = out.scheduled[0]
    assert first.start_position + first.num_tokens == 8 + len(outputs_before)
    assert b.output_token_ids[: len(outputs_before)] == outputs_before
    while not b.is_finished:
        h.step()
    assert b.num_output_tokens == 12


def test_batch_request_is_preempted_before_interactive():
    h = Harness(num_blocks=4, block_size=4, watermark=0.0)
    inter = h.add("inter", num_prompt=7, max_tokens=8)
    batch = h.add("batch", num_prompt=7, max_tokens=8, priority=Priority.BATCH)
    h.step()
    for _ in range(3):
        out = h.step()
        if out.preempted_request_ids:
            break
    assert out.preempted_request_ids == ["batch"]
    assert inter.status is RequestStatus.RUNNING
    assert batch.status is RequestStatus.PREEMPTED


def test_prefix_hit_skips_prefill_and_records_cached_tokens():
    h = Harness(block_size=4)
    a = h.add("a", num_prompt=9, max_tokens=1)
    h.step()
    b = Request("b", a.prompt_token_ids, SamplingParams(max_tokens=1), 1, arrival_seq=99)
    h.scheduler.add_request(b)
    out = h.step()
    assert [(s.start_position, s.num_tokens) for s in out.scheduled] == [(8, 1)]
    assert b.num_cached_tokens == 8


def test_a_waiting_request_is_looked_up_in_the_prefix_cache_once_per_admission():
    """Under memory pressure a request waits several steps; the prefix-cache metrics count
    it once, with the prefix it is admitted with."""
    h = Harness(num_blocks=6, block_size=4)
    a = h.add("a", num_prompt=9, max_tokens=1)
    h.step()  # a: blocks 0-2, finishes; 0 and 1 stay cached, unreferenced
    h.add("big", num_prompt=16, max_tokens=3)
    b = Request("b", a.prompt_token_ids, SamplingParams(max_tokens=1), 1, arrival_seq=99)
    h.scheduler.add_request(b)
    lookups = 0
    lookup = h.kv.get_computed_blocks

    def counting_lookup(request):
        nonlocal lookups
        lookups += request is b
        return lookup(request)

    h.kv.get_computed_blocks = counting_lookup
    waited = 0
    while b.status is RequestStatus.WAITING:
        h.step()
        waited += 1
    assert waited >= 3
    assert lookups <= 2  # the first lookup, and its redo once big evicted block 1
    assert b.num_cached_tokens == 4  # only block 0 survived
    assert h.kv.prefix_cache_queries == 9 + 16 + 9
    assert h.kv.prefix_cache_hits == 0 + 0 + 4


def test_a_stale_lookup_never_hands_out_evicted_blocks():
    h = Harness(num_blocks=6, block_size=4)
    a = h.add("a", num_prompt=9, max_tokens=1)
    h.step()
    big = h.add("big", num_prompt=16, max_tokens=3)
    b = Request("b", a.prompt_token_ids, SamplingParams(max_tokens=2), 2, arrival_seq=99)
    h.scheduler.add_request(b)
    h.step()  # big admitted; b found blocks 0 and 1 but does not fit
    h.step()  # big's next block evicts block 1 from the cache
    assert 1 in h.kv.block_table("big")
    while b.status is RequestStatus.WAITING:
        h.step()
    assert big.is_finished
    assert b.num_cached_tokens == 4
    table = h.kv.block_table("b")
    assert table[0] == 0
    # Each full block holds b's own tokens: block 1, now holding big's, was not reused.
    assert [h.kv.pool.blocks[i].block_hash for i in table[:2]] == b.block_hashes[:2]


def test_cached_tokens_are_unknown_until_admission():
    h = Harness()
    req = h.add("a", num_prompt=6)
    assert req.num_cached_tokens is None
    h.step()
    assert req.num_cached_tokens == 0


def test_static_mode_waits_for_the_whole_batch_to_drain():
    h = Harness(mode="static")
    h.add("a", max_tokens=1)
    h.add("b", max_tokens=3)
    h.step()
    h.add("c", max_tokens=1)
    out = h.step()
    assert scheduled_ids(out) == ["b"]  # c waits although there is room
    h.step()
    out = h.step()
    assert scheduled_ids(out) == ["c"]


def test_static_mode_forms_a_whole_batch_even_beyond_one_steps_token_budget():
    h = Harness(mode="static", budget=8, max_num_seqs=4)
    for rid in "abcd":
        h.add(rid, num_prompt=6, max_tokens=2)
    out = h.step()
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("a", 6), ("b", 2)]
    assert [r.request_id for r in h.scheduler.running] == ["a", "b", "c", "d"]
    h.add("e", max_tokens=1)
    seen = []
    while h.scheduler.num_unfinished > 1:
        seen.append(scheduled_ids(h.step()))
    assert all("e" not in ids for ids in seen)  # e waits for the batch to drain
    assert any("c" in ids for ids in seen)
    assert any("d" in ids for ids in seen)
    assert scheduled_ids(h.step()) == ["e"]


def test_watermark_holds_back_admission():
    h = Harness(num_blocks=10, block_size=4, watermark=0.5)
    h.add("a", num_prompt=4, max_tokens=8)
    h.step()
    h.add("b", num_prompt=16, max_tokens=1)  # needs 4 blocks; 9 free, 5 must stay free
    out = h.step()
    assert scheduled_ids(out) == ["a"]


def test_abort_frees_waiting_and_running_requests():
    h = Harness()
    h.add("a")
    h.step()
    h.add("b")
    assert h.scheduler.finish("a", "abort") is not None
    assert h.scheduler.finish("b", "abort") is not None
    assert h.scheduler.finish("missing", "abort") is None
    assert h.kv.num_used_blocks == 0
    assert h.scheduler.schedule().is_empty


def test_a_tenants_long_prompt_in_progress_does_not_hold_back_another_tenants_first_token():
    """The issue's probe in miniature: before, the prompt in progress took the whole budget
    every step and the short request waited for it to end; then it shared the step with the
    prompt's chunk. Now b's first token has a short step of its own (a first-token step)."""
    h = Harness(num_blocks=256, budget=64)
    chatty = h.add("chatty", num_prompt=4, max_tokens=50, tenant="a")
    h.step()
    long_prompt = h.add("long", num_prompt=400, max_tokens=2, tenant="a")
    h.step()  # chatty decodes, long takes the other 63
    short = h.add("short", num_prompt=8, max_tokens=2, tenant="b")
    out = h.step()
    assert [(s.request_id, s.num_tokens) for s in out.decodes] == [("chatty", 1)]
    # b's whole prompt alone: a's chunk waits one (short) step, a's decodes do not.
    assert [(s.request_id, s.num_tokens, s.do_sample) for s in out.prefills] == [("short", 8, True)]
    assert short.output_token_ids == [7]
    assert long_prompt.num_computed_tokens == 63
    out = h.step()  # then a's chunk takes what the decodes leave, as before
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [
        ("chatty", 1),
        ("short", 1),
        ("long", 62),
    ]
    assert chatty.num_output_tokens == 4


def test_first_token_steps_never_follow_each_other():
    """A newcomer every step would otherwise defer the prompts in progress for ever."""
    h = Harness(num_blocks=512, budget=64)
    long_prompt = h.add("long", num_prompt=400, max_tokens=1, tenant="a")
    h.step()
    h.add("b", num_prompt=8, max_tokens=4, tenant="b")
    assert [(s.request_id, s.num_tokens) for s in h.step().prefills] == [("b", 8)]
    h.add("c", num_prompt=8, max_tokens=4, tenant="c")
    out = h.step()  # c shares this step with a's chunk; the next newcomer gets one alone
    assert [(s.request_id, s.num_tokens) for s in out.prefills] == [("long", 55), ("c", 8)]
    h.add("d", num_prompt=8, max_tokens=4, tenant="d")
    out = h.step()
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("b", 1), ("c", 1), ("d", 8)]
    assert long_prompt.num_computed_tokens == 64 + 55


def test_tenants_with_long_prompts_in_progress_share_the_prefill_budget():
    h = Harness(num_blocks=512, budget=64)
    a1 = h.add("a1", num_prompt=300, max_tokens=1, tenant="a")
    a2 = h.add("a2", num_prompt=300, max_tokens=1, tenant="a")
    h.step()  # a1: 64
    b = h.add("b", num_prompt=100, max_tokens=1, tenant="b")
    out = h.step()  # b's first chunk (its share) in a first-token step
    assert [(s.request_id, s.num_tokens) for s in out.prefills] == [("b", 32)]
    # then a's two prompts get a's half (a1 first, in running order), b the other half.
    for _ in range(2):
        out = h.step()
        assert [(s.request_id, s.num_tokens) for s in out.prefills] == [("a1", 32), ("b", 32)]
    out = h.step()  # b needs only 4 more: a takes the rest, a2 admitted with a's leftover
    assert [(s.request_id, s.num_tokens) for s in out.prefills] == [("a1", 60), ("b", 4)]
    assert b.is_finished
    assert a1.num_computed_tokens == 64 + 2 * 32 + 60
    assert a2.status is RequestStatus.WAITING  # admitted only when budget is left over


def test_the_running_share_cap_holds_while_another_tenant_waits_and_lifts_when_none_does():
    # 8 blocks of 4 tokens: b's first chunk (56 tokens, its share) never fits, so b waits.
    h = Harness(num_blocks=8, max_num_seqs=4, watermark=0.0, max_running_share=0.5)
    for i in range(4):
        h.add(f"a{i}", num_prompt=4, max_tokens=20, tenant="a")
    h.add("b", num_prompt=80, max_tokens=1, tenant="b", priority=Priority.BATCH)
    # a is interactive, so before the cap it took all four sequences at once.
    assert scheduled_ids(h.step()) == ["a0", "a1"]
    assert scheduled_ids(h.step()) == ["a0", "a1"]  # two sequences free, b still waiting
    h.scheduler.finish("b", "abort")
    assert scheduled_ids(h.step()) == ["a0", "a1", "a2", "a3"]


def test_the_running_share_cap_passes_a_tenant_over_for_one_that_fits():
    h = Harness(max_num_seqs=4, max_running_share=0.5)
    for i in range(3):
        h.add(f"a{i}", tenant="a")
    h.add("b", tenant="b", priority=Priority.BATCH)
    out = h.step()
    # a stops at its two while b waits; once b runs nobody else waits, and a2 comes in.
    assert scheduled_ids(out) == ["a0", "a1", "b", "a2"]


def test_another_tenants_first_chunk_gets_its_blocks_before_a_prompt_in_progress():
    """Before, the prompt in progress took the free blocks first (here: it did not fit, and
    preempted itself) and the short request waited; now the short request gets its blocks and
    the chunk shrinks to the blocks left above the watermark (here in the step after a
    first-token step, which another newcomer shares with the chunk)."""
    h = Harness(num_blocks=40, budget=64, watermark=0.05)  # 2 blocks kept free
    long_prompt = h.add("long", num_prompt=400, max_tokens=2, tenant="a")
    h.step()
    h.step()  # long: 128 tokens in 32 blocks, 8 free
    h.add("short_b", num_prompt=8, max_tokens=4, tenant="b")
    out = h.step()  # a first-token step: short_b's 2 blocks, long waits
    assert [(s.request_id, s.num_tokens) for s in out.prefills] == [("short_b", 8)]
    h.add("short_c", num_prompt=8, max_tokens=4, tenant="c")
    out = h.step()  # short_b's decode takes a block: 5 free, short_c 2 of them
    assert out.preempted_request_ids == []
    # long shrinks to the 1 block left above the watermark.
    assert [(s.request_id, s.num_tokens) for s in out.prefills] == [("long", 4), ("short_c", 8)]
    assert long_prompt.num_computed_tokens == 132
    assert h.kv.num_free_blocks == 2
