from backend_engine.core.request import Request
from backend_engine.core.waiting_queue import WaitingQueue
from backend_engine.request_priority import Priority
from backend_engine.sampling_params import SamplingParams


def req(rid, arrival, tenant="t", priority=Priority.INTERACTIVE):
    return Request(rid, [1], SamplingParams(), 1, arrival, tenant_id=tenant, priority=priority)


def drain(queue, running=None):
    running = dict(running or {})
    order = []
    while queue:
        nxt = queue.peek(running)
        assert nxt is not None
        queue.remove(nxt)
        running[nxt.tenant_id] = running.get(nxt.tenant_id, 0) + 1
        order.append(nxt.request_id)
    return order


def test_priority_then_preempted_then_tenant_turns():
    q = WaitingQueue()
    q.add(req("b1", 0, "x", Priority.BATCH))
    q.add(req("x1", 1, "x"))
    q.add(req("x2", 2, "x"))
    q.add(req("y1", 3, "y"))
    q.add_preempted(req("p", 4, "x"))
    assert len(q) == 5
    assert drain(q) == ["p", "y1", "x1", "x2", "b1"]


def test_tenant_with_running_requests_waits_its_turn():
    q = WaitingQueue()
    q.add(req("x1", 0, "x"))
    q.add(req("y1", 1, "y"))
    assert drain(q, running={"x": 3}) == ["y1", "x1"]


def test_preempted_requests_keep_arrival_order():
    q = WaitingQueue()
    q.add_preempted(req("late", 9))
    q.add_preempted(req("early", 2))
    assert drain(q) == ["early", "late"]


def test_remove_unknown_is_false():
    q = WaitingQueue()
    assert q.remove(req("nobody", 0)) is False
    assert q.peek({}) is None


def test_a_tenant_at_its_cap_is_passed_over_while_another_waits():
    q = WaitingQueue()
    q.add(req("x1", 0, "x"))
    q.add(req("y1", 1, "y", Priority.BATCH))
    # x is interactive, but runs 2 of the 2 it may while y waits.
    assert q.peek({"x": 2}, max_running=2).request_id == "y1"
    assert q.is_capped("x", {"x": 2}, max_running=2)
    q.remove(q.peek({"x": 2}, max_running=2))
    # Nobody else waits: the cap lifts.
    assert not q.is_capped("x", {"x": 2}, max_running=2)
    assert q.peek({"x": 2}, max_running=2).request_id == "x1"


def test_the_cap_applies_to_preempted_requests_too():
    q = WaitingQueue()
    q.add_preempted(req("p", 0, "x"))
    q.add(req("y1", 1, "y"))
    assert q.peek({"x": 3}, max_running=3).request_id == "y1"
    assert q.peek({"x": 3}).request_id == "p"


def test_peek_among_some_tenants_and_one_tenants_requests_in_order():
    q = WaitingQueue()
    q.add(req("x1", 0, "x", Priority.BATCH))
    q.add(req("y1", 1, "y"))
    q.add(req("x2", 2, "x"))
    q.add_preempted(req("xp", 3, "x", Priority.BATCH))
    assert q.peek({}, tenants={"x"}).request_id == "x2"
    assert q.peek({}, tenants=set()) is None
    assert [r.request_id for r in q.of_tenant("x")] == ["x2", "xp", "x1"]
    assert sorted(q.tenants) == ["x", "y"]
    q.remove(q.peek({}, tenants={"y"}))
    assert q.tenants == ["x"]
