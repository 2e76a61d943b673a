from __future__ import annotations

import weakref
from collections.abc import Sequence

import pytest

from backend_engine.worker.failure_isolation import isolate_failures


class Boom(Exception):
    pass


def attempt_failing_with(bad: set[int], log: list[list[int]]):  # type: ignore[no-untyped-def]
    def attempt(items: Sequence[int]) -> list[int]:
        log.append(list(items))
        if bad & set(items):
            raise Boom(f"bad in {list(items)}")
        return [10 * i for i in items]

    return attempt


def test_a_batch_that_succeeds_is_attempted_once() -> None:
    log: list[list[int]] = []
    assert isolate_failures([1, 2, 3], attempt_failing_with(set(), log)) == [10, 20, 30]
    assert log == [[1, 2, 3]]


def test_one_bad_item_is_pinned_by_bisection_and_the_others_keep_their_results() -> None:
    log: list[list[int]] = []
    outcomes = isolate_failures([0, 1, 2, 3, 4, 5], attempt_failing_with({4}, log))
    assert outcomes[:4] == [0, 10, 20, 30]
    assert outcomes[5] == 50
    assert isinstance(outcomes[4], Boom)
    assert str(outcomes[4]) == "bad in [4]"
    assert log == [[0, 1, 2, 3, 4, 5], [0, 1, 2], [3, 4, 5], [3], [4, 5], [4], [5]]


@pytest.mark.parametrize("bad", [{0, 5}, {0, 1, 2, 3, 4, 5}])
def test_every_item_that_fails_alone_fails_and_only_those(bad: set[int]) -> None:
    outcomes = isolate_failures(range(6), attempt_failing_with(bad, []))
    assert [isinstance(o, Boom) for o in outcomes] == [i in bad for i in range(6)]
    assert [o for i, o in enumerate(outcomes) if i not in bad] == [
        10 * i for i in range(6) if i not in bad
    ]


def test_an_attempt_that_answers_for_the_wrong_number_of_items_is_a_bug() -> None:
    with pytest.raises(RuntimeError, match="3 items gave 2 results"):
        isolate_failures([1, 2, 3], lambda items: [0, 0])


def test_a_failed_attempts_memory_is_freed_before_the_halves_are_tried() -> None:
    # Running out of memory is a failure to isolate: the halves must not run while the whole
    # batch's activations are still held by the failed attempt's traceback.
    class Activations:
        pass

    alive: list[weakref.ref[Activations]] = []
    seen_alive_during_retry = []

    def attempt(items: Sequence[int]) -> list[int]:
        seen_alive_during_retry.append(any(ref() is not None for ref in alive))
        activations = Activations()
        alive.append(weakref.ref(activations))
        if 3 in items:
            raise MemoryError("no room")
        return list(items)

    outcomes = isolate_failures([0, 1, 2, 3], attempt)
    assert isinstance(outcomes[3], MemoryError)
    assert outcomes[:3] == [0, 1, 2]
    assert not any(seen_alive_during_retry)
    assert all(ref() is None for ref in alive)  # the kept exception holds no frames either
