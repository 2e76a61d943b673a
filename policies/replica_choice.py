"""The order in which to try a model's engine replicas for one request.

`choose_replicas` is pure: the gateway gathers each replica's facts (`ReplicaState`: the
request's cached prefix there, its load, whether its state is known) and acts on the
answer, whose first replica gets the request and whose rest is the retry order.

Load
    A known replica's load is ``num_waiting + num_running + num_unreported``: the requests
    the engine last reported (its ``load`` event) plus those this gateway has sent it since
    that report. The last term keeps a burst from one gateway from all landing on the replica
    that looked idle between two load events (an engine reports at most every 50 ms). A
    replica whose state is unknown (no event stream: a foreign server, or an engine whose
    stream is down) has load ``num_in_flight``, the requests this gateway has open to it,
    the only load it can see. KV use (``kv_usage``, a fraction) is not part of the load:
    a full KV cache shows up as waiting requests, and kv_usage only breaks ties of load.

Policies
    ``round_robin``   the replicas in their given order, rotated by ``turn``.
    ``least_loaded``  least load first; ties by kv_usage, then rotated by ``turn``.
    ``prefix``        longest cached prefix first. Prefixes within ``PREFIX_NEAR_TIE``
                      of the longest one left count as tied (recomputing a few blocks costs
                      less than a queue), and tied replicas go least load first. Exact ties
                      of load fall to rendezvous hashing of ``affinity_key`` (the hash of the
                      prompt's first block no replica holds), so that every gateway sends a
                      prefix nobody holds yet to the same replica, and near-simultaneous
                      copies of it meet there. A prompt of which no replica holds more than
                      ``PREFIX_NEAR_TIE`` of its ``prompt_blocks`` is a new prefix: what is
                      cached (a chat template's header that every tenant's prompt starts
                      with) does not count, and it goes least load first, then by
                      rendezvous weighted by each replica's recent traffic
                      (``recent_requests``), so new prefixes spread over the replicas, most
                      to the quieter ones, instead of following a shared first block. With
                      no replica's state known the order is ``least_loaded``'s.

Bounded loads (``prefix`` only; Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with
Bounded Loads", 2018)
    With ``n`` replicas and total load ``L``, the request makes the mean ``(L + 1) / n``; a
    replica may take it only if its load after it stays within ``max(MIN_LOAD_BOUND,
    ceil((1 + epsilon) * (L + 1) / n))`` (the least loaded always does). Replicas that would
    exceed it are passed over: they keep their order, after every replica within the bound
    (they remain retries). So one hot prefix spreads to the next best replicas instead of
    queueing on the one holding it.

    ``MIN_LOAD_BOUND = 4``: the bound never turns a request away from a replica that would
    run at most 4. The paper's bound is for many requests per replica; with few in flight
    (``L + 1 <= n / (1 + epsilon)``) it is 1, and would send a second request of a prefix
    away from the replica holding it to an idle one, which prefills the whole prefix again:
    least_loaded, exactly where affinity costs nothing. Decoding is memory-bound: a step
    reads every weight once whatever the batch, and this engine's decode step costs the same
    4-4.5 ms at 1 to 4 sequences on a 2-core CPU (docs/benchmarks.md); on a GPU the flat part
    is far longer. With 4 replicas, 8 tenants and ~1,000-token system prompts
    (`bench.cluster`), the floor took the prefix-cache hit rate from 77-79% to 86-90% of
    prompt tokens (a pooled cache: 89%).

    ``DEFAULT_EPSILON = 0.25``. The paper's bound: no replica exceeds ``(1 + epsilon)`` times
    the mean, while the expected number of requests moved off their best replica grows as
    ``1/epsilon**2`` (a small epsilon balances better and caches worse). 0.25 is the value
    Vimeo ran this algorithm with in production (HAProxy's ``hash-balance-factor 125``);
    it keeps every replica within 1.25x the mean, which leaves room for load reports up to
    50 ms old under issue #16's target of no replica above 1.5x the mean, and lets a replica
    holding a prefix take 25% more than its share before the prefix is copied elsewhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

ReplicaPolicy = Literal["prefix", "least_loaded", "round_robin"]
REPLICA_POLICIES: tuple[ReplicaPolicy, ...] = ("prefix", "least_loaded", "round_robin")
DEFAULT_REPLICA_POLICY: ReplicaPolicy = "prefix"
DEFAULT_EPSILON = 0.25
# The bound never goes below this many requests on one replica (see the module docstring).
MIN_LOAD_BOUND = 4
# Cached prefixes within this fraction of the longest (and at least one block) are tied.
PREFIX_NEAR_TIE = 0.125


@dataclass(frozen=True)
class ReplicaState:
    """One replica's facts for one request (see the module docstring for ``load``)."""

    name: str
    is_known: bool
    cached_blocks: int = 0  # the request's leading full blocks the replica holds
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0  # KV blocks in use, 0.0 to 1.0
    num_unreported: int = 0  # sent by this gateway since the engine's last load report
    num_in_flight: int = 0  # open from this gateway now
    recent_requests: float = 0.0  # queued by the engine lately (a decayed count)

    def __post_init__(self) -> None:
        for name in (
            "cached_blocks",
            "num_waiting",
            "num_running",
            "num_unreported",
            "num_in_flight",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be non-negative, got {getattr(self, name)}")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"kv_usage is a fraction between 0 and 1, got {self.kv_usage}")
        if not self.recent_requests >= 0.0:
            raise ValueError(f"recent_requests must be >= 0, got {self.recent_requests}")

    @property
    def load(self) -> int:
        if self.is_known:
            return self.num_waiting + self.num_running + self.num_unreported
        return self.num_in_flight


@dataclass(frozen=True)
class ReplicaChoice:
    """``order``: every replica once, best first. ``reason``: which rule decided the first."""

    order: tuple[str, ...]
    reason: str


def choose_replicas(
    replicas: Sequence[ReplicaState],
    policy: ReplicaPolicy,
    *,
    turn: int = 0,
    epsilon: float = DEFAULT_EPSILON,
    affinity_key: bytes | None = None,
    prompt_blocks: int | None = None,
) -> ReplicaChoice:
    """The order to try ``replicas`` in. ``turn`` counts this model's requests (round-robin
    and tie rotation); ``affinity_key`` names the prompt's prefix for rendezvous ties;
    ``prompt_blocks``: the prompt's full blocks (None: unknown, every cached block counts)."""
    if not replicas:
        raise ValueError("choose_replicas needs at least one replica")
    if len({r.name for r in replicas}) != len(replicas):
        raise ValueError("replica names must be distinct")
    if policy not in REPLICA_POLICIES:
        raise ValueError(f"replica policy must be one of {', '.join(REPLICA_POLICIES)}")
    if not epsilon > 0:
        raise ValueError(f"epsilon must be > 0, got {epsilon}")
    if policy == "round_robin":
        start = turn % len(replicas)
        rotated = [*replicas[start:], *replicas[:start]]
        return ReplicaChoice(tuple(r.name for r in rotated), "round_robin")
    if policy == "least_loaded" or not any(r.is_known for r in replicas):
        reason = "least_loaded" if policy == "least_loaded" else "least_loaded_no_state"
        return ReplicaChoice(_least_loaded(replicas, turn), reason)
    if prompt_blocks is not None and prompt_blocks < 0:
        raise ValueError(f"prompt_blocks must be non-negative, got {prompt_blocks}")
    return _prefix(replicas, turn, epsilon, affinity_key, prompt_blocks)


def _least_loaded(replicas: Sequence[ReplicaState], turn: int) -> tuple[str, ...]:
    n = len(replicas)
    ranked = sorted(
        range(n), key=lambda i: (replicas[i].load, replicas[i].kv_usage, (i - turn) % n)
    )
    return tuple(replicas[i].name for i in ranked)


def _prefix(
    replicas: Sequence[ReplicaState],
    turn: int,
    epsilon: float,
    affinity_key: bytes | None,
    prompt_blocks: int | None,
) -> ReplicaChoice:
    best_cached = max(r.cached_blocks for r in replicas)
    is_new = prompt_blocks is not None and best_cached <= prompt_blocks * PREFIX_NEAR_TIE
    if is_new:
        replicas = [dataclasses.replace(r, cached_blocks=0) for r in replicas]
    capacity = bound(sum(r.load for r in replicas), len(replicas), epsilon)
    within = [r for r in replicas if r.load + 1 <= capacity]
    over = [r for r in replicas if r.load + 1 > capacity]
    tie_rank = _tie_ranks(replicas, turn, affinity_key, weighted=is_new)
    order = tuple(_by_prefix(within, tie_rank) + _by_prefix(over, tie_rank))
    first = next(r for r in replicas if r.name == order[0])
    best_cached = max(r.cached_blocks for r in replicas)
    if first.cached_blocks == best_cached:
        reason = "prefix" if best_cached > 0 else "prefix_none_cached"
    elif all(r.cached_blocks < best_cached for r in within):
        reason = "prefix_bounded_load"  # every replica holding the longest is over the bound
    else:
        reason = "prefix_near_tie"
    return ReplicaChoice(order, reason)


def bound(total_load: int, num_replicas: int, epsilon: float) -> int:
    """The most load one replica may carry once this request is placed."""
    return max(MIN_LOAD_BOUND, math.ceil((1 + epsilon) * (total_load + 1) / num_replicas))


def _by_prefix(replicas: list[ReplicaState], tie_rank: dict[str, tuple[float, ...]]) -> list[str]:
    """Greedy: the longest cached prefix left sets the near-tie band; the band's least-loaded
    replica goes next (then its longer prefix, kv_usage and tie rank)."""
    left = list(replicas)
    order: list[str] = []
    while left:
        longest = max(r.cached_blocks for r in left)
        floor = longest - max(1, math.floor(longest * PREFIX_NEAR_TIE)) if longest else 0
        band = [r for r in left if r.cached_blocks >= floor]
        best = min(band, key=lambda r: (r.load, -r.cached_blocks, r.kv_usage, tie_rank[r.name]))
        order.append(best.name)
        left.remove(best)
    return order


def _tie_ranks(
    replicas: Sequence[ReplicaState], turn: int, affinity_key: bytes | None, *, weighted: bool
) -> dict[str, tuple[float, ...]]:
    """Rendezvous (highest random weight) order for ``affinity_key``; without one, the
    given order rotated by ``turn``. ``weighted`` (a new prefix): each replica's weight is
    ``1 / (1 + recent_requests)`` (weighted rendezvous: a replica wins a key with odds in
    proportion to its weight), so new prefixes go mostly to replicas with little recent
    traffic, and every gateway, reading the same engines, still places one prefix alike."""
    n = len(replicas)
    if affinity_key is None:
        return {r.name: ((i - turn) % n,) for i, r in enumerate(replicas)}
    ranks: dict[str, tuple[float, ...]] = {}
    for i, r in enumerate(replicas):
        digest = hashlib.blake2b(affinity_key + b"\0" + r.name.encode(), digest_size=8).digest()
        if not weighted:
            ranks[r.name] = (-int.from_bytes(digest, "big"), i)
            continue
        # 52 bits and a half: strictly inside (0, 1) as a float (64 bits would round to 1.0)
        uniform = ((int.from_bytes(digest, "big") >> 12) + 0.5) / 2**52
        score = 1.0 / (1.0 + r.recent_requests) / -math.log(uniform)
        ranks[r.name] = (-score, i)
    return ranks
