"""``GET /kv_events`` over real HTTP: a real engine (the tiny demo model, or its stand-in
without torch) served by uvicorn, its prefix cache filled and evicted by real requests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from backend_engine.async_engine import AsyncEngine
from backend_engine.config import EngineConfig
from backend_engine.core.kv_event_log import BlockEvicted, BlockStored
from backend_engine.core.step_runner import PlanRunner
from backend_engine.kv_event_fanout import DEFAULT_BUFFER_LINES
from backend_engine.server import kv_event_stream
from backend_engine.server.app import build_app, uvicorn_config
from backend_engine.server.engine_host import EngineHost
from engine_protocol.block_hash import BlockHash, hash_block
from engine_protocol.kv_events import (
    MEDIA_TYPE,
    PING,
    EvictedLine,
    LoadLine,
    SnapshotLine,
    StoredLine,
)
from tests.backend_engine.server.kv_event_client import KVEventListener
from tests.backend_engine.server.response_schema import check_answer
from tests.support.polling import eventually
from tests.support.stand_in_runner import DemoEngineModel, plan_stand_in_runner
from tests.support.uvicorn_thread import start_in_thread, stop_thread

MODEL_NAME = "tiny-demo"
BLOCK_SIZE = 16
NUM_KV_BLOCKS = 24  # small: a few distinct prompts evict


@dataclass(frozen=True)
class LiveEngine:
    base_url: str
    engine: AsyncEngine
    host: EngineHost

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, timeout=60.0)

    def cached_hashes(self) -> set[BlockHash]:
        """What a lookup finds now (read while the engine is idle)."""
        return set(self.engine.engine.kv_cache.pool.cached_hashes)

    def is_idle(self) -> bool:
        stats = self.engine.stats()
        return stats.num_running == stats.num_waiting == 0


@contextlib.contextmanager
def _serving(checkpoint: Path, plan_runner: PlanRunner) -> Iterator[LiveEngine]:
    config = EngineConfig(
        model=str(checkpoint),
        block_size=BLOCK_SIZE,
        num_kv_blocks=NUM_KV_BLOCKS,
        max_model_len=256,
        max_num_seqs=4,
        show_progress=False,
    )
    engine = AsyncEngine(config, model_name=MODEL_NAME, plan_runner=plan_runner)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = build_app(engine)
    server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = start_in_thread(server, [sock])
    try:
        yield LiveEngine(f"http://127.0.0.1:{port}", engine, app.state.context.host)
    finally:
        stop_thread(server, thread)
        sock.close()


@pytest.fixture(scope="module")
def live(demo_engine_model: Callable[..., DemoEngineModel]) -> Iterator[LiveEngine]:
    model = demo_engine_model(size="tiny")
    with _serving(model.checkpoint, model.plan_runner) as served:
        yield served


@pytest.fixture(scope="module")
def paced(demo_model_files: Callable[..., Path]) -> Iterator[LiveEngine]:
    """An engine whose every step takes 10 ms (the stand-in runner): a request of 120 tokens
    runs for over a second, many load intervals, however fast the machine."""
    with _serving(demo_model_files(size="tiny"), plan_stand_in_runner(step_s=0.01)) as served:
        yield served


def _prompt(seed: int, num_tokens: int, vocab_size: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(num_tokens)]


async def _complete(client: httpx.AsyncClient, prompt: list[int], max_tokens: int = 1) -> Any:
    response = await client.post(
        "/v1/completions",
        json={
            "model": MODEL_NAME,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert response.status_code == 200, response.text
    check_answer(response.json())
    return response.json()


def _chain(prompt: list[int], extra_key: bytes) -> tuple[BlockHash, ...]:
    """A client's hashes of the prompt's full blocks: the engine's own function."""
    hashes: list[BlockHash] = []
    for start in range(0, len(prompt) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, prompt[start : start + BLOCK_SIZE], extra_key))
    return tuple(hashes)


async def test_the_stream_opens_with_a_snapshot_then_the_load(live: LiveEngine) -> None:
    async with live.client() as client, KVEventListener(client) as listener:
        assert listener.response is not None
        assert listener.response.headers["content-type"] == MEDIA_TYPE
        snapshot = listener.snapshot
        assert isinstance(snapshot, SnapshotLine)
        assert snapshot.block_size == BLOCK_SIZE
        assert snapshot.extra_key == live.engine.engine.kv_cache.extra_key
        assert snapshot.engine_id == live.engine.kv_events.log.engine_id
        assert set(snapshot.blocks) == live.cached_hashes()
        load = await listener.next_line()
        assert load == LoadLine(0, 0, 0, NUM_KV_BLOCKS, num_requests_total=0)
        # the bytes as engines have always written them
        assert [json.loads(line) for line in listener.raw_lines] == [
            {
                "type": "snapshot",
                "engine_id": snapshot.engine_id,
                "seq": snapshot.seq,
                "block_size": BLOCK_SIZE,
                "extra_key": snapshot.extra_key.hex(),
                "blocks": sorted(h.hex() for h in snapshot.blocks),
            },
            {
                "type": "load",
                "num_waiting": 0,
                "num_running": 0,
                "kv_blocks_used": 0,
                "kv_blocks_total": NUM_KV_BLOCKS,
                "num_requests_total": 0,
            },
        ]


