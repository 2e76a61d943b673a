"""An engine's error reaches the client as the gateway's own OpenAI-format error.

A stand-in upstream (a bare ASGI app on a unix socket, no torch) answers each request the
way the ``user`` field names: an error body as the engine's server writes it (from the
shared vocabulary), or a stream that breaks with an engine error event. The gateway runs
for real in front of it; each case checks what the client gets, and how it is recorded.
"""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from gateway.app import build_gateway
from gateway.settings import GatewaySettings
from gateway.storage.api_keys import create_key
from gateway.storage.database import Database
from gateway.storage.tenants import create_tenant
from gateway.storage.usage_store import list_usage
from openai_protocol import errors as vocabulary
from openai_protocol.errors import error_body
from tests.support.polling import wait_until
from tests.support.uvicorn_thread import start_in_thread, stop_thread

MODEL = "scripted"
ENGINE_SECRET = "CUDA out of memory in layer 7 (engine internals)"
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream")]

# What the engine answers, by the request's ``user``: (status, body).
ANSWERS: dict[str, tuple[int, dict[str, Any]]] = {
    "400": (
        400,
        error_body(
            "This model's maximum context length is 4096 tokens; the prompt has 5000.",
            vocabulary.CONTEXT_LENGTH_EXCEEDED.type,
            vocabulary.CONTEXT_LENGTH_EXCEEDED.code,
            "messages",
        ),
    ),
    "400-bare": (400, {"detail": "not OpenAI's format"}),
    "404": (
        404,
        error_body(
            "The model 'scripted' does not exist", "not_found_error", "model_not_found", "model"
        ),
    ),
    "413": (413, error_body("Request body is larger than the limit", "x", "request_too_large")),
    "429": (429, error_body("Too many requests", "rate_limit_error", "rate_limit_exceeded")),
    "500": (500, error_body(ENGINE_SECRET, vocabulary.SERVER_ERROR, "engine_error")),
}
ENGINE_ERROR_EVENT = error_body(ENGINE_SECRET, vocabulary.SERVER_ERROR, "engine_error")


def _chunk(content: str) -> dict[str, Any]:
    delta = {"role": "assistant", "content": content}
    return {
        "id": "chatcmpl-scripted",
        "object": "chat.completion.chunk",
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
    }


async def scripted_engine(scope: Scope, receive: Receive, send: Send) -> None:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] != "/v1/chat/completions":
        await _answer(send, 404, _JSON, b"{}")
        return
    script = json.loads(body).get("user", "")
    if script == "mid-stream":  # one token, then the engine fails the request
        events = [_chunk("Hello"), ENGINE_ERROR_EVENT]
        data = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        await _answer(send, 200, _SSE, data.encode())
        return
    status, answer = ANSWERS[script]
    await _answer(send, status, _JSON, json.dumps(answer).encode())


async def _answer(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _serve(app: Any, sock: socket.socket, lifespan: str = "on") -> tuple[uvicorn.Server, Any]:
    config = uvicorn.Config(app, loop="asyncio", http="h11", lifespan=lifespan, log_level="warning")
    server = uvicorn.Server(config)
    return server, start_in_thread(server, [sock])


@pytest.fixture(scope="module")
def engine_socket() -> Iterator[str]:
    tmp = tempfile.mkdtemp(prefix="tw-err-")  # short: a socket path must stay under 108 bytes
    path = f"{tmp}/engine.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    running = _serve(scripted_engine, sock, lifespan="off")
    try:
        yield path
    finally:
        stop_thread(*running)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def served(
    engine_socket: str, sqlite_db_url: str, tmp_path: Path
) -> Iterator[tuple[str, str, str]]:
    """``(base_url, tenant_id, key)``: a gateway in front of the scripted engine."""
    settings = GatewaySettings.from_dict(
        {
            "data_dir": str(tmp_path / "gateway"),
            "database_url": sqlite_db_url,
            "models": {MODEL: {"upstreams": [f"unix:{engine_socket}"], "context_window": 4096}},
        }
    )
    database = Database(sqlite_db_url)
    try:
        with database.transaction() as session:
            create_tenant(session, "t-errors", name="t-errors", tier="standard", quota={})
            key = create_key(session, "t-errors").key
    finally:
        database.dispose()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    running = _serve(build_gateway(settings), sock)
    try:
        yield f"http://127.0.0.1:{port}", "t-errors", key
    finally:
        stop_thread(*running)


def _ask(served: tuple[str, str, str], script: str, *, is_stream: bool = False) -> httpx.Response:
    base, _, key = served
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "user": script,
        "stream": is_stream,
    }
    with httpx.Client(base_url=base, timeout=30) as client:
        return client.post(
            "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
        )


