"""Which version of a rolled-out model serves a request: sticky, by hash, by weight.

A rollout maps a public model name to versions (model entries of their own) by integer
weight, e.g. ``large: {large-v1: 95, large-v2: 5}``. A request's sticky key is its tenant and,
when the request names one, its ``user`` (OpenAI's end-user id): the same key always lands on
the same version, on every gateway replica and after every restart, because the choice is a
pure function of (rollout name, key, weights) and the hash is SHA-256 (never Python's salted
``hash``).

The key hashes to a point ``u`` in [0, 1) (64 bits), scaled to ``[0, total)`` with integer
arithmetic, and the versions own cumulative ranges in a fixed order (sorted by name)::

    total = 100     large-v1: 95          large-v2: 5
    point           [0 ............ 95)   [95 .. 100)

Moving 5% -> 10% grows the last range down to 90: only the keys whose points lie in [90, 95)
move, all of them to large-v2, and none leaves it. With two versions this holds for any
change of weights (the keys that move, move one way, and only as many as the change needs);
with more, it holds for weight moved between neighbours in the order. Weights that keep
their ratios (95:5 and 19:1) choose alike.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

_POINT_BITS = 64


@dataclass(frozen=True)
class Rollout:
    """A public model name and its versions by weight (positive integers)."""

    name: str
    weights: Mapping[str, int]

    def __post_init__(self) -> None:
        if not self.weights:
            raise ValueError(
                f"rollout {self.name!r} needs at least one version, e.g. {{{self.name}-v1: 100}}"
            )
        for version, weight in self.weights.items():
            if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
                raise ValueError(
                    f"rollout {self.name!r}: the weight of {version!r} must be a positive "
                    f"integer, got {weight!r} (remove a version to send it nothing)"
                )
        ordered = dict(sorted(self.weights.items()))
        object.__setattr__(self, "weights", MappingProxyType(ordered))

    @property
    def total(self) -> int:
        return sum(self.weights.values())


def sticky_key(tenant_id: str, user: str | None) -> str:
    """The key a request's version is chosen by: its tenant, and its end user if given."""
    return f"{tenant_id}\x00{user}" if user else tenant_id


def hash_point(rollout_name: str, key: str, total: int) -> int:
    """The key's point in ``[0, total)``: ``floor(u * total)`` for ``u`` = the first 64 bits
    of SHA-256(rollout name, key) as a fraction of 2**64."""
    if total < 1:
        raise ValueError(f"total weight must be at least 1, got {total}")
    digest = hashlib.sha256(f"{rollout_name}\x00{key}".encode()).digest()
    fraction = int.from_bytes(digest[: _POINT_BITS // 8], "big")
    return (fraction * total) >> _POINT_BITS


def choose_version(rollout: Rollout, key: str) -> str:
    """The version whose cumulative range holds the key's point."""
    point = hash_point(rollout.name, key, rollout.total)
    upper = 0
    for version, weight in rollout.weights.items():
        upper += weight
        if point < upper:
            return version
    return list(rollout.weights)[-1]  # not reached: the point is below the total
