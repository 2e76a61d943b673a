import hashlib
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.version_choice import Rollout, choose_version, hash_point, sticky_key

REPO_ROOT = Path(__file__).resolve().parents[2]
KEYS = [f"tenant-{i}" for i in range(4000)]


def shares(rollout: Rollout, keys: list[str] = KEYS) -> dict[str, float]:
    counts = Counter(choose_version(rollout, key) for key in keys)
    return {version: counts[version] / len(keys) for version in rollout.weights}


def test_traffic_splits_by_weight():
    got = shares(Rollout("large", {"large-v1": 95, "large-v2": 5}))
    assert got["large-v2"] == pytest.approx(0.05, abs=0.015)
    got = shares(Rollout("large", {"a": 1, "b": 2, "c": 1}))
    assert got == pytest.approx({"a": 0.25, "b": 0.5, "c": 0.25}, abs=0.03)


def test_one_version_takes_everything():
    assert shares(Rollout("large", {"large-v1": 7})) == {"large-v1": 1.0}


def test_the_point_is_the_documented_hash():
    """The choice depends on nothing but SHA-256 of (rollout, key): every replica, and every
    restart (Python's own hash() is salted per process), computes the same point."""
    digest = hashlib.sha256(b"large\x00acme").digest()
    expected = (int.from_bytes(digest[:8], "big") * 100) >> 64
    assert hash_point("large", "acme", 100) == expected
    script = (
        "from policies.version_choice import hash_point; print(hash_point('large', 'acme', 100))"
    )
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            check=True,
            cwd=REPO_ROOT,
            env={"PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO_ROOT)},
        )
        assert int(out.stdout) == expected


def test_version_order_is_by_name_not_as_written():
    written = Rollout("large", {"large-v2": 5, "large-v1": 95})
    assert list(written.weights) == ["large-v1", "large-v2"]
    in_order = Rollout("large", {"large-v1": 95, "large-v2": 5})
    assert all(choose_version(written, key) == choose_version(in_order, key) for key in KEYS[:500])


def test_each_rollout_hashes_on_its_own():
    """The same tenant is not on the new version of every rollout at once."""
    a = Rollout("large", {"large-v1": 50, "large-v2": 50})
    b = Rollout("small", {"small-v1": 50, "small-v2": 50})
    same = sum(
        (choose_version(a, k) == "large-v2") == (choose_version(b, k) == "small-v2") for k in KEYS
    )
    assert 0.4 < same / len(KEYS) < 0.6


def test_five_to_ten_percent_moves_only_the_keys_that_must_move():
    before = Rollout("large", {"large-v1": 95, "large-v2": 5})
    after = Rollout("large", {"large-v1": 90, "large-v2": 10})
    moved = [k for k in KEYS if choose_version(before, k) != choose_version(after, k)]
    assert all(choose_version(before, k) == "large-v1" for k in moved)  # none leaves v2
    assert len(moved) / len(KEYS) == pytest.approx(0.05, abs=0.015)  # about 10% - 5%


@settings(max_examples=200, deadline=None)
@given(
    old=st.integers(min_value=1, max_value=1000),
    new=st.integers(min_value=1, max_value=1000),
    total=st.integers(min_value=2, max_value=2000),
    key=st.text(min_size=1, max_size=30),
)
def test_growing_a_version_never_takes_a_key_away_from_it(old, new, total, key):
    """Two versions, any weights: a key on the version whose share grows stays on it (so
    every key that moves, moves to it: the monotone property)."""
    smaller, larger = sorted((old % total or 1, new % total or 1))
    before = Rollout("m", {"v1": total, "v2": smaller})
    after = Rollout("m", {"v1": total, "v2": larger})
    if choose_version(before, key) == "v2":
        assert choose_version(after, key) == "v2"
    # v1 shrinks while v2 stays: v2's share grows too
    before = Rollout("m", {"v1": total - smaller + 1, "v2": total})
    after = Rollout("m", {"v1": total - larger + 1, "v2": total})
    if choose_version(before, key) == "v2":
        assert choose_version(after, key) == "v2"


@settings(max_examples=100, deadline=None)
@given(
    w1=st.integers(min_value=1, max_value=50),
    w2=st.integers(min_value=1, max_value=50),
    factor=st.integers(min_value=2, max_value=20),
    key=st.text(min_size=1, max_size=30),
)
def test_weights_with_the_same_ratios_choose_alike(w1, w2, factor, key):
    a = Rollout("m", {"v1": w1, "v2": w2})
    b = Rollout("m", {"v1": w1 * factor, "v2": w2 * factor})
    assert choose_version(a, key) == choose_version(b, key)


def test_the_user_field_is_sticky_within_a_tenant():
    assert sticky_key("acme", None) == "acme"
    assert sticky_key("acme", "") == "acme"
    assert sticky_key("acme", "alice") != sticky_key("acme", "bob")
    assert sticky_key("acme", "alice") != sticky_key("globex", "alice")
    rollout = Rollout("large", {"large-v1": 50, "large-v2": 50})
    users = {choose_version(rollout, sticky_key("acme", f"user-{i}")) for i in range(50)}
    assert users == {"large-v1", "large-v2"}  # one tenant's users spread over both


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({}, "needs at least one version"),
        ({"v1": 0}, "must be a positive integer, got 0"),
        ({"v1": -5}, "must be a positive integer"),
        ({"v1": 2.5}, "must be a positive integer, got 2.5"),
        ({"v1": True}, "must be a positive integer, got True"),
        ({"v1": "95"}, "must be a positive integer, got '95'"),
    ],
)
def test_bad_weights_are_refused_with_the_reason(weights, message):
    with pytest.raises(ValueError, match=message):
        Rollout("large", weights)


def test_a_point_needs_a_positive_total():
    with pytest.raises(ValueError, match="at least 1"):
        hash_point("large", "acme", 0)