def _records(db_url: str, tenant_id: str, count: int) -> list[Any]:
    """The tenant's usage records, once ``count`` of them are in the database."""
    database = Database(db_url)
    records: list[Any] = []
    try:

        def have_landed() -> bool:
            with database.session() as session:
                records[:] = list_usage(session, tenant_id=tenant_id).records
            return len(records) >= count

        wait_until(have_landed, 10, f"{count} usage records")
        return records
    finally:
        database.dispose()


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-request-id"].startswith("req_")  # the gateway's own answer
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == vocabulary.type_for(status)
    return error


# (script, status the client gets, code, param, message contains, usage record's status)
CASES = [
    ("400", 400, "context_length_exceeded", "messages", "maximum context length", "rejected"),
    ("400-bare", 400, "invalid_request", None, "The engine refused", "rejected"),
    ("413", 413, "request_too_large", None, "larger than the limit", "rejected"),
    ("404", 502, "upstream_error", None, "(404 model_not_found)", "upstream_error"),
    ("429", 503, "upstream_unavailable", None, "over capacity", "upstream_error"),
    ("500", 502, "upstream_error", None, "The engine failed", "upstream_error"),
]


@pytest.mark.parametrize("is_stream", [False, True])
@pytest.mark.parametrize(("script", "status", "code", "param", "says", "recorded"), CASES)
def test_an_engine_error_reaches_the_client_as_the_gateways_error(
    served: tuple[str, str, str],
    sqlite_db_url: str,
    is_stream: bool,
    script: str,
    status: int,
    code: str,
    param: str | None,
    says: str,
    recorded: str,
) -> None:
    response = _ask(served, script, is_stream=is_stream)
    error = _error(response, status)
    assert (error["code"], error["param"]) == (code, param)
    assert says in error["message"]
    assert ENGINE_SECRET not in response.text  # the engine's internals stay inside
    if status == 503:
        assert response.headers["retry-after"] == "1"
    (record,) = _records(sqlite_db_url, served[1], 1)
    assert record.status.value == recorded
    if recorded == "rejected":
        assert record.reject_reason == code


def test_an_engine_error_mid_stream_ends_the_stream_with_the_gateways_error_event(
    served: tuple[str, str, str], sqlite_db_url: str
) -> None:
    response = _ask(served, "mid-stream", is_stream=True)
    assert response.status_code == 200, response.text
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line.strip()]
    assert events[-1] == "[DONE]"
    assert json.loads(events[0])["choices"][0]["delta"]["content"] == "Hello"
    error = json.loads(events[-2])["error"]
    assert error == {
        "message": error["message"],
        "type": vocabulary.UPSTREAM_ERROR.type,
        "param": None,
        "code": vocabulary.UPSTREAM_ERROR.code,
    }
    assert ENGINE_SECRET not in response.text
    (record,) = _records(sqlite_db_url, served[1], 1)
    assert record.status.value == "upstream_error"
    assert record.completion_tokens == 1  # the token relayed before the failure is charged


def test_every_scripted_status_is_a_case() -> None:
    """No scripted answer goes untested."""
    assert {script for script, *_ in CASES} == set(ANSWERS)
