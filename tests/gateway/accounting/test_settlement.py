"""Settlement end to end, without torch: a real gateway in front of the stand-in engine, on
the in-process ledger and on Redis. Each case of `gateway.accounting.settlement`'s table: the
request's one usage record says what was settled, and the budget shows exactly that as used
and nothing left reserved.

    engine usage arrived                 -> prompt + completion, as the engine reported them
    stream stopped early (client gone)   -> the gateway's prompt count + tokens relayed
    engine never answered / refused      -> released: nothing used

and the record keeps the finish reason the engine sent (none where none came).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.admission.token_counter import for_openai_model
from gateway.storage.database import Database
from gateway.storage.models import UsageRecord
from gateway.storage.usage_store import list_usage
from tests.support.polling import wait_until
from tests.support.stand_in_engine import MODEL
from tests.support.stand_in_stack import (
    TappedEngine,
    gateway,
    stand_in_engine,
    stand_in_settings,
    tenant_key,
)

NUM_CHUNKS = 6
MESSAGES = [{"role": "user", "content": "a prompt of six words"}]  # 5 tokens to the stand-in
ENGINE_PROMPT_TOKENS = 5
GATEWAY_PROMPT_TOKENS = for_openai_model(MODEL).count_chat(MESSAGES)
BUDGET = 10_000


@pytest.fixture(params=["memory", "redis"])
def ledger_overrides(request: pytest.FixtureRequest) -> dict[str, Any]:
    if request.param == "redis":
        return {"redis_url": request.getfixturevalue("redis_url")}
    return {}


def _usage_record(database_url: str, tenant_id: str) -> UsageRecord:
    """The tenant's one usage record, once the writer has written it."""
    database = Database(database_url)
    records: list[UsageRecord] = []

    def written() -> bool:
        with database.session() as session:
            records[:] = list_usage(session, tenant_id=tenant_id).records
        return bool(records)

    try:
        wait_until(written, what="the usage record is written")
    finally:
        database.dispose()
    (record,) = records
    return record


def _budget(base: str, key: str) -> tuple[int, int]:
    """``(used, reserved)``."""
    response = httpx.get(f"{base}/v1/budget", headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response.json()["used"], response.json()["reserved"]


@pytest.fixture
def paced_stack(
    sqlite_db_url: str, tmp_path: Path, ledger_overrides: dict[str, Any]
) -> Iterator[tuple[TappedEngine, str]]:
    """A stand-in that streams 50 tokens, one every 20 ms: a client can leave mid-stream."""
    with (
        stand_in_engine(num_chunks=50, itl_ms=20) as engine,
        gateway(
            stand_in_settings(engine, tmp_path / "gw", sqlite_db_url, **ledger_overrides)
        ) as base,
    ):
        yield engine, base


@pytest.fixture
def stack(
    sqlite_db_url: str, tmp_path: Path, ledger_overrides: dict[str, Any]
) -> Iterator[tuple[TappedEngine, str]]:
    with (
        stand_in_engine(num_chunks=NUM_CHUNKS) as engine,
        gateway(
            stand_in_settings(engine, tmp_path / "gw", sqlite_db_url, **ledger_overrides)
        ) as base,
    ):
        yield engine, base


@pytest.mark.parametrize("stream", [False, True])
def test_an_answered_request_is_charged_the_engine_usage(
    stack: tuple[TappedEngine, str], sqlite_db_url: str, stream: bool
) -> None:
    _, base = stack
    tenant_id, key = tenant_key(sqlite_db_url, budget_tokens=BUDGET, budget_period="total")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 100, "stream": stream}
    headers = {"authorization": f"Bearer {key}"}
    with httpx.stream(
        "POST", f"{base}/v1/chat/completions", json=body, headers=headers, timeout=30
    ) as response:
        assert response.status_code == 200
        response.read()
    record = _usage_record(sqlite_db_url, tenant_id)
    assert record.status.value == "completed"
    assert record.streamed is stream
    assert record.finish_reason == "length"  # the stand-in's: its answer ends at NUM_CHUNKS
    assert (record.prompt_tokens, record.completion_tokens) == (ENGINE_PROMPT_TOKENS, NUM_CHUNKS)
    # prices per million tokens: input 1,000,000 and output 2,000,000 micros
    assert record.cost_micros == ENGINE_PROMPT_TOKENS * 1 + NUM_CHUNKS * 2
    assert _budget(base, key) == (ENGINE_PROMPT_TOKENS + NUM_CHUNKS, 0)


