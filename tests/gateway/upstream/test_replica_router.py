"""Requests through the whole gateway land on the replica holding their prefix: two stand-in
engines publish kv_events (tests/gateway/upstream/kv_events_stand_in.py) and answer
completions; the gateway hashes each prompt as the engine would and routes by the index."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from gateway.admission.token_counter import (
    CheckpointTokenCounter,
    TokenizerCounter,
    from_checkpoint,
)
from gateway.app import build_gateway
from gateway.replica_settings import ReplicaWatch
from gateway.settings import GatewaySettings, ModelSettings
from gateway.upstream import replica_router
from gateway.upstream.pool import UpstreamPool
from gateway.upstream.prefix_index import block_chain
from gateway.upstream.replica_router import ReplicaRouter
from model_files.tokenizer import Tokenizer
from tests.gateway.upstream.kv_events_stand_in import StandInKvEvents
from tests.support.polling import eventually, wait_until
from tests.support.stand_in_engine import MODEL, StandInEngine
from tests.support.stand_in_stack import TappedEngine, tenant_key
from tests.support.uvicorn_thread import start_in_thread, stop_thread

BLOCK_SIZE = 4
KEY = b"\x07" * 16
PROMPTS = {
    "a": "The first tenant's long system prompt, which only replica a has seen so far. " * 3,
    "b": "Another tenant entirely: its instructions sit in replica b's prefix cache. " * 3,
}


@pytest.fixture
def engines() -> Iterator[dict[str, tuple[StandInKvEvents, TappedEngine]]]:
    made = {}
    for name in ("a", "b"):
        tap = TappedEngine(StandInEngine(num_chunks=2), socket_path="")
        made[name] = (StandInKvEvents(BLOCK_SIZE, KEY, fallback=tap).start(), tap)
    yield made
    for events, _ in made.values():
        events.stop()


@contextmanager
def serving(settings: GatewaySettings) -> Iterator[tuple[str, ReplicaRouter]]:
    app = build_gateway(settings)
    router = app.state.gateway.upstreams.replica_order
    assert isinstance(router, ReplicaRouter)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, loop="asyncio", http="h11", lifespan="on", log_level="warning")
    server = uvicorn.Server(config)
    thread = start_in_thread(server, [sock])
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", router
    finally:
        stop_thread(server, thread)


def settings_for(
    engines: dict[str, tuple[StandInKvEvents, TappedEngine]],
    db_url: str,
    tmp_path: Path,
    **model: Any,
) -> GatewaySettings:
    spec = {
        "upstreams": [events.upstream for events, _ in engines.values()],
        "context_window": 4096,
        **model,
    }
    return GatewaySettings.from_dict(
        {"data_dir": str(tmp_path), "database_url": db_url, "models": {MODEL: spec}}
    )


def served_by(
    engines: dict[str, tuple[StandInKvEvents, TappedEngine]],
    base: str,
    key: str,
    body: dict[str, Any],
) -> str:
    counts = {name: len(tap.requests) for name, (_, tap) in engines.items()}
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = httpx.post(
        base + path,
        json={"model": MODEL, "max_tokens": 2, **body},
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    (name,) = [n for n, (_, tap) in engines.items() if len(tap.requests) > counts[n]]
    return name


def count_encodings(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every tokenization of a text from now on, by whichever exact counter makes it."""
    calls: list[str] = []
    methods = [
        (CheckpointTokenCounter, "encode_text"),  # under its encode_* and tokenize_*
        (TokenizerCounter, "encode_prompt"),  # under its tokenize_prompt
        (TokenizerCounter, "encode_chat"),
    ]
    for owner, name in methods:
        monkeypatch.setattr(owner, name, _counted(getattr(owner, name), calls))
    return calls


def _counted(method: Callable[..., Any], calls: list[str]) -> Callable[..., Any]:
    def counted(*args: Any) -> Any:
        calls.append(method.__name__)
        return method(*args)

    return counted


