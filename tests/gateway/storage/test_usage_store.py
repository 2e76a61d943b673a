import threading
from datetime import timedelta

import pytest

from gateway.storage.models import MAX_FINISH_REASON_LENGTH, UsageStatus
from gateway.storage.usage_store import (
    MAX_PAGE_SIZE,
    UsageEntry,
    UsageTotals,
    insert_usage,
    list_usage,
    sum_tokens,
    summarize_usage,
)


def test_inserts_are_idempotent_by_request_id(database, make_entry):
    with database.transaction() as session:
        assert insert_usage(session, [make_entry(1), make_entry(2), make_entry(2)]) == 2
    with database.transaction() as session:  # a retried write, with one new record
        assert insert_usage(session, [make_entry(2, cost_micros=999), make_entry(3)]) == 1
        assert insert_usage(session, []) == 0
    with database.session() as session:
        records = list_usage(session).records
    assert [r.request_id for r in records] == ["req-1", "req-2", "req-3"]
    assert records[1] == make_entry(2)  # the first write wins; records are immutable


def test_a_record_round_trips_every_field(database, make_entry):
    rejected = make_entry(
        7,
        status=UsageStatus.REJECTED,
        reject_reason="budget_exhausted",
        served_model=None,
        routing_decision=None,
        key_id=None,
        prompt_tokens=0,
        cached_tokens=0,
        completion_tokens=0,
        cost_micros=0,
        streamed=False,
        finished_at=None,
        ttft_ms=None,
        finish_reason=None,
    )
    big = make_entry(8, cost_micros=5_000_000_000_000, status=UsageStatus.UPSTREAM_ERROR)
    tool_call = make_entry(9, finish_reason="tool_calls")
    longest = make_entry(10, finish_reason="r" * MAX_FINISH_REASON_LENGTH)  # the column holds it
    with database.transaction() as session:
        insert_usage(session, [rejected, big, tool_call, longest])
    with database.session() as session:
        assert list_usage(session).records == [rejected, big, tool_call, longest]


def test_pages_return_every_record_exactly_once(database, make_entry):
    with database.transaction() as session:
        insert_usage(
            session, [make_entry(n, tenant_id="even" if n % 2 == 0 else "odd") for n in range(25)]
        )
    seen: list[str] = []
    cursor = None
    num_pages = 0
    while True:
        with database.session() as session:
            page = list_usage(session, tenant_id="even", cursor=cursor, limit=4)
        seen += [r.request_id for r in page.records]
        num_pages += 1
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
        if num_pages == 2:  # records arriving mid-way are picked up, never duplicated
            with database.transaction() as session:
                insert_usage(session, [make_entry(100, tenant_id="even")])
    assert seen == [f"req-{n}" for n in range(0, 25, 2)] + ["req-100"]
    assert num_pages == 4


def test_pages_filter_by_time_window(database, make_entry, t0):
    with database.transaction() as session:
        insert_usage(session, [make_entry(n) for n in range(10)])
    start, end = t0 + timedelta(seconds=3), t0 + timedelta(seconds=7)
    with database.session() as session:
        page = list_usage(session, tenant_id="acme", start=start, end=end, limit=10)
        assert [r.request_id for r in page.records] == ["req-3", "req-4", "req-5", "req-6"]
        assert page.next_cursor is None
        assert list_usage(session, tenant_id="nobody").records == []


def test_limit_is_capped_and_checked(database, make_entry):
    with database.transaction() as session:
        insert_usage(session, [make_entry(n) for n in range(MAX_PAGE_SIZE + 1)])
    with database.session() as session:
        page = list_usage(session, limit=10 * MAX_PAGE_SIZE)
        assert len(page.records) == MAX_PAGE_SIZE
        assert page.next_cursor is not None
        assert len(list_usage(session, cursor=page.next_cursor).records) == 1
        with pytest.raises(ValueError, match="limit"):
            list_usage(session, limit=0)


def test_summary_totals_per_tenant_and_model(database, make_entry, t0):
    entries = [
        make_entry(1, served_model="big", prompt_tokens=10, cached_tokens=0, cost_micros=5),
        make_entry(2, served_model="big", prompt_tokens=20, cached_tokens=5, cost_micros=7),
        make_entry(3, served_model="small"),
        make_entry(4, tenant_id="zeta", served_model="small", completion_tokens=3),
        make_entry(5, served_model=None, status=UsageStatus.REJECTED, reject_reason="rate_limited"),
        make_entry(3600, served_model="big"),  # outside the window
    ]
    with database.transaction() as session:
        insert_usage(session, entries)
    with database.session() as session:
        summary = summarize_usage(session, start=t0, end=t0 + timedelta(minutes=1))
        only_zeta = summarize_usage(
            session, start=t0, end=t0 + timedelta(minutes=1), tenant_id="zeta"
        )
    by_key = {(s.tenant_id, s.served_model): s.totals for s in summary}
    assert set(by_key) == {("acme", "big"), ("acme", "small"), ("acme", None), ("zeta", "small")}
    assert by_key[("acme", "big")] == UsageTotals(
        num_requests=2, prompt_tokens=30, cached_tokens=5, completion_tokens=20, cost_micros=12
    )
    assert by_key[("zeta", "small")].completion_tokens == 3
    assert [(s.tenant_id, s.served_model) for s in only_zeta] == [("zeta", "small")]


