"""The engine's OpenAI-compatible server, over real HTTP with a real engine.

A real engine over the tiny demo checkpoint, served by uvicorn on a free local port.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from backend_engine.async_engine import AsyncEngine
from backend_engine.config import EngineConfig
from backend_engine.outputs import EngineStats
from backend_engine.server.app import build_app, uvicorn_config
from backend_engine.server.token_text import TokenText
from tests.backend_engine.server.response_schema import check_answer, checked_client
from tests.support.polling import wait_until
from tests.support.uvicorn_thread import start_in_thread, stop_thread

MODEL_NAME = "tiny-demo"
MAX_MODEL_LEN = 2048  # the tiny demo's whole context: ~0.3 s of generation


@dataclass(frozen=True)
class LiveServer:
    base_url: str
    engine: AsyncEngine

    def client(self, **kwargs: Any) -> httpx.Client:
        """A client whose every answer is checked against OpenAI's response schema."""
        return checked_client(self.base_url, timeout=kwargs.pop("timeout", 60.0), **kwargs)


@pytest.fixture(scope="module")
def live_server(demo_checkpoint: Callable[..., Path]) -> Iterator[LiveServer]:
    config = EngineConfig(
        model=str(demo_checkpoint(architecture="LlamaForCausalLM", size="tiny")),
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=512,
        max_num_seqs=8,
        show_progress=False,
    )
    engine = AsyncEngine(config, model_name=MODEL_NAME)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn_config(build_app(engine), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = start_in_thread(server, [sock])
    try:
        yield LiveServer(base_url=f"http://127.0.0.1:{port}", engine=engine)
    finally:
        stop_thread(server, thread)
        sock.close()


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PARTS = [{"type": "text", "text": "Tell me about "}, {"type": "text", "text": "cats."}]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": PARTS}]


def greedy(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "temperature": 0, "max_tokens": 12, "ignore_eos": True, **extra}


def sse_events(response: httpx.Response) -> list[Any]:
    """The ``data:`` payloads of an event stream: dicts, then the final ``"[DONE]"``; each
    chunk checked against OpenAI's response schema."""
    assert response.headers["content-type"].startswith("text/event-stream")
    events: list[Any] = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line.removeprefix("data: ")
        events.append(data if data == "[DONE]" else json.loads(data))
    for chunk in events[:-1]:
        check_answer(chunk, is_chunk=True)
    return events


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str)
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    return error


def wait_idle(server: LiveServer) -> EngineStats:
    wait_until(lambda: server.engine.stats().num_running == 0, 30, "an idle engine")
    return server.engine.stats()


def test_health_and_models(live_server: LiveServer) -> None:
    with live_server.client() as client:
        assert client.get("/health").json() == {"status": "ok"}
        models = client.get("/v1/models").json()
    assert models["object"] == "list"
    [card] = models["data"]
    assert card["id"] == MODEL_NAME
    assert card["object"] == "model"
    assert card["max_model_len"] == MAX_MODEL_LEN


def test_chat_completion(live_server: LiveServer) -> None:
    with live_server.client() as client:
        response = client.post(
            CHAT, json=greedy(messages=MESSAGES), headers={"x-request-id": "r-1"}
        )
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == "r-1"
    body = response.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert body["model"] == MODEL_NAME
    assert isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice["index"] == 0
    assert choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"]
    assert choice["logprobs"] is None
    usage = body["usage"]
    assert usage["completion_tokens"] == 12
    assert usage["prompt_tokens"] > 10
    assert usage["total_tokens"] == usage["prompt_tokens"] + 12
    assert isinstance(usage["prompt_tokens_details"]["cached_tokens"], int)


def test_request_id_is_generated(live_server: LiveServer) -> None:
    with live_server.client() as client:
        first = client.get("/health").headers["x-request-id"]
        second = client.get("/health").headers["x-request-id"]
    assert first
    assert second
    assert first != second


