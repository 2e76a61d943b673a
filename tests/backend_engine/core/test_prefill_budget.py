import pytest

from backend_engine.core.prefill_budget import (
    PrefillContender,
    first_token_tenants,
    prefill_contenders,
    running_cap,
    share_prefill_budget,
)
from backend_engine.core.request import Request
from backend_engine.core.waiting_queue import WaitingQueue
from backend_engine.request_priority import Priority
from backend_engine.sampling_params import SamplingParams


def req(rid, arrival, tenant, num_prompt, num_computed=0, priority=Priority.INTERACTIVE):
    request = Request(
        rid,
        list(range(num_prompt)),
        SamplingParams(),
        1,
        arrival,
        tenant_id=tenant,
        priority=priority,
    )
    request.num_computed_tokens = num_computed
    return request


def test_short_demands_are_met_and_the_longest_takes_the_rest():
    shares = share_prefill_budget(2000, {"b": 30, "c": 600, "a": 1900})
    assert shares == {"b": 30, "c": 600, "a": 1370}


def test_equal_demands_split_evenly_the_remainder_to_the_first_in_turn():
    assert share_prefill_budget(5, {"x": 10, "y": 10}) == {"x": 3, "y": 2}
    assert share_prefill_budget(1, {"x": 10, "y": 10}) == {"x": 1, "y": 0}


def test_the_split_spends_the_whole_budget_or_every_demand():
    assert share_prefill_budget(100, {"x": 10, "y": 20, "z": 0}) == {"x": 10, "y": 20, "z": 0}
    shares = share_prefill_budget(97, {"x": 50, "y": 40, "z": 45})
    assert sum(shares.values()) == 97
    assert shares == {"x": 33, "y": 32, "z": 32}


def test_contenders_want_their_prompts_in_progress_and_what_they_could_admit():
    waiting = WaitingQueue()
    waiting.add(req("b1", 5, "b", 30))
    waiting.add(req("b2", 6, "b", 3000))
    waiting.add(req("a3", 4, "a", 500))
    running_prefills = [req("a1", 0, "a", 2000, num_computed=500)]
    contenders = prefill_contenders(
        running_prefills,
        waiting,
        {"a": 3},
        budget=2048,
        num_free_seqs=8,
        max_running=None,
        num_uncached_tokens=lambda r: r.num_tokens,
    )
    # b runs nothing, so it goes first; a wants 1,500 + 500, b 30 + 3,000 (at most 2,048).
    assert [(c.tenant_id, c.num_tokens) for c in contenders] == [("b", 2048), ("a", 2000)]


def test_a_capped_tenant_wants_only_its_prompts_in_progress():
    waiting = WaitingQueue()
    waiting.add(req("a3", 4, "a", 500))
    waiting.add(req("b1", 5, "b", 30))
    running_prefills = [req("a1", 0, "a", 100, num_computed=50)]
    contenders = prefill_contenders(
        running_prefills, waiting, {"a": 2}, 2048, 8, 2, lambda r: r.num_tokens
    )
    assert {c.tenant_id: c.num_tokens for c in contenders} == {"a": 50, "b": 30}


def test_a_first_token_step_is_for_tenants_with_no_prompt_in_progress_while_another_has():
    def contenders(*tenants):
        return [PrefillContender(t, 30, (0, 0, i)) for i, t in enumerate(tenants)]

    a_in_progress = [req("a1", 0, "a", 2000, num_computed=500)]
    assert first_token_tenants(contenders("b", "a", "c"), a_in_progress) == {"b", "c"}
    # one tenant, or nobody's prompt in progress: no first-token step.
    assert first_token_tenants(contenders("a"), a_in_progress) == frozenset()
    assert first_token_tenants(contenders("b", "c"), []) == frozenset()
    # b's prompt is in progress too: both are sharing the budget already.
    b_in_progress = [*a_in_progress, req("b1", 1, "b", 300, num_computed=30)]
    assert first_token_tenants(contenders("a", "b"), b_in_progress) == frozenset()


def test_the_running_cap_is_the_share_rounded_down_and_at_least_one():
    assert running_cap(64, 0.75) == 48
    assert running_cap(100, 0.29) == 29  # 0.29 * 100 is 28.999999999999996 in floats
    assert running_cap(2, 0.3) == 1
    assert running_cap(8, 1.0) == 8
    for bad in (0.0, -0.5, 1.01):
        with pytest.raises(ValueError, match="max_running_share"):
            running_cap(8, bad)
