"""Passive ejection: consecutive failures eject a replica for a backoff that doubles up to a
cap, and one success resets it."""

from __future__ import annotations

from gateway.replica_settings import EjectionRule
from gateway.upstream.replica_health import ReplicaHealth

RULE = EjectionRule(failures_to_eject=3, backoff_s=1.0, backoff_max_s=5.0)


def test_k_consecutive_failures_eject_for_the_backoff() -> None:
    health = ReplicaHealth(RULE)
    assert [health.record_failure(10.0) for _ in range(3)] == [False, False, True]
    assert not health.is_available(10.0)
    assert not health.is_available(10.99)
    assert health.is_available(11.0)


def test_a_success_between_failures_starts_the_count_again() -> None:
    health = ReplicaHealth(RULE)
    health.record_failure(0.0)
    health.record_failure(0.0)
    health.record_success()
    assert [health.record_failure(0.0) for _ in range(3)] == [False, False, True]


def test_each_ejection_in_a_row_doubles_the_backoff_up_to_the_cap() -> None:
    health = ReplicaHealth(RULE)
    now, lengths = 0.0, []
    for _ in range(3):
        health.record_failure(now)
    for _ in range(5):
        lengths.append(health.ejected_until - now)
        now = health.ejected_until
        assert health.is_available(now)
        assert health.record_failure(now)  # on probation: one failure ejects again
    assert lengths == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_a_success_resets_the_backoff() -> None:
    health = ReplicaHealth(RULE)
    for _ in range(3):
        health.record_failure(0.0)
    assert health.record_failure(1.0)  # 2 s
    health.record_success()
    assert health.is_available(1.5)
    assert [health.record_failure(5.0) for _ in range(3)] == [False, False, True]
    assert health.ejected_until == 6.0


def test_failures_while_ejected_change_nothing() -> None:
    health = ReplicaHealth(RULE)
    for _ in range(3):
        health.record_failure(0.0)
    assert not health.record_failure(0.5)
    assert health.ejected_until == 1.0
    assert health.num_ejections == 1


def test_a_replica_that_is_not_ready_is_not_available() -> None:
    health = ReplicaHealth(RULE)
    health.is_ready = False
    assert not health.is_available(0.0)
