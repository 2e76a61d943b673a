"""A client that leaves mid-answer, against real processes: the engine stops the request (its KV
blocks are freed) and the record says cancelled, charging what was generated or relayed.

One real ``tollway serve`` (gateway + one engine child on a Unix socket) for the module.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import pytest

from gateway.storage.models import UsageStatus
from gateway.storage.usage_store import UsageEntry
from tests.faults.processes import (
    Tollway,
    chat_body,
    read_stream,
    shared_tollway,
)
from tests.support.polling import wait_until

pytestmark = pytest.mark.timeout(180)

LONG = 1000  # tokens asked for (the default tenant allows 1024): more than come before leaving
NUM_TOKENS_BEFORE_LEAVING = 5
CHAT = "/v1/chat/completions"
GENERATED = "tollway_engine_generation_tokens_total"


class _ClientLeft(Exception):
    pass


@pytest.fixture
def tollway(request: pytest.FixtureRequest, demo_checkpoint: Callable[..., Path]) -> Tollway:
    return shared_tollway(request.config, demo_checkpoint(size="tiny"))


def _engine_is_idle(tollway: Tollway) -> bool:
    return (
        tollway.engine_metric("tollway_engine_requests_running") == 0
        and tollway.engine_metric("tollway_engine_requests_waiting") == 0
        and tollway.engine_metric("tollway_engine_kv_blocks_used") == 0
    )


def _check_the_ledger_matches_the_records(tollway: Tollway) -> None:
    with tollway.client() as client:
        budget = client.get("/v1/budget").json()
    records = tollway.records().values()
    assert budget["reserved"] == 0
    assert budget["used"] == sum(r.prompt_tokens + r.completion_tokens for r in records)


def test_a_client_leaving_a_stream_stops_the_engine_request_and_is_charged_what_was_relayed(
    tollway: Tollway,
) -> None:
    wait_until(lambda: _engine_is_idle(tollway), 30, "an idle engine")
    generated_before = tollway.engine_metric(GENERATED)

    def leave_after_a_few_tokens(seen: object) -> None:
        if getattr(seen, "num_tokens", 0) >= NUM_TOKENS_BEFORE_LEAVING:
            raise _ClientLeft

    body = chat_body(LONG, stream=True)
    with tollway.client() as client, client.stream("POST", CHAT, json=body) as response:
        request_id = response.headers["x-request-id"]
        with pytest.raises(_ClientLeft):
            read_stream(response, leave_after_a_few_tokens)
    # leaving the block closed the connection mid-stream

    wait_until(lambda: _engine_is_idle(tollway), 30, "the engine to stop the request")
    tollway.wait_for_records({request_id})
    record = tollway.records()[request_id]
    assert record.status is UsageStatus.CANCELLED
    assert record.streamed
    assert record.prompt_tokens > 0
    # Charged what was relayed: at least what this client read, less than it asked for.
    assert NUM_TOKENS_BEFORE_LEAVING <= record.completion_tokens < LONG
    generated = tollway.engine_metric(GENERATED) - generated_before
    assert record.completion_tokens <= generated < LONG  # the engine stopped generating
    _check_the_ledger_matches_the_records(tollway)


def test_a_client_leaving_a_non_streamed_request_stops_it_and_is_charged_what_was_generated(
    tollway: Tollway,
) -> None:
    wait_until(lambda: _engine_is_idle(tollway), 30, "an idle engine")
    generated_before = tollway.engine_metric(GENERATED)
    sent_at = datetime.now(timezone.utc)
    body = json.dumps(chat_body(LONG, stream=False)).encode()
    request = (
        f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1:{tollway.port}\r\n"
        f"Authorization: Bearer {tollway.api_key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection(("127.0.0.1", tollway.port), timeout=10) as conn:
        conn.sendall(request)
        wait_until(
            lambda: (
                tollway.engine_metric(GENERATED) - generated_before >= NUM_TOKENS_BEFORE_LEAVING
            ),
            30,
            "the engine to generate a few tokens",
        )
    # the socket is closed: the client has left without its answer

    wait_until(lambda: _engine_is_idle(tollway), 30, "the engine to stop the request")
    generated = tollway.engine_metric(GENERATED) - generated_before
    assert NUM_TOKENS_BEFORE_LEAVING <= generated < LONG

    def new_records() -> list[UsageEntry]:
        return [r for r in tollway.records().values() if r.created_at >= sent_at]

    wait_until(lambda: bool(new_records()), 30, "the usage record")
    (record,) = new_records()
    assert not record.streamed
    assert record.status is UsageStatus.CANCELLED
    # Charged what the engine generated for it, as the engine reported when it stopped.
    assert record.prompt_tokens > 0
    assert record.completion_tokens == generated
    _check_the_ledger_matches_the_records(tollway)
