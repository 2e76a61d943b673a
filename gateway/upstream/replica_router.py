"""The pool's `ReplicaOrder`: which replica first for one request, from the engines' state.

For each request `ReplicaRouter.order` gathers the facts `policies.replica_choice` needs and
returns its order:

- the prompt's token ids, as the engine's server will see them: the admitter's, which it
  made once, with the model's exact token counter, as it counted the prompt
  (`Admission.prompt_token_ids`); the router never tokenizes. They are hashed into the
  engine's block chain with each replica's own block size and extra key
  (`prefix_index.block_chain`), and each replica's cached prefix of it is counted;
- each replica's load from its event stream (`kv_event_client`), plus the requests this
  gateway sent it since (`sent`), or, for a replica whose state is unknown, the requests this
  gateway has open to it (`sent` .. `finished`).

A request without those ids (a model with no checkpoint, counted with an OpenAI encoding
whose ids are not the engine's) is ordered by ``least_loaded`` instead of ``prefix``: never
by hashes that cannot match.

Every model's replicas but a ``round_robin`` model's are followed from start-up; a
``round_robin`` model's are followed once something asks for their load (`follow`, from
`gateway.upstream.pool_load`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import httpx

from engine_protocol.block_hash import BlockHash
from gateway.settings import ModelSettings
from gateway.upstream.kv_event_client import KvEventSubscriptions, SubscriberTiming
from gateway.upstream.prefix_index import PrefixIndex, ReplicaCache, cached_prefixes
from policies.replica_choice import DEFAULT_EPSILON, ReplicaPolicy, ReplicaState, choose_replicas

logger = logging.getLogger(__name__)


# A prompt longer than this is hashed into blocks on a worker thread (a block's hash takes
# about 3 us: 128k tokens held in cache are 8,192 hashes, 23 ms).
INLINE_HASH_TOKENS = 4096


class ReplicaRouter:
    def __init__(
        self,
        models: Mapping[str, ModelSettings],
        client: httpx.AsyncClient,
        *,
        epsilon: float = DEFAULT_EPSILON,
        timing: SubscriberTiming | None = None,
    ) -> None:
        self._policies: dict[str, ReplicaPolicy] = {
            m.name: m.replica_policy for m in models.values()
        }
        self._epsilon = epsilon
        self.index = PrefixIndex()
        self.subscriptions = KvEventSubscriptions(client, self.index, timing or SubscriberTiming())
        self._followed: set[str] = set()
        self._turns = {name: itertools.count() for name in models}
        self._in_flight: Counter[str] = Counter()

    def start(self, replicas: Mapping[str, Sequence[str]]) -> None:
        """Follow the replicas of every model not routed round-robin (at the app's start-up;
        replicas that join later are followed from their first request, and one that leaves
        is dropped by `forget`)."""
        for model, names in replicas.items():
            if self._policies.get(model, "round_robin") != "round_robin":
                self.follow(names)

    def follow(self, replicas: Sequence[str]) -> None:
        """Start following the event streams of replicas not followed yet (needs the event
        loop running: the app's start-up, or the first request)."""
        new = set(replicas) - self._followed
        if new:
            self._followed |= new
            self.subscriptions.sync(self._followed)

    def forget(self, replica: str) -> None:
        """``replica`` left every model: stop following its stream and drop its index."""
        if replica in self._followed:
            self._followed.discard(replica)
            self.subscriptions.sync(self._followed)

    async def aclose(self) -> None:
        await self.subscriptions.aclose()
        self._followed.clear()

    async def order(
        self,
        model: str,
        replicas: list[str],
        body: Mapping[str, Any],
        prompt_token_ids: Sequence[int] | None = None,
    ) -> list[str]:
        """The order to try ``replicas`` (the pool's, for ``model``) in for a request whose
        prompt the engine makes ``prompt_token_ids`` of (None where the admitter has no exact
        ids: ordered by load). ``body`` is the pool's hook's; the order does not read it."""
        policy = self._policies[model]
        if policy != "round_robin":
            self.follow(replicas)
        if not replicas or policy == "round_robin":
            return replicas  # the pool's own rotation
        turn = next(self._turns[model])
        replicas = sorted(replicas)  # ties rotate by this router's turn, not the pool's too
        caches = [self.index.replica(name) for name in replicas]
        token_ids = None
        if policy == "prefix" and any(c.is_known for c in caches):
            token_ids = prompt_token_ids
        if token_ids is None:
            policy = "least_loaded"
        if token_ids is not None and len(token_ids) > INLINE_HASH_TOKENS:
            num_cached, affinity_key, prompt_blocks = await anyio.to_thread.run_sync(
                _cached_prefixes, caches, token_ids
            )  # a long cached prompt is thousands of hashes: off the event loop
        else:
            num_cached, affinity_key, prompt_blocks = _cached_prefixes(caches, token_ids)
        states = [
            self._state(name, cache, cached)
            for name, cache, cached in zip(replicas, caches, num_cached, strict=True)
        ]
        choice = choose_replicas(
            states,
            policy,
            turn=turn,
            epsilon=self._epsilon,
            affinity_key=affinity_key,
            prompt_blocks=prompt_blocks,
        )
        logger.debug("replicas for %s: %s (%s)", model, choice.order, choice.reason)
        return list(choice.order)

    def sent(self, replica: str) -> None:
        """The pool sends a request to ``replica`` now."""
        self._in_flight[replica] += 1
        self.index.replica(replica).note_sent()

    def finished(self, replica: str) -> None:
        """A request sent to ``replica`` has ended (answered, failed or closed)."""
        self._in_flight[replica] -= 1
        if self._in_flight[replica] <= 0:
            del self._in_flight[replica]

    def _state(self, name: str, cache: ReplicaCache, cached_blocks: int) -> ReplicaState:
        if not cache.is_known:
            return ReplicaState(name, is_known=False, num_in_flight=self._in_flight[name])
        load = cache.load  # None only between the snapshot and the load line after it
        return ReplicaState(
            name,
            is_known=True,
            cached_blocks=cached_blocks,
            recent_requests=cache.recent.at(time.monotonic()),
            num_waiting=load.num_waiting if load else 0,
            num_running=load.num_running if load else 0,
            kv_usage=load.kv_usage if load else 0.0,
            num_unreported=cache.num_unreported,
            num_in_flight=self._in_flight[name],
        )


def _cached_prefixes(
    caches: list[ReplicaCache], token_ids: Sequence[int] | None
) -> tuple[list[int], BlockHash | None, int | None]:
    """Each replica's cached prefix of the prompt, in blocks, the hash naming the prompt for
    rendezvous ties (`cached_prefixes`), and the prompt's full blocks. Replicas of one model
    share a block size and an extra key unless they run different checkpoints or KV dtypes:
    one chain per pair (the first pair's key and block count are used)."""
    num_cached = [0] * len(caches)
    affinity_key: BlockHash | None = None
    prompt_blocks: int | None = None
    if token_ids is None:
        return num_cached, None, None
    keys = sorted({(c.block_size, c.extra_key) for c in caches if c.is_known})
    for key in keys:
        group = [
            i for i, c in enumerate(caches) if c.is_known and (c.block_size, c.extra_key) == key
        ]
        counts, first = cached_prefixes(token_ids, *key, [caches[i] for i in group])
        for i, count in zip(group, counts, strict=True):
            num_cached[i] = count
        if affinity_key is None:
            affinity_key, prompt_blocks = first, len(token_ids) // key[0]
    return num_cached, affinity_key, prompt_blocks