def wait_for_state(router: ReplicaRouter, num_replicas: int) -> None:
    wait_until(
        lambda: sum(router.index.replica(b).is_known for b in router.index) == num_replicas,
        what="every replica's snapshot",
    )


@pytest.mark.parametrize("inline_hash_tokens", [replica_router.INLINE_HASH_TOKENS, 0])
def test_requests_go_to_the_replica_holding_their_prefix(
    engines: dict[str, tuple[StandInKvEvents, TappedEngine]],
    demo_model_files: Callable[..., Path],
    sqlite_db_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    inline_hash_tokens: int,
) -> None:
    """Each prompt is tokenized once, by the admitter: the router hashes the ids it counted
    and never encodes the body itself. It hashes on the event loop, or (0: every prompt is
    long) on a worker thread, alike."""
    monkeypatch.setattr(replica_router, "INLINE_HASH_TOKENS", inline_hash_tokens)
    encodings = count_encodings(monkeypatch)
    checkpoint = demo_model_files()
    tokenizer = Tokenizer.from_pretrained(checkpoint)
    messages = [{"role": "system", "content": PROMPTS["b"]}, {"role": "user", "content": "hi"}]
    for name, prompt in PROMPTS.items():
        engines[name][0].store(block_chain(tokenizer.encode(prompt), BLOCK_SIZE, KEY))
    engines["b"][0].store(block_chain(tokenizer.encode_chat(messages), BLOCK_SIZE, KEY))
    settings = settings_for(engines, sqlite_db_url, tmp_path, checkpoint=str(checkpoint))
    _, key = tenant_key(sqlite_db_url)
    with serving(settings) as (base, router):
        wait_for_state(router, 2)
        encodings.clear()  # the counter's own check at start-up
        order = [served_by(engines, base, key, {"prompt": PROMPTS[n]}) for n in "abba"]
        assert order == ["a", "b", "b", "a"]
        assert served_by(engines, base, key, {"messages": messages, "stream": True}) == "b"
        # a replica that is much busier than the mean loses its prefix's requests (bounded load)
        # loads a 2, b 6 (+ 0 unreported): the bound is max(4, ceil(1.25 * 9 / 2)) = 6, b
        # would be at 7
        engines["b"][0].set_load(num_running=6)
        b = router.index.replica(sorted(router.index)[1])  # uds-1: the second upstream
        wait_until(lambda: b.load is not None and b.load.num_running == 6, what="b's load")
        assert router.index.replica(sorted(router.index)[0]).num_unreported == 2
        assert served_by(engines, base, key, {"prompt": PROMPTS["b"]}) == "a"
        assert served_by(engines, base, key, {"prompt": tokenizer.encode(PROMPTS["a"])}) == "a"
        assert router._in_flight == {}  # every request ended, streamed or not
    assert len(encodings) == 6  # the 7 requests but the one of token ids: once each


def test_round_robin_ignores_the_prefix(
    engines: dict[str, tuple[StandInKvEvents, TappedEngine]],
    demo_model_files: Callable[..., Path],
    sqlite_db_url: str,
    tmp_path: Path,
) -> None:
    checkpoint = demo_model_files()
    tokenizer = Tokenizer.from_pretrained(checkpoint)
    engines["a"][0].store(block_chain(tokenizer.encode(PROMPTS["a"]), BLOCK_SIZE, KEY))
    settings = settings_for(
        engines, sqlite_db_url, tmp_path, checkpoint=str(checkpoint), replica_policy="round_robin"
    )
    _, key = tenant_key(sqlite_db_url)
    with serving(settings) as (base, _):
        served = {served_by(engines, base, key, {"prompt": PROMPTS["a"]}) for _ in range(4)}
    assert served == {"a", "b"}
    assert all(events.num_connections == 0 for events, _ in engines.values())  # not followed


