"""An engine SIGKILLed under ``tollway serve``: what clients see, what is billed, what recovers.

One real ``tollway serve`` (gateway + one engine child on a Unix socket) for the module.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from gateway.storage.models import UsageStatus
from tests.faults.processes import (
    Tollway,
    chat_body,
    is_gone,
    read_stream,
    shared_tollway,
    wait_for,
)

pytestmark = pytest.mark.timeout(180)

NUM_TOKENS_BEFORE_KILL = 5
LONG = 1000  # tokens asked for (the default tenant allows 1024): far more than come before the kill


@pytest.fixture
def tollway(request: pytest.FixtureRequest, demo_checkpoint: Callable[..., Path]) -> Tollway:
    return shared_tollway(request.config, demo_checkpoint(size="tiny"))


def _wait_for_a_new_engine(tollway: Tollway, old_pid: int) -> int:
    wait_for(lambda: is_gone(old_pid), 10, "the killed engine to exit")

    def is_replaced() -> bool:
        try:
            return tollway.engine_pid() != old_pid and tollway.is_engine_healthy()
        except AssertionError:  # between the old child's exit and the new one's start
            return False

    wait_for(is_replaced, 90, f"the watchdog to restart the engine\n{tollway.output()[-3000:]}")
    return tollway.engine_pid()


def _budget(tollway: Tollway) -> dict[str, int]:
    with tollway.client() as client:
        response = client.get("/v1/budget")
    assert response.status_code == 200, response.text
    return dict(response.json())


def _settled_tokens(tollway: Tollway) -> int:
    return sum(r.prompt_tokens + r.completion_tokens for r in tollway.records().values())


def test_an_engine_killed_mid_stream_ends_the_stream_bills_what_was_sent_and_restarts(
    tollway: Tollway,
) -> None:
    engine_pid = tollway.engine_pid()
    killed = threading.Event()

    def kill_after_a_few_tokens(seen: object) -> None:
        if not killed.is_set() and getattr(seen, "num_tokens", 0) >= NUM_TOKENS_BEFORE_KILL:
            os.kill(engine_pid, signal.SIGKILL)
            killed.set()

    def non_streamed() -> httpx.Response:
        with tollway.client() as client:
            return client.post("/v1/chat/completions", json=chat_body(LONG, stream=False))

    with ThreadPoolExecutor(1) as pool, tollway.client() as client:
        waiting = pool.submit(non_streamed)  # in flight too when the engine dies
        body = chat_body(LONG, stream=True)
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            seen = read_stream(response, kill_after_a_few_tokens)
        whole = waiting.result(timeout=60)

    assert killed.is_set(), "the stream ended before the engine could be killed"
    # The stream: what came before the crash, one OpenAI-format error event, then [DONE].
    assert seen.status_code == 200
    assert NUM_TOKENS_BEFORE_KILL <= seen.num_tokens < LONG
    assert len(seen.errors) == 1, seen.errors
    assert seen.errors[0]["type"] == "server_error"
    assert seen.errors[0]["code"] == "upstream_error"
    assert seen.is_done and seen.events_after_done == 0
    assert seen.usage is None  # the engine's usage never came
    # The non-streamed request: a clean error in OpenAI's format, never a 500.
    assert whole.status_code == 503, whole.text
    assert whole.json()["error"]["type"] == "server_error"
    assert whole.json()["error"]["code"] == "upstream_unavailable"

    # Billed: exactly the tokens the client received, and nothing for the unanswered one.
    tollway.wait_for_records({seen.request_id, whole.headers["x-request-id"]})
    records = tollway.records()
    streamed = records[seen.request_id]
    assert streamed.status is UsageStatus.UPSTREAM_ERROR
    assert streamed.completion_tokens == seen.num_tokens
    assert streamed.prompt_tokens > 0
    unanswered = records[whole.headers["x-request-id"]]
    assert unanswered.status is UsageStatus.UPSTREAM_ERROR
    assert unanswered.prompt_tokens == unanswered.completion_tokens == 0
    # The ledger settled to the records: nothing left reserved, nothing more used.
    budget = _budget(tollway)
    assert budget["reserved"] == 0
    assert budget["used"] == _settled_tokens(tollway)

    # Restarted by the watchdog, and serving again.
    _wait_for_a_new_engine(tollway, engine_pid)
    with tollway.client() as client:
        response = client.post("/v1/chat/completions", json=chat_body(8, stream=False))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8
    assert "restarted" in tollway.output()


def test_requests_while_an_engine_is_down_get_a_503_and_pooled_connections_do_not_outlive_it(
    tollway: Tollway,
) -> None:
    def burst(num_requests: int, stream: bool) -> list[httpx.Response]:
        def one(_: int) -> httpx.Response:
            with tollway.client() as client:
                response = client.post(
                    "/v1/chat/completions", json=chat_body(4, stream=stream), timeout=30
                )
                response.read()
                return response

        with ThreadPoolExecutor(num_requests) as pool:
            return list(pool.map(one, range(num_requests)))

    # Several pooled connections to the engine, kept alive.
    assert {r.status_code for r in burst(6, stream=False)} == {200}
    engine_pid = tollway.engine_pid()
    os.kill(engine_pid, signal.SIGKILL)
    wait_for(lambda: is_gone(engine_pid), 10, "the killed engine to exit")

    # While it is down: a prompt, clean 503 in OpenAI's format, streamed or not.
    for response in [*burst(2, stream=False), *burst(2, stream=True)]:
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "upstream_unavailable"

    # Once it is back, every request succeeds: no dead pooled connection is reused.
    _wait_for_a_new_engine(tollway, engine_pid)
    for stream in (False, True):
        responses = burst(6, stream=stream)
        assert [r.status_code for r in responses] == [200] * 6, [r.text for r in responses]
