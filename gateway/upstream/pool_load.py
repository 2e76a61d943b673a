"""Each model's `PoolLoad` for the small/large routing policy, from the ``load`` lines of its
engines' ``/kv_events`` streams: the streams the replica router follows, one source of engine
load for both.

Queue depth is ``num_waiting`` summed over the model's available replicas; KV use is blocks
used over blocks total across them. A replica counts once its stream has sent a load line
(engines send one right after the snapshot, then at most every 50 ms while their numbers
change); with none, the load is unknown (None), which the policy treats as not saturated.

The router follows every model's replicas but a ``round_robin`` model's. So that the models
routing reads are followed whatever their replica policy, `PoolLoadView.start` follows them
at start-up (each alias's large model, or its rollout's versions), and `load` follows the
replicas it is asked about (a version added by a config reload, a replica that joined).
"""

from __future__ import annotations

from collections.abc import Iterable

from gateway.settings import GatewaySettings
from gateway.upstream.prefix_index import ReplicaCache
from gateway.upstream.replica_router import ReplicaRouter
from gateway.upstream.replica_set import ReplicaSet
from policies.model_routing import PoolLoad


class PoolLoadView:
    """Each model's load, read from the router's per-replica state (`ReplicaRouter.index`)."""

    def __init__(
        self, replica_set: ReplicaSet, router: ReplicaRouter, models: Iterable[str] = ()
    ) -> None:
        self._replica_set = replica_set
        self._router = router
        self._models = tuple(models)

    def start(self) -> None:
        """Follow the replicas of the models given (needs the event loop running)."""
        for model in self._models:
            self._router.follow(self._replica_set.members(model))

    async def load(self, model: str) -> PoolLoad | None:
        """``model``'s load now (nothing awaited: async for the admission's interface); None
        where none of its replicas' load is known."""
        replicas = self._replica_set.available(model)
        self._router.follow(replicas)
        return pool_load(self._router.index.replica(name) for name in replicas)


def pool_load(caches: Iterable[ReplicaCache]) -> PoolLoad | None:
    """The pool's load from its replicas' last load lines; None if no replica has one."""
    num_waiting, kv_blocks_used, kv_blocks_total, num_known = 0, 0, 0, 0
    for cache in caches:
        load = cache.load
        if load is None:
            continue
        num_known += 1
        num_waiting += load.num_waiting
        kv_blocks_used += load.kv_blocks_used
        kv_blocks_total += load.kv_blocks_total
    if num_known == 0:
        return None
    kv_usage = min(1.0, kv_blocks_used / kv_blocks_total) if kv_blocks_total > 0 else 0.0
    return PoolLoad(num_waiting=num_waiting, kv_usage=kv_usage)


def routed_large_models(settings: GatewaySettings) -> frozenset[str]:
    """The models whose load the routing policy reads: each alias's large model, or the
    versions of the rollout it names (as the start-up table has them)."""
    if settings.routing is None:
        return frozenset()
    models: set[str] = set()
    for pair in settings.routing.aliases.values():
        rollout = settings.rollouts.get(pair.large)
        models.update(rollout.weights if rollout is not None else (pair.large,))
    return frozenset(models)