def test_without_exact_token_ids_the_model_is_routed_by_load(
    engines: dict[str, tuple[StandInKvEvents, TappedEngine]],
    demo_model_files: Callable[..., Path],
    sqlite_db_url: str,
    tmp_path: Path,
) -> None:
    """No checkpoint: the gateway counts with an OpenAI encoding, whose ids are not the
    engine's, so it never routes on hashes of them: least_loaded (b is busier)."""
    checkpoint = demo_model_files()
    tokenizer = Tokenizer.from_pretrained(checkpoint)
    engines["b"][0].store(block_chain(tokenizer.encode(PROMPTS["b"]), BLOCK_SIZE, KEY))
    engines["b"][0].set_load(num_waiting=1)  # prefix would still pick b: bound 2, b at 2
    settings = settings_for(engines, sqlite_db_url, tmp_path)
    _, key = tenant_key(sqlite_db_url)
    with serving(settings) as (base, router):
        wait_for_state(router, 2)
        assert served_by(engines, base, key, {"prompt": PROMPTS["b"]}) == "a"


async def test_every_gateway_decides_alike(
    engines: dict[str, tuple[StandInKvEvents, TappedEngine]],
    demo_model_files: Callable[..., Path],
) -> None:
    """Two gateways' routers, following the same engines, put the same replica first for
    each prompt (held by one, held by neither), whatever their turns and list orders."""
    checkpoint = demo_model_files()
    tokenizer = Tokenizer.from_pretrained(checkpoint)
    engines["b"][0].store(block_chain(tokenizer.encode(PROMPTS["b"]), BLOCK_SIZE, KEY))
    upstreams = tuple(events.upstream for events, _ in engines.values())
    models = {MODEL: ModelSettings(MODEL, upstreams, 4096, checkpoint)}
    counter = from_checkpoint(checkpoint)
    pools = [UpstreamPool(models), UpstreamPool(models)]
    routers = [ReplicaRouter(models, pool.client) for pool in pools]
    try:
        bases = pools[0].replicas(MODEL)
        for router in routers:
            router.follow(bases)
        await eventually(
            lambda: all(r.index.replica(b).is_known for r in routers for b in bases),
            what="both routers' snapshots",
        )
        await routers[1].order(MODEL, bases, {}, [1])  # the second one's turn moves on
        cold = "A prompt that no replica has seen, sent by two different gateways at once."
        for prompt in (PROMPTS["b"], cold, PROMPTS["a"]):
            ids = counter.encode_prompt(prompt)
            firsts = {
                (await router.order(MODEL, names, {"prompt": prompt}, ids))[0]
                for router, names in zip(routers, (bases, bases[::-1]), strict=True)
            }
            assert len(firsts) == 1, prompt
        ids = counter.encode_prompt(PROMPTS["b"])
        assert (await routers[0].order(MODEL, bases, {}, ids))[0] == bases[1]
    finally:
        for router, pool in zip(routers, pools, strict=True):
            await router.aclose()
            await pool.aclose()


async def test_a_replica_that_leaves_is_no_longer_followed() -> None:
    """Discovery and replica choice meet: a replica the name no longer resolves to has its
    kv_events stream closed and its index dropped (the pool tells the router on leave)."""
    addresses = ["127.0.0.1", "127.0.0.2"]

    async def resolver(host: str, port: int) -> list[str]:
        return list(addresses)

    url = "dns://engines:8100"
    models = {MODEL: ModelSettings(name=MODEL, upstreams=(url,), context_window=4096)}
    watch = ReplicaWatch(dns_refresh_s=3600, health_check_interval_s=0)
    pool = UpstreamPool(models, watch=watch, resolver=resolver)
    router = ReplicaRouter(models, pool.client)
    pool.replica_order = router
    try:
        await pool.start()
        router.start({MODEL: pool.replica_set.members(MODEL)})
        first, second = "http://127.0.0.1:8100", "http://127.0.0.2:8100"
        assert set(router.subscriptions.subscribers) == {first, second}
        addresses.remove("127.0.0.2")
        await pool.replica_set.refresh(url)
        assert set(router.subscriptions.subscribers) == {first}
        assert set(router.index) == {first}
    finally:
        await router.aclose()
        await pool.aclose()