async def test_a_client_computes_the_hashes_the_engine_stored(live: LiveEngine) -> None:
    vocab_size = live.engine.tokenizer.vocab_size
    prompt = _prompt(1, 2 * BLOCK_SIZE, vocab_size)  # two full blocks, nothing else computed
    async with live.client() as client, KVEventListener(client) as listener:
        assert listener.snapshot is not None
        extra_key = listener.snapshot.extra_key
        await _complete(client, prompt)
        line = await listener.next_change()
        assert line == StoredLine(listener.seq + 1, _chain(prompt, extra_key))
        assert _chain(prompt, b"another model") != line.blocks


async def test_replayed_events_are_the_engines_cache_after_real_requests(
    live: LiveEngine,
) -> None:
    vocab_size = live.engine.tokenizer.vocab_size
    shared = _prompt(2, 3 * BLOCK_SIZE, vocab_size)
    async with live.client() as client, KVEventListener(client) as listener:
        seen: set[type] = set()
        for index in range(8):  # 8 prompts of 5 blocks each in a 24-block cache: evictions
            prompt = shared + _prompt(100 + index, BLOCK_SIZE + 5, vocab_size)
            results = await asyncio.gather(_complete(client, prompt, 4), _complete(client, shared))
            assert results[0]["usage"]["completion_tokens"] == 4
            await eventually(live.is_idle, what="the engine is idle")
            expected = live.cached_hashes()
            types: list[type] = []

            def caught_up(listener: KVEventListener, expected: set[BlockHash] = expected) -> bool:
                return listener.hashes == expected

            while not caught_up(listener):
                line = await listener.next_line()
                types.append(type(line))
                listener.apply(line)
            seen.update(types)
        assert {StoredLine, EvictedLine} <= seen
        assert live.engine.engine.kv_cache.pool.num_evictions > 0

        async with KVEventListener(client) as again:  # a reconnect: a fresh, equal snapshot
            assert again.snapshot is not None
            assert listener.snapshot is not None
            assert again.snapshot.engine_id == listener.snapshot.engine_id
            assert again.seq == listener.seq
            assert again.hashes == listener.hashes == live.cached_hashes()


async def test_several_subscribers_see_the_same_lines(live: LiveEngine) -> None:
    vocab_size = live.engine.tokenizer.vocab_size
    async with (
        live.client() as client,
        KVEventListener(client) as first,
        KVEventListener(client) as second,
    ):
        assert first.snapshot == second.snapshot
        for index in range(3):
            await _complete(client, _prompt(200 + index, 2 * BLOCK_SIZE + 3, vocab_size))
        await eventually(live.is_idle, what="the engine is idle")
        expected = live.cached_hashes()
        await first.follow_until(lambda listener: listener.hashes == expected)
        await second.follow_until(lambda listener: listener.seq == first.seq)
        assert second.hashes == first.hashes == expected
        assert live.engine.kv_events.num_subscriptions == 2
    await eventually(lambda: live.engine.kv_events.num_subscriptions == 0, what="unsubscribed")


async def test_a_subscriber_too_far_behind_is_disconnected(live: LiveEngine) -> None:
    # More lines in one go than a subscriber's buffer holds (each pair leaves the cache as
    # it was): the engine ends the stream, and a reconnect starts from a new snapshot.
    fake = bytes(16)
    burst = [BlockStored(0, fake), BlockEvicted(0, fake)] * (DEFAULT_BUFFER_LINES // 2 + 1)
    async with live.client() as client, KVEventListener(client) as listener:
        before = listener.seq
        loop = live.host.loop
        assert loop is not None
        loop.call_soon_threadsafe(live.engine.kv_events.publish, burst)
        lines = await listener.wait_for_end()
        assert all(
            isinstance(line, LoadLine) or line == PING for line in lines
        )  # none of the burst
        async with KVEventListener(client) as again:
            assert again.seq == before + len(burst)
            assert again.hashes == live.cached_hashes()


async def test_an_idle_stream_is_pinged(live: LiveEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_event_stream, "PING_AFTER_S", 0.2)
    async with live.client() as client, KVEventListener(client) as listener:
        await listener.next_line()  # the load after the snapshot
        assert await listener.next_line(timeout_s=10) == PING
        assert listener.raw_lines[-1] == '{"type":"ping"}'


async def test_the_load_follows_the_engine(paced: LiveEngine) -> None:
    vocab_size = paced.engine.tokenizer.vocab_size
    async with paced.client() as client, KVEventListener(client) as listener:
        first = await listener.next_line()
        assert isinstance(first, LoadLine)
        assert first.num_requests_total is not None
        task = asyncio.ensure_future(_complete(client, _prompt(300, 40, vocab_size), 120))
        running = None
        while running is None:
            line = await listener.next_line()
            if isinstance(line, LoadLine) and line.num_running == 1:
                running = line
        assert 0 < running.kv_blocks_used <= NUM_KV_BLOCKS
        assert running.num_requests_total == first.num_requests_total + 1
        await task
        line = await listener.next_line()
        while not (isinstance(line, LoadLine) and line.num_running == 0):
            line = await listener.next_line()
        assert line.kv_blocks_used == 0
