"""`choose_replicas`: which replica first, and the retry order, for each policy."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.replica_choice import (
    DEFAULT_EPSILON,
    MIN_LOAD_BOUND,
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
        # loads 5, 5, 4, 4: total 18, bound ceil(1.25 * 19 / 4) = 6: a at 6 <= 6, kept
        [
            known("a", cached=20, running=5),
            known("b", running=5),
            known("c", running=4),
            known("d", running=4),
        ],
        ("a", "c", "d", "b"),
        "prefix",
    ),
    (
        "bounded load: one request past the bound is passed over",
        # loads 6, 4, 4, 3: total 17, bound ceil(1.25 * 18 / 4) = 6: a would be at 7
        [
            known("a", cached=20, running=6),
            known("b", running=4),
            known("c", cached=3, running=4),
            known("d", running=3),
        ],
        ("c", "d", "b", "a"),
        "prefix_bounded_load",
    ),
    (
        "bounded load: a replica that would run at most MIN_LOAD_BOUND is never passed over",
        # loads 3, 0, 0, 0: ceil(1.25 * 4 / 4) = 2, but the floor is 4: a at 4 is within
        [known("a", cached=20, running=3), known("b"), known("c", cached=3), known("d")],
        ("a", "c", "b", "d"),
        "prefix",
    ),
    (
        "bounded load: past the floor, the bound applies",
        # loads 4, 0, 0, 0: total 4, bound max(4, ceil(1.25 * 5 / 4) = 2) = 4: a would be at 5
        [known("a", cached=20, running=4), known("b"), known("c", cached=3), known("d")],
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


def test_a_prompt_nobody_holds_much_of_is_placed_as_a_new_prefix() -> None:
    """A block every prompt starts with (a chat template's header) does not pull new prefixes
    to the replicas that hold it: at most PREFIX_NEAR_TIE of the prompt cached is nothing."""
    key = b"the prompt's own first block"
    names = ["a", "b", "c", "d"]
    empty = [known(x) for x in names]
    header = [known(x, cached=1) for x in names[:3]] + [known("d")]
    assert choose_replicas(header, "prefix", affinity_key=key).order[-1] == "d"  # shunned
    placed = choose_replicas(header, "prefix", affinity_key=key, prompt_blocks=64)
    assert placed == choose_replicas(empty, "prefix", affinity_key=key, prompt_blocks=64)
    assert placed.reason == "prefix_none_cached"
    # 8 of 64 blocks (12.5%) is still a new prefix: least load wins; 9 is a prefix to follow
    eight = [known("a", cached=8, running=1), known("b")]
    assert choose_replicas(eight, "prefix", prompt_blocks=64).order == ("b", "a")
    nine = [known("a", cached=9, running=1), known("b")]
    assert choose_replicas(nine, "prefix", prompt_blocks=64).order == ("a", "b")
    with pytest.raises(ValueError, match="prompt_blocks"):
        choose_replicas(nine, "prefix", prompt_blocks=-1)


def test_new_prefixes_go_mostly_to_replicas_with_little_recent_traffic() -> None:
    """Weighted rendezvous: odds in proportion to 1 / (1 + recent_requests)."""
    replicas = [known("busy", recent_requests=9.0), known("b"), known("c"), known("d")]
    firsts = Counter(
        choose_replicas(
            replicas, "prefix", affinity_key=f"prefix {n}".encode(), prompt_blocks=64
        ).order[0]
        for n in range(2000)
    )
    # weights 0.1, 1, 1, 1: busy wins 0.1 / 3.1 = 3% of new prefixes, each other one 32%
    assert firsts["busy"] < 0.06 * 2000
    assert all(0.27 * 2000 < firsts[x] < 0.38 * 2000 for x in "bcd"), firsts
    # a known prefix is not moved by recent traffic (only load bounds it)
    held = [known("busy", cached=60, recent_requests=9.0), known("b")]
    assert choose_replicas(held, "prefix", affinity_key=b"k", prompt_blocks=64).order[0] == "busy"
    with pytest.raises(ValueError, match="recent_requests"):
        known("x", recent_requests=-1.0)


def test_epsilon_sets_the_bound() -> None:
    # loads 7, 0: total 7, mean with this request 4; holder at 8
    replicas = [known("a", cached=9, running=7), known("b")]
    assert choose_replicas(replicas, "prefix", epsilon=1.0).order[0] == "a"  # bound 8
    assert choose_replicas(replicas, "prefix", epsilon=DEFAULT_EPSILON).order[0] == "b"  # bound 5
    assert bound(7, 2, 1.0) == 8
    assert bound(7, 2, 0.25) == 5
    assert bound(0, 4, 0.25) == bound(3, 4, 0.25) == MIN_LOAD_BOUND  # the floor


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