def test_streamed_chat_matches_non_streamed(live_server: LiveServer) -> None:
    request = greedy(messages=MESSAGES)
    with live_server.client() as client:
        whole = client.post(CHAT, json=request).json()
        with client.stream(
            "POST",
            CHAT,
            json={**request, "stream": True, "stream_options": {"include_usage": True}},
        ) as response:
            assert response.status_code == 200
            events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    *content_chunks, usage_chunk = chunks
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in content_chunks)
    assert content == whole["choices"][0]["message"]["content"]
    assert [c["choices"][0]["finish_reason"] for c in content_chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in content_chunks[:-1])
    assert all(c["usage"] is None for c in content_chunks)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert usage_chunk["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]


def test_stream_without_usage_has_no_usage_chunk(live_server: LiveServer) -> None:
    with (
        live_server.client() as client,
        client.stream(
            "POST", CHAT, json=greedy(messages=MESSAGES, stream=True, max_tokens=3)
        ) as response,
    ):
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    assert all(e["choices"] and "usage" not in e for e in events[:-1])


@pytest.mark.parametrize("prompt", ["The cat sat on the", ["The cat sat on the"], [5, 6, 7, 8, 9]])
def test_completions_streamed_and_not(live_server: LiveServer, prompt: Any) -> None:
    request = greedy(prompt=prompt)
    with live_server.client() as client:
        whole = client.post(COMPLETIONS, json=request).json()
        with client.stream(
            "POST",
            COMPLETIONS,
            json={**request, "stream": True, "stream_options": {"include_usage": True}},
        ) as response:
            events = sse_events(response)
    assert whole["id"].startswith("cmpl-")
    assert whole["object"] == "text_completion"
    [choice] = whole["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["text"]
    assert whole["usage"]["completion_tokens"] == 12
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == whole["usage"]


def test_cached_tokens_reported(live_server: LiveServer) -> None:
    prompt = list(range(10, 10 + 64))  # four 16-token blocks, shareable by the second request
    with live_server.client() as client:
        client.post(COMPLETIONS, json=greedy(prompt=prompt, max_tokens=2))
        second = client.post(COMPLETIONS, json=greedy(prompt=prompt, max_tokens=2)).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_chat_logprobs(live_server: LiveServer) -> None:
    request = greedy(messages=MESSAGES, logprobs=True, top_logprobs=2, max_tokens=5)
    with live_server.client() as client:
        body = client.post(CHAT, json=request).json()
        with client.stream("POST", CHAT, json={**request, "stream": True}) as response:
            events = sse_events(response)
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    for entry in content:
        assert isinstance(entry["token"], str)
        assert entry["logprob"] <= 0
        assert all(0 <= b < 256 for b in entry["bytes"])
        assert len(entry["top_logprobs"]) == 2
        # Greedy: the sampled token is the most likely one.
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"], abs=1e-4)
    # The bytes are exact even where a token holds part of a UTF-8 character.
    text = b"".join(bytes(e["bytes"]) for e in content).decode("utf-8", errors="replace")
    assert text.startswith(body["choices"][0]["message"]["content"])
    streamed = [
        entry
        for e in events[:-1]
        if e["choices"][0]["logprobs"] is not None
        for entry in e["choices"][0]["logprobs"]["content"]
    ]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]


def test_token_bytes_are_exact(live_server: LiveServer) -> None:
    tokenizer = live_server.engine.tokenizer
    token_text = TokenText(tokenizer)
    text = "héllo wörld ✓ 日本"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(bytes(token_text(i)[1]) for i in ids) == text.encode()


def test_completion_logprobs(live_server: LiveServer) -> None:
    with live_server.client() as client:
        body = client.post(COMPLETIONS, json=greedy(prompt="Once upon", logprobs=3, max_tokens=4))
    logprobs = body.json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 4
    assert all(len(top) <= 3 and top for top in logprobs["top_logprobs"])
    assert logprobs["text_offset"][0] == 0
    assert logprobs["text_offset"][1] == len(logprobs["tokens"][0])


def test_metrics_are_exported_and_move(live_server: LiveServer) -> None:
    def scrape(client: httpx.Client) -> dict[str, float]:
        response = client.get("/metrics")
        assert response.status_code == 200
        values = {}
        for line in response.text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    with live_server.client() as client:
        wait_idle(live_server)
        before = scrape(client)
        assert client.post(COMPLETIONS, json=greedy(prompt="Hello there")).status_code == 200
        after = scrape(client)
    for name in (
        "tollway_engine_kv_blocks_used",
        "tollway_engine_kv_blocks_total",
        "tollway_engine_requests_waiting",
        "tollway_engine_requests_running",
        "tollway_engine_prefix_cache_queries_total",
        "tollway_engine_prefix_cache_hits_total",
        "tollway_engine_preemptions_total",
    ):
        assert name in after, name
    assert after["tollway_engine_kv_blocks_total"] == 512
    assert after["tollway_engine_generation_tokens_total"] >= (
        before["tollway_engine_generation_tokens_total"] + 12
    )
    assert (
        after["tollway_engine_prompt_tokens_total"] > before["tollway_engine_prompt_tokens_total"]
    )
    counter = 'tollway_engine_http_requests_total{endpoint="completions",status="200"}'
    assert after[counter] == before.get(counter, 0) + 1
    ttft = 'tollway_engine_time_to_first_token_seconds_count{endpoint="completions"}'
    assert after[ttft] == before.get(ttft, 0) + 1


def chat(**extra: Any) -> dict[str, Any]:
    return greedy(messages=MESSAGES, **extra)


def bad(path: str, payload: Any, param: str | None, name: str) -> Any:
    return pytest.param(path, payload, param, id=name)


IMAGE_PART = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
IMAGE_MESSAGE = {"role": "user", "content": [IMAGE_PART]}
BAD_REQUESTS = [
    bad(CHAT, b"{not json", None, "malformed-json"),
    bad(CHAT, b"[1, 2]", None, "not-an-object"),
    bad(CHAT, b"", None, "empty-body"),
    bad(CHAT, {"model": MODEL_NAME}, "messages", "missing-messages"),
    bad(CHAT, chat(max_tokens="ten"), "max_tokens", "str-max-tokens"),
    bad(CHAT, chat(max_tokens=-1), "max_tokens", "negative-max-tokens"),
    bad(CHAT, chat(temperature="hot"), "temperature", "str-temperature"),
    bad(CHAT, chat(stream="yes"), "stream", "str-stream"),
    bad(CHAT, greedy(messages=[{"role": "robot", "content": "hi"}]), "messages", "bad-role"),
    bad(CHAT, greedy(messages=[IMAGE_MESSAGE]), "messages[0].content[0]", "image-part"),
    bad(CHAT, chat(n=129), "n", "n-129"),
    bad(CHAT, chat(stream_options={"include_usage": True}), "stream_options", "options-no-stream"),
    bad(CHAT, chat(logit_bias={"1000000": 5}), "logit_bias", "bias-out-of-vocab"),
    bad(CHAT, chat(presence_penalty=2.5), "presence_penalty", "presence-penalty-2.5"),
    bad(CHAT, chat(top_p=0), "top_p", "top-p-0"),
    bad(CHAT, chat(stop=[""]), "stop[0]", "empty-stop"),
    bad(CHAT, chat(top_logprobs=50, logprobs=True), "top_logprobs", "too-many-logprobs"),
    bad(COMPLETIONS, greedy(prompt=[]), "prompt", "empty-prompt"),
    bad(COMPLETIONS, greedy(prompt=[[1, 2], []]), "prompt[1]", "an-empty-prompt-of-two"),
    bad(COMPLETIONS, greedy(prompt=[[1, 2], [3, 10**9]]), "prompt[1]", "a-token-out-of-vocab"),
    bad(COMPLETIONS, greedy(prompt=["a", "b"], n=65), "n", "n-times-prompts-over-128"),
    bad(COMPLETIONS, greedy(prompt="hi", logit_bias={"99999": 1}), "logit_bias", "bias-vocab"),
    bad(COMPLETIONS, greedy(prompt="hi", suffix="!"), "suffix", "suffix"),
    bad(COMPLETIONS, greedy(prompt="hi", best_of=2), "best_of", "best-of-2"),
    bad(COMPLETIONS, greedy(prompt=[1, "a"]), "prompt[0]", "mixed-prompt"),
    bad(COMPLETIONS, greedy(prompt=[10**9]), "prompt", "token-out-of-vocab"),
    bad(COMPLETIONS, greedy(prompt="hi", logprobs=True), "logprobs", "bool-logprobs"),
]


@pytest.mark.parametrize(("path", "payload", "param"), BAD_REQUESTS)
def test_bad_requests_get_openai_errors(
    live_server: LiveServer, path: str, payload: Any, param: str | None
) -> None:
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    with live_server.client() as client:
        response = client.post(path, content=content, headers={"content-type": "application/json"})
    error = assert_openai_error(response, 400)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_unknown_model_is_404(live_server: LiveServer) -> None:
    with live_server.client() as client:
        response = client.post(CHAT, json={**greedy(messages=MESSAGES), "model": "gpt-17"})
    assert_openai_error(response, 404, "model_not_found")


def test_unknown_route_and_method(live_server: LiveServer) -> None:
    with live_server.client() as client:
        assert_openai_error(client.get("/v1/nothing"), 404)
        assert_openai_error(client.get(COMPLETIONS), 405)


def test_huge_body_is_413(live_server: LiveServer) -> None:
    body = json.dumps(greedy(prompt="x" * (5 * 1024 * 1024))).encode()
    with live_server.client() as client:
        response = client.post(COMPLETIONS, content=body)
    assert_openai_error(response, 413)


def test_huge_chunked_body_is_413(live_server: LiveServer) -> None:
    def chunks() -> Any:  # no content-length: the limit must hold while reading
        for _ in range(6):
            yield b"x" * (1024 * 1024)

    with live_server.client() as client:
        response = client.post(COMPLETIONS, content=chunks())
    assert_openai_error(response, 413)


def test_prompt_too_long_is_context_length_exceeded(live_server: LiveServer) -> None:
    with live_server.client() as client:
        long_prompt = client.post(COMPLETIONS, json=greedy(prompt=[7] * MAX_MODEL_LEN))
        too_many_tokens = client.post(
            CHAT, json=greedy(messages=MESSAGES, max_tokens=MAX_MODEL_LEN)
        )
        streamed = client.post(
            COMPLETIONS, json=greedy(prompt=[7] * (MAX_MODEL_LEN + 1), stream=True)
        )
    assert_openai_error(long_prompt, 400, "context_length_exceeded")
    assert_openai_error(too_many_tokens, 400, "context_length_exceeded")
    assert_openai_error(streamed, 400, "context_length_exceeded")


def test_default_max_tokens_fills_the_context(live_server: LiveServer) -> None:
    prompt = [7] * (MAX_MODEL_LEN - 3)
    with live_server.client() as client:
        body = client.post(
            COMPLETIONS, json={"model": MODEL_NAME, "prompt": prompt, "ignore_eos": True}
        )
    assert body.status_code == 200, body.text
    assert body.json()["usage"]["completion_tokens"] == 3


def test_tenant_and_priority_headers_reach_the_engine(
    live_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = live_server.engine
    seen: list[dict[str, Any]] = []
    original = engine.generate

    def spy(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        seen.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(engine, "generate", spy)
    with live_server.client() as client:
        ok = client.post(
            CHAT,
            json=greedy(messages=MESSAGES, max_tokens=1),
            headers={"x-tenant-id": "acme", "x-priority": "batch"},
        )
        default = client.post(CHAT, json=greedy(messages=MESSAGES, max_tokens=1))
        bad = client.post(CHAT, json=greedy(messages=MESSAGES), headers={"x-priority": "urgent"})
    assert ok.status_code == 200
    assert default.status_code == 200
    assert [(s["tenant_id"], s["priority"].name) for s in seen] == [
        ("acme", "BATCH"),
        ("default", "INTERACTIVE"),
    ]
    assert assert_openai_error(bad, 400)["param"] == "x-priority"


def _long_request(**extra: Any) -> dict[str, Any]:
    return greedy(prompt="Once upon a time", max_tokens=MAX_MODEL_LEN - 16, **extra)


def test_streaming_client_disconnect_aborts(live_server: LiveServer) -> None:
    engine = live_server.engine
    idle = wait_idle(live_server)
    with (
        live_server.client() as client,
        client.stream("POST", COMPLETIONS, json=_long_request(stream=True)) as response,
    ):
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert engine.stats().num_running == 1
        assert engine.stats().num_kv_blocks_used > idle.num_kv_blocks_used
    # Leaving the blocks closes the connection mid-stream.
    wait_until(lambda: engine.stats().num_running == 0, 30, "the request aborted")
    after = engine.stats()
    assert after.num_kv_blocks_used == idle.num_kv_blocks_used
    assert after.num_generation_tokens - idle.num_generation_tokens < MAX_MODEL_LEN - 16


def test_non_streamed_client_disconnect_aborts(live_server: LiveServer) -> None:
    """The client hangs up once generation is under way, not after a fixed wait: the
    tiny demo writes its whole context in about 0.3 s on this CPU."""
    engine = live_server.engine
    idle = wait_idle(live_server)
    body = json.dumps(_long_request()).encode()
    host, port = live_server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as connection:
        connection.sendall(
            f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_until(
            lambda: engine.stats().num_generation_tokens > idle.num_generation_tokens,
            what="generation under way",
        )
    wait_until(lambda: engine.stats().num_running == 0, 30, "the request aborted")
    after = engine.stats()
    assert after.num_kv_blocks_used == idle.num_kv_blocks_used
    assert after.num_generation_tokens - idle.num_generation_tokens < MAX_MODEL_LEN - 16


def test_server_still_serves_after_disconnects(live_server: LiveServer) -> None:
    with live_server.client() as client:
        response = client.post(COMPLETIONS, json=greedy(prompt="Still there?", max_tokens=2))
    assert response.status_code == 200


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_abort_request_stops_a_generation_which_still_answers_with_its_usage(
    live_server: LiveServer, path: str
) -> None:
    engine = live_server.engine
    idle = wait_idle(live_server)
    body = _long_request() if path == COMPLETIONS else greedy(messages=MESSAGES, max_tokens=1900)
    answer: dict[str, httpx.Response] = {}

    def send() -> None:
        with live_server.client() as client:
            answer["response"] = client.post(path, json=body, headers={"x-request-id": "caller-7"})

    sender = threading.Thread(target=send)
    sender.start()
    wait_until(
        lambda: engine.stats().num_generation_tokens > idle.num_generation_tokens,
        what="generation under way",
    )
    with live_server.client() as client:
        aborted = client.post("/abort_request", json={"request_id": "caller-7"})
    sender.join(timeout=30)
    assert aborted.status_code == 200
    assert aborted.json() == {"aborted": True}
    response = answer["response"]
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "caller-7"
    result = response.json()
    assert result["choices"][0]["finish_reason"] == "abort"
    assert 0 < result["usage"]["completion_tokens"] < body["max_tokens"]
    assert wait_idle(live_server).num_kv_blocks_used == idle.num_kv_blocks_used


def test_abort_request_for_nothing_in_flight_and_bad_bodies(live_server: LiveServer) -> None:
    with live_server.client() as client:
        done = client.post(COMPLETIONS, json=greedy(prompt="Hi"), headers={"x-request-id": "x1"})
        assert done.status_code == 200
        gone = client.post("/abort_request", json={"request_id": "x1"})
        assert gone.status_code == 200
        assert gone.json() == {"aborted": False}
        assert_openai_error(client.post("/abort_request", json={}), 400)
        assert_openai_error(client.post("/abort_request", json={"request_id": 7}), 400)
        assert_openai_error(client.post("/abort_request", content=b"{"), 400)
