"""A model's pool load comes from its engines' kv_events load lines (stand-in engines over real
HTTP, tests/gateway/upstream/kv_events_stand_in.py), whatever the model's replica policy, and
the small/large routing falls back to the small model on it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from engine_protocol.kv_events import LoadLine
from gateway.settings import GatewaySettings, ModelSettings
from gateway.upstream.pool import UpstreamPool
from gateway.upstream.pool_load import PoolLoadView, pool_load, routed_large_models
from gateway.upstream.prefix_index import ReplicaCache
from gateway.upstream.replica_router import ReplicaRouter
from policies.model_routing import PoolLoad
from policies.replica_choice import ReplicaPolicy
from tests.gateway.upstream.kv_events_stand_in import StandInKvEvents
from tests.gateway.upstream.test_replica_router import serving
from tests.support.polling import eventually, wait_until
from tests.support.stand_in_engine import StandInEngine
from tests.support.stand_in_stack import TappedEngine, tenant_key

KEY = bytes(16)


def _cache(load: LoadLine | None) -> ReplicaCache:
    cache = ReplicaCache()
    if load is not None:
        cache.apply(load)
    return cache


def test_queue_depth_sums_and_kv_use_pools_the_replicas_that_reported() -> None:
    caches = [_cache(LoadLine(3, 1, 16, 64)), _cache(None), _cache(LoadLine(5, 9, 48, 64))]
    assert pool_load(caches) == PoolLoad(num_waiting=8, kv_usage=0.5)
    assert pool_load([_cache(LoadLine(0, 0, 0, 0))]) == PoolLoad(0, 0.0)  # an empty pool
    assert pool_load([_cache(LoadLine(0, 0, 9, 8))]) == PoolLoad(0, 1.0)
    assert pool_load([_cache(None), _cache(None)]) is None  # nothing known
    assert pool_load([]) is None


def test_the_models_routing_reads_are_each_aliass_large_or_its_versions() -> None:
    models = {
        name: {"upstreams": ["http://127.0.0.1:1"], "context_window": 64}
        for name in ("small", "large-v1", "large-v2", "big")
    }
    settings = GatewaySettings.from_dict(
        {
            "models": models,
            "rollouts": {"large": {"large-v1": 9, "large-v2": 1}},
            "routing": {
                "aliases": {
                    "auto": {"small": "small", "large": "large"},
                    "other": {"small": "small", "large": "big"},
                }
            },
        }
    )
    assert routed_large_models(settings) == {"large-v1", "large-v2", "big"}
    del models["big"]
    assert routed_large_models(GatewaySettings.from_dict({"models": models})) == frozenset()


@pytest.fixture
def engines() -> Iterator[list[StandInKvEvents]]:
    made = [StandInKvEvents(4, KEY).start() for _ in range(2)]
    yield made
    for engine in made:
        engine.stop()


@asynccontextmanager
async def viewing(
    engines: list[StandInKvEvents], policy: ReplicaPolicy, *, started: bool
) -> AsyncIterator[tuple[PoolLoadView, ReplicaRouter]]:
    upstreams = tuple(e.upstream for e in engines)
    models = {"m": ModelSettings("m", upstreams, 64, replica_policy=policy)}
    pool = UpstreamPool(models)
    router = ReplicaRouter(models, pool.client)
    view = PoolLoadView(pool.replica_set, router, ["m"] if started else [])
    router.start({"m": pool.replica_set.members("m")})
    view.start()
    try:
        yield view, router
    finally:
        await router.aclose()
        await pool.aclose()


@pytest.mark.parametrize("policy", ["prefix", "least_loaded", "round_robin"])
async def test_the_load_is_the_engines_last_load_lines(
    engines: list[StandInKvEvents], policy: ReplicaPolicy
) -> None:
    """Followed from start-up, whatever the policy: a round_robin model's replicas only
    because its load is read."""
    engines[0].set_load(num_waiting=3, kv_blocks_used=16)
    engines[1].set_load(num_waiting=5, kv_blocks_used=48)
    async with viewing(engines, policy, started=True) as (view, _):
        await eventually(lambda: all(e.num_streams == 1 for e in engines), what="both followed")
        await eventually(is_load(view, PoolLoad(8, 0.5)), what="both loads")
        engines[1].set_load(num_waiting=40, kv_blocks_used=64)
        await eventually(is_load(view, PoolLoad(43, 80 / 128)), what="a new load line")
        engines[1].status = 404  # a foreign server from now on: its load is unknown
        engines[1].drop_streams()
        await eventually(is_load(view, PoolLoad(3, 0.25)), what="the second one's forgotten")
        engines[0].status = 404
        engines[0].drop_streams()
        await eventually(is_load(view, None), what="nothing known")


async def test_a_round_robin_models_load_is_followed_once_asked_for(
    engines: list[StandInKvEvents],
) -> None:
    """A model routing did not name at start-up (a rollout's version added by a reload)."""
    engines[0].set_load(num_waiting=2)
    async with viewing(engines, "round_robin", started=False) as (view, router):
        assert not router.subscriptions.subscribers  # round_robin: not followed for choice
        assert await view.load("m") is None  # not known yet: asking follows the replicas
        assert len(router.subscriptions.subscribers) == 2
        await eventually(is_load(view, PoolLoad(2, 0.0)), what="the load, once asked")


def is_load(view: PoolLoadView, expected: PoolLoad | None) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await view.load("m") == expected

    return check


@pytest.mark.parametrize("large_policy", ["prefix", "round_robin"])
def test_a_saturated_large_pool_sends_the_request_to_the_small_model(
    sqlite_db_url: str, tmp_path: Path, large_policy: str
) -> None:
    """Through the whole gateway: the large pool's engine reports a long queue, then a full
    KV cache, on its kv_events stream; a request that prefers the large model goes to the
    small one while it does (the tenant allows it), and to the large one again after."""
    taps = {name: TappedEngine(StandInEngine(num_chunks=2), socket_path="") for name in "sl"}
    events = {name: StandInKvEvents(4, KEY, fallback=tap).start() for name, tap in taps.items()}
    try:
        settings = GatewaySettings.from_dict(
            {
                "data_dir": str(tmp_path),
                "database_url": sqlite_db_url,
                "models": {
                    "small": {"upstreams": [events["s"].upstream], "context_window": 4096},
                    "large": {
                        "upstreams": [events["l"].upstream],
                        "context_window": 4096,
                        "replica_policy": large_policy,
                    },
                },
                "routing": {"aliases": {"auto": {"small": "small", "large": "large"}}},
            }
        )
        _, key = tenant_key(sqlite_db_url, allow_fallback_to_small=True)
        with serving(settings) as (base, router):

            def route() -> str:
                response = httpx.post(
                    base + "/v1/completions",
                    json={
                        "model": "auto",
                        "prompt": "hi",
                        "max_tokens": 2,
                        "tollway_hint": "large",
                    },
                    headers={"authorization": f"Bearer {key}"},
                    timeout=30,
                )
                assert response.status_code == 200, response.text
                return response.headers["x-tollway-route"]

            def large_load(**load: int) -> Callable[[], bool]:
                events["l"].set_load(**load)

                def reported() -> bool:  # by the large engine: the small one's stay at 0
                    return any(
                        cache.load is not None
                        and all(getattr(cache.load, name) == n for name, n in load.items())
                        for cache in map(router.index.replica, router.index)
                    )

                return reported

            wait_until(lambda: events["l"].num_streams == 1, what="the large engine followed")
            assert route() == "large; reason=hint"
            wait_until(large_load(num_waiting=33), what="a long queue")
            assert route() == "small; reason=large_saturated_fallback"
            wait_until(large_load(num_waiting=0, kv_blocks_used=62), what="a full KV cache")
            assert route() == "small; reason=large_saturated_fallback"
            wait_until(large_load(kv_blocks_used=60), what="room again")  # 0.9375 <= 0.95
            assert route() == "large; reason=hint"
        assert [len(tap.requests) for tap in taps.values()] == [2, 2]
    finally:
        for server in events.values():
            server.stop()
