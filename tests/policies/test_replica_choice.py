"""`choose_replicas`: which replica first, and the retry order, for each policy."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.replica_choice import (
    DEFAULT_EPSILON,
    ReplicaState,
    bound,
    choose_replicas,
)


def known(
    name: str, cached: int = 0, waiting: int = 0, running: int = 0, **kw: float
) -> ReplicaState:
    return ReplicaState(
        name,
        is_known=True,
        cached_blocks=cached,
        num_waiting=waiting,
        num_running=running,
        **kw,  # type: ignore[arg-type]
    )


def unknown(name: str, in_flight: int = 0) -> ReplicaState:
    return ReplicaState(name, is_known=False, num_in_flight=in_flight)


# (case, replicas, expected order, expected reason); policy prefix, turn 0, no affinity key.
PREFIX_CASES = [
    (
        "the longest cached prefix wins over a lighter load",
        [known("a", cached=2, running=3), known("b", cached=40, running=4), known("c", running=2)],
        ("b", "a", "c"),
        "prefix",
    ),
    (
        "a near tie (within 1/8 of the longest) goes to the lighter load",
        [known("a", cached=64, running=4), known("b", cached=57, running=2), known("c", running=4)],
        ("b", "a", "c"),
        "prefix_near_tie",
    ),
    (
        "just outside the near-tie band the longer prefix keeps it",
        [known("a", cached=64, running=4), known("b", cached=55, running=2), known("c", running=4)],
        ("a", "b", "c"),
        "prefix",
    ),
    (
        "one block is always a near tie",
        [known("a", cached=2, running=1), known("b", cached=1)],
        ("b", "a"),
        "prefix_near_tie",
    ),
    (
        "equal prefixes: least load, then kv use",
        [
            known("a", cached=8, running=2),
            known("b", cached=8, running=1, kv_usage=0.9),
            known("c", cached=8, running=1, kv_usage=0.2),
        ],
        ("c", "b", "a"),
        "prefix",
    ),
    (
        "waiting, running and unreported requests all count as load",
        [
            known("a", cached=8, waiting=1),
            known("b", cached=8, num_unreported=1),  # type: ignore[arg-type]
            known("c", cached=8, running=1),
            known("d", cached=8),
        ],
        ("d", "a", "b", "c"),
        "prefix",
    ),
    (
        "bounded load: the holder above (1+eps) x mean is passed over for the next best",
        # loads 6, 1, 0, 1: total 8, bound ceil(1.25 * 9 / 4) = 3; a would be at 7
        [
            known("a", cached=60, running=6),
            known("b", cached=30, running=1),
            known("c"),
            known("d", cached=1, running=1),
        ],
        ("b", "c", "d", "a"),  # then c and d: 1 block against none is a near tie
        "prefix_bounded_load",
    ),
    (
        "bounded load: exactly at the bound is still within",
        # loads 2, 2, 1, 1: total 6, bound ceil(1.25 * 7 / 4) = 3: a at 3 <= 3, kept
        [
            known("a", cached=20, running=2),
            known("b", running=2),
            known("c", running=1),
            known("d", running=1),
        ],
        ("a", "c", "d", "b"),
        "prefix",
    ),
    (
        "bounded load: one request past the bound is passed over",
        # loads 1, 0, 0, 0: total 1, bound ceil(1.25 * 2 / 4) = 1: a would be at 2
        [known("a", cached=20, running=1), known("b"), known("c", cached=3), known("d")],
        ("c", "b", "d", "a"),
        "prefix_bounded_load",
    ),
    (
        "nobody holds the prefix: least load",
        [known("a", running=3), known("b", running=1), known("c", running=2)],
        ("b", "c", "a"),
        "prefix_none_cached",
    ),
    (
        "an unknown replica holds nothing and weighs its in-flight requests",
        [known("a", cached=10, running=1), unknown("b", in_flight=0), known("c", running=1)],
        ("a", "b", "c"),
        "prefix",
    ),
    (
        "no replica's state known: least_loaded by in-flight requests",
        [unknown("a", in_flight=2), unknown("b", in_flight=0), unknown("c", in_flight=1)],
        ("b", "c", "a"),
        "least_loaded_no_state",
    ),
]


@pytest.mark.parametrize(
    ("replicas", "expected", "reason"),
    [case[1:] for case in PREFIX_CASES],
    ids=[case[0] for case in PREFIX_CASES],
)
def test_prefix_policy(
    replicas: list[ReplicaState], expected: tuple[str, ...], reason: str
) -> None:
    choice = choose_replicas(replicas, "prefix")
    assert choice.order == expected
    assert choice.reason == reason


LEAST_LOADED_CASES = [
    (
        "least load first, prefix ignored",
        [known("a", cached=50, running=3), known("b", running=1)],
        0,
        ("b", "a"),
    ),
    (
        "kv use breaks a tie of load",
        [known("a", kv_usage=0.5), known("b", kv_usage=0.1)],
        0,
        ("b", "a"),
    ),
    ("full ties rotate with the turn", [known("a"), known("b"), known("c")], 1, ("b", "c", "a")),
    ("unknown replicas by in-flight", [unknown("a", 3), known("b", running=2)], 0, ("b", "a")),
]


@pytest.mark.parametrize(
    ("replicas", "turn", "expected"),
    [case[1:] for case in LEAST_LOADED_CASES],
    ids=[case[0] for case in LEAST_LOADED_CASES],
)
def test_least_loaded_policy(
    replicas: list[ReplicaState], turn: int, expected: tuple[str, ...]
) -> None:
    choice = choose_replicas(replicas, "least_loaded", turn=turn)
    assert choice == choice.__class__(expected, "least_loaded")


@pytest.mark.parametrize(("turn", "expected"), [(0, "abc"), (1, "bca"), (2, "cab"), (5, "cab")])
def test_round_robin_rotates_by_turn_and_ignores_state(turn: int, expected: str) -> None:
    replicas = [known("a", running=9), known("b", cached=9), unknown("c")]
    assert choose_replicas(replicas, "round_robin", turn=turn).order == tuple(expected)


def test_prefix_ties_go_to_the_rendezvous_home_of_the_affinity_key() -> None:
    """Every gateway sends a prefix nobody holds to the same replica, whatever the order of
    its replica list or its turn; different prefixes spread over the replicas."""
    names = ["a", "b", "c", "d"]
    homes = []
    for n in range(64):
        key = n.to_bytes(16, "big")
        firsts = {
            choose_replicas([known(x) for x in perm], "prefix", turn=turn, affinity_key=key).order[
                0
            ]
            for perm in itertools.permutations(names)
            for turn in (0, 3)
        }
        assert len(firsts) == 1
        homes.append(firsts.pop())
    assert set(homes) == set(names)
    # without a key, ties rotate with the turn instead
    firsts = {
        choose_replicas([known(x) for x in names], "prefix", turn=t).order[0] for t in range(4)
    }
    assert firsts == set(names)


def test_epsilon_sets_the_bound() -> None:
    # loads 3, 0: total 3, mean with this request 2; holder at 4
    replicas = [known("a", cached=9, running=3), known("b")]
    assert choose_replicas(replicas, "prefix", epsilon=1.0).order[0] == "a"  # bound 4
    assert choose_replicas(replicas, "prefix", epsilon=DEFAULT_EPSILON).order[0] == "b"  # bound 3
    assert bound(3, 2, 1.0) == 4
    assert bound(3, 2, 0.25) == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replicas": []}, "at least one replica"),
        ({"replicas": [known("a"), known("a")]}, "distinct"),
        ({"policy": "random"}, "prefix, least_loaded, round_robin"),
        ({"epsilon": 0.0}, "epsilon must be > 0"),
    ],
)
def test_bad_input_is_refused(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"replicas": [known("a")], "policy": "prefix", **kwargs}
    with pytest.raises(ValueError, match=message):
        choose_replicas(args.pop("replicas"), args.pop("policy"), **args)  # type: ignore[arg-type]


def test_state_is_validated() -> None:
    with pytest.raises(ValueError, match="num_waiting"):
        known("a", waiting=-1)
    with pytest.raises(ValueError, match="kv_usage"):
        known("a", kv_usage=1.5)


def test_load_definition() -> None:
    state = ReplicaState("a", True, num_waiting=2, num_running=3, num_unreported=4, num_in_flight=9)
    assert state.load == 9
    assert ReplicaState("a", False, num_waiting=2, num_running=3, num_in_flight=7).load == 7


replica_lists = st.lists(
    st.builds(
        ReplicaState,
        name=st.just(""),
        is_known=st.booleans(),
        cached_blocks=st.integers(0, 80),
        num_waiting=st.integers(0, 20),
        num_running=st.integers(0, 20),
        # no subnormals: the suite's C kernels may have set flush-to-zero in this process
        kv_usage=st.floats(0, 1, allow_subnormal=False),
        num_unreported=st.integers(0, 5),
        num_in_flight=st.integers(0, 20),
    ),
    min_size=1,
    max_size=8,
).map(lambda rs: [ReplicaState(**{**r.__dict__, "name": f"r{i}"}) for i, r in enumerate(rs)])


@settings(max_examples=300, deadline=None)
@given(
    replica_lists, st.sampled_from(["prefix", "least_loaded", "round_robin"]), st.integers(0, 50)
)
def test_every_order_is_a_permutation_and_prefix_respects_the_bound(
    replicas: list[ReplicaState], policy: str, turn: int
) -> None:
    choice = choose_replicas(replicas, policy, turn=turn, epsilon=DEFAULT_EPSILON)  # type: ignore[arg-type]
    assert sorted(choice.order) == sorted(r.name for r in replicas)
    if policy == "prefix" and any(r.is_known for r in replicas):
        first = next(r for r in replicas if r.name == choice.order[0])
        limit = bound(sum(r.load for r in replicas), len(replicas), DEFAULT_EPSILON)
        assert first.load + 1 <= limit
