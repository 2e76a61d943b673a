"""A request that fails inside the engine gets an OpenAI error; the others never notice.

The failure is injected into the engine's per-request output processing for one tenant
(``mallory``), so these tests need no input that validation might refuse.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from backend_engine.core.request import Request
from backend_engine.text.output_processor import OutputProcessor
from tests.backend_engine.server.response_schema import check_answer
from tests.backend_engine.server.test_app import (
    MODEL_NAME,
    LiveServer,
    assert_openai_error,
    live_server,
    wait_idle,
)

__all__ = ["live_server"]  # the fixture, shared with test_app

COMPLETIONS = "/v1/completions"
NUM_VICTIMS = 12


@pytest.fixture
def mallory_fails_after(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Set ``[n]``: tenant mallory's requests raise in output processing at token n + 1."""
    after: list[int] = []
    process = OutputProcessor.process

    def failing(self: OutputProcessor, request: Request, logprob: Any) -> Any:
        if request.tenant_id == "mallory" and request.num_output_tokens > after[0]:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return process(self, request, logprob)

    monkeypatch.setattr(OutputProcessor, "process", failing)
    return after


def victim_body(i: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "prompt": f"Tenant alice asks question {i}",
        "max_tokens": 16,
        "ignore_eos": True,
        "stream": True,
    }
    if i % 2:
        return {**body, "temperature": 0.8, "top_k": 30, "seed": 100 + i}
    return {**body, "temperature": 0}


def events_of(text: str) -> list[Any]:
    events = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
            if data != "[DONE]":
                check_answer(events[-1], is_chunk=True)
    return events


async def stream(client: httpx.AsyncClient, body: dict[str, Any], tenant: str) -> list[Any]:
    response = await client.post(COMPLETIONS, json=body, headers={"x-tenant-id": tenant})
    assert response.status_code == 200, response.text
    return events_of(response.text)


def text_of(events: list[Any]) -> str:
    return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"])


def test_a_stream_failing_mid_way_ends_with_an_error_event_and_the_others_go_on(
    live_server: LiveServer, mallory_fails_after: list[int]
) -> None:
    mallory_fails_after.append(3)

    async def scenario() -> tuple[list[list[Any]], list[list[Any]]]:
        async with httpx.AsyncClient(base_url=live_server.base_url, timeout=120) as client:
            alone = [await stream(client, victim_body(i), "alice") for i in range(NUM_VICTIMS)]
            poison = {**victim_body(0), "prompt": "Mallory's turn", "max_tokens": 16}
            together = await asyncio.gather(
                stream(client, poison, "mallory"),
                *(stream(client, victim_body(i), "alice") for i in range(NUM_VICTIMS)),
            )
            return alone, together

    alone, (failed, *victims) = asyncio.run(scenario())
    assert [text_of(v) for v in victims] == [text_of(a) for a in alone]
    assert all(v[-2]["choices"][0]["finish_reason"] == "length" for v in victims)
    assert failed[-1] == "[DONE]"
    error = failed[-2]["error"]
    assert error["type"] == "server_error"
    assert error["code"] == "engine_error"
    assert "UnicodeDecodeError" in error["message"]
    assert text_of(failed[:-2])  # the tokens before the failure were delivered
    stats = wait_idle(live_server)
    assert stats.num_kv_blocks_used == 0


@pytest.mark.parametrize("is_stream", [False, True])
def test_a_request_failing_before_its_first_token_is_a_500_server_error(
    live_server: LiveServer, mallory_fails_after: list[int], is_stream: bool
) -> None:
    mallory_fails_after.append(0)
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "stream": is_stream}
    with live_server.client() as client:
        response = client.post(COMPLETIONS, json=body, headers={"x-tenant-id": "mallory"})
        error = assert_openai_error(response, 500, "engine_error")
        assert error["type"] == "server_error"
        ok = client.post(COMPLETIONS, json=body, headers={"x-tenant-id": "alice"})
        assert ok.status_code == 200, ok.text