def test_sum_tokens_over_a_half_open_window(database, make_entry, t0):
    with database.transaction() as session:
        insert_usage(session, [make_entry(n, cost_micros=n) for n in range(10)])
        insert_usage(session, [make_entry(99, tenant_id="other")])
    with database.session() as session:
        totals = sum_tokens(session, "acme", t0 + timedelta(seconds=2), t0 + timedelta(seconds=5))
        empty = sum_tokens(session, "nobody", t0, t0 + timedelta(days=1))
    assert totals == UsageTotals(
        num_requests=3, prompt_tokens=300, cached_tokens=120, completion_tokens=30, cost_micros=9
    )
    assert empty == UsageTotals(0, 0, 0, 0, 0)
    assert all(isinstance(value, int) for value in vars(totals).values())


def test_entries_validate_and_round_trip_through_json(make_entry, t0):
    entry = make_entry(1)
    assert UsageEntry.from_json_dict(entry.to_json_dict()) == entry
    with pytest.raises(ValueError, match="reject_reason"):
        make_entry(1, status=UsageStatus.REJECTED)
    with pytest.raises(ValueError, match="reject_reason"):
        make_entry(1, reject_reason="why")
    with pytest.raises(ValueError, match="cached_tokens"):
        make_entry(1, prompt_tokens=1, cached_tokens=2)
    with pytest.raises(ValueError, match="negative"):
        make_entry(1, cost_micros=-1)
    with pytest.raises(ValueError, match="timezone"):
        make_entry(1, created_at=t0.replace(tzinfo=None))
    for finish_reason in ("", "r" * (MAX_FINISH_REASON_LENGTH + 1)):
        with pytest.raises(ValueError, match="finish_reason"):
            make_entry(1, finish_reason=finish_reason)


def test_a_spilled_record_from_before_finish_reasons_reads_as_none(make_entry):
    """A spill file written by a gateway before migration 0003 replays without the key."""
    data = make_entry(1).to_json_dict()
    del data["finish_reason"]
    assert UsageEntry.from_json_dict(data) == make_entry(1, finish_reason=None)


def test_ids_are_stable_and_a_follower_resumes_from_the_last_page(database, make_entry):
    with database.transaction() as session:
        insert_usage(session, [make_entry(n) for n in range(3)])
    with database.session() as session:
        last = list_usage(session, limit=10)
        assert list_usage(session, limit=10).ids == last.ids  # stable across reads
        assert last.ids == sorted(set(last.ids))
        assert (last.next_cursor, last.has_more, last.resume_cursor) == (None, False, last.ids[-1])
        idle = list_usage(session, cursor=last.resume_cursor)
        assert (idle.records, idle.resume_cursor) == ([], last.resume_cursor)
    with database.transaction() as session:
        insert_usage(session, [make_entry(1), make_entry(3), make_entry(4)])  # req-1: a replay
    with database.session() as session:
        new = list_usage(session, cursor=idle.resume_cursor)
        assert list_usage(session, limit=1).resume_cursor == last.ids[0]  # not the last page
    assert [r.request_id for r in new.records] == ["req-3", "req-4"]
    assert min(new.ids) > last.ids[-1]


def test_a_record_committed_late_is_never_behind_a_followers_cursor(database, make_entry):
    """Writer 1 draws its id and holds its transaction open while writer 2 inserts. Had writer
    2 committed its larger id first, a follower reading then would move past writer 1's id
    and never see that record (a PostgreSQL sequence hands out ids before commit)."""
    drawn, release = threading.Event(), threading.Event()

    def slow_writer() -> None:
        with database.transaction() as session:
            insert_usage(session, [make_entry(1)])
            drawn.set()
            release.wait(10)

    def fast_writer() -> None:
        with database.transaction() as session:
            insert_usage(session, [make_entry(2)])

    slow, fast = threading.Thread(target=slow_writer), threading.Thread(target=fast_writer)
    slow.start()
    seen: list[str] = []
    try:
        assert drawn.wait(10)
        fast.start()
        fast.join(1.0)  # long enough for writer 2 to commit, were it allowed to
        cursor = None
        for _ in range(2):
            with database.session() as session:
                page = list_usage(session, cursor=cursor)
            seen += [r.request_id for r in page.records]
            cursor = page.resume_cursor
            release.set()
            slow.join(10)
            fast.join(10)
    finally:
        release.set()
        slow.join(10)
        if fast.ident is not None:  # started
            fast.join(10)
    assert sorted(seen) == ["req-1", "req-2"]