def test_a_stream_the_client_leaves_is_charged_the_tokens_relayed(
    paced_stack: tuple[TappedEngine, str], sqlite_db_url: str
) -> None:
    _, base = paced_stack
    tenant_id, key = tenant_key(sqlite_db_url, budget_tokens=BUDGET, budget_period="total")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 500, "stream": True}
    num_read = 0
    with httpx.stream(
        "POST",
        f"{base}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                num_read += bool(choices and choices[0]["delta"].get("content"))
            if num_read == 3:
                break  # leaving the block closes the connection mid-stream
    record = _usage_record(sqlite_db_url, tenant_id)
    assert record.status.value == "cancelled"
    assert record.finish_reason is None  # the client left before the finish chunk
    assert record.prompt_tokens == GATEWAY_PROMPT_TOKENS  # no engine usage came
    assert 3 <= record.completion_tokens < 50
    assert _budget(base, key) == (record.prompt_tokens + record.completion_tokens, 0)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _tool_call_deltas(response: httpx.Response, most: int | None = None) -> list[dict[str, Any]]:
    """The streamed deltas that carry a piece of a tool call (at most ``most`` of them)."""
    deltas = []
    for line in response.iter_lines():
        if line.startswith("data: {"):
            choices = json.loads(line[6:])["choices"]
            if choices and choices[0]["delta"].get("tool_calls"):
                assert choices[0]["delta"].get("content") is None
                deltas.append(choices[0]["delta"])
            if choices and choices[0]["finish_reason"] is not None:
                assert choices[0]["finish_reason"] == "tool_calls"
        if len(deltas) == most:
            break  # leaving the block closes the connection mid-stream
    return deltas


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_answer_is_recorded_and_charged_as_any_answer(
    stack: tuple[TappedEngine, str], sqlite_db_url: str, stream: bool
) -> None:
    """Its content is null and its finish reason ``tool_calls``: still a completed answer
    with a first token, charged the engine's usage."""
    _, base = stack
    tenant_id, key = tenant_key(sqlite_db_url, budget_tokens=BUDGET, budget_period="total")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 100, "stream": stream}
    with httpx.stream(
        "POST",
        f"{base}/v1/chat/completions",
        json={**body, "tools": TOOLS},
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    ) as response:
        assert response.status_code == 200
        if stream:
            deltas = _tool_call_deltas(response)
            assert len(deltas) == NUM_CHUNKS
            assert deltas[0]["tool_calls"][0]["function"]["name"] == "get_weather"
        else:
            (choice,) = json.loads(response.read())["choices"]
            assert choice["finish_reason"] == "tool_calls"
            assert choice["message"]["content"] is None
            assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    record = _usage_record(sqlite_db_url, tenant_id)
    assert record.status.value == "completed"
    assert record.finish_reason == "tool_calls"
    assert (record.prompt_tokens, record.completion_tokens) == (ENGINE_PROMPT_TOKENS, NUM_CHUNKS)
    assert record.ttft_ms is not None
    assert _budget(base, key) == (ENGINE_PROMPT_TOKENS + NUM_CHUNKS, 0)


def test_a_tool_call_the_client_leaves_is_charged_the_pieces_relayed(
    paced_stack: tuple[TappedEngine, str], sqlite_db_url: str
) -> None:
    _, base = paced_stack
    tenant_id, key = tenant_key(sqlite_db_url, budget_tokens=BUDGET, budget_period="total")
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 500, "stream": True}
    with httpx.stream(
        "POST",
        f"{base}/v1/chat/completions",
        json={**body, "tools": TOOLS},
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    ) as response:
        assert response.status_code == 200
        assert len(_tool_call_deltas(response, most=3)) == 3
    record = _usage_record(sqlite_db_url, tenant_id)
    assert record.status.value == "cancelled"
    assert record.finish_reason is None
    assert 3 <= record.completion_tokens < 50
    assert record.ttft_ms is not None
    assert _budget(base, key) == (record.prompt_tokens + record.completion_tokens, 0)


def test_a_request_the_engine_fails_is_released_and_charged_nothing(
    stack: tuple[TappedEngine, str], sqlite_db_url: str
) -> None:
    engine, base = stack
    engine.fail_with = 500
    tenant_id, key = tenant_key(sqlite_db_url, budget_tokens=BUDGET, budget_period="total")
    response = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 100},
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert response.status_code >= 500
    assert response.json()["error"]["type"] == "server_error"
    assert engine.requests  # it did reach the engine
    record = _usage_record(sqlite_db_url, tenant_id)
    assert record.status.value == "upstream_error"
    assert record.finish_reason is None
    assert (record.prompt_tokens, record.completion_tokens, record.cost_micros) == (0, 0, 0)
    assert _budget(base, key) == (0, 0)


def test_a_refused_request_is_recorded_and_holds_nothing(
    stack: tuple[TappedEngine, str], sqlite_db_url: str
) -> None:
    engine, base = stack
    tenant_id, key = tenant_key(sqlite_db_url, budget_tokens=20, budget_period="total")
    response = httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 100},
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert response.status_code == 429
    record = _usage_record(sqlite_db_url, tenant_id)
    assert record.status.value == "rejected"
    assert record.reject_reason == "insufficient_quota"
    assert record.finish_reason is None
    assert (record.prompt_tokens, record.completion_tokens) == (0, 0)
    assert engine.requests == []
    assert _budget(base, key) == (0, 0)
