"""Speculative decoding through the engine's HTTP server: a streamed completion that keeps
several tokens in a step streams them all, with their logprobs, and says the same as the
stream without speculation."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from backend_engine.async_engine import AsyncEngine
from backend_engine.config import EngineConfig
from backend_engine.server.app import build_app, uvicorn_config
from tests.support.uvicorn_thread import start_in_thread, stop_thread

MODEL_NAME = "tiny-demo"
# Greedy decoding of a prompt that repeats itself: the n-gram proposer's drafts are kept.
REPEATING_PROMPT = "one two three four five six. " * 6


@contextmanager
def _serving(config: EngineConfig) -> Iterator[tuple[str, AsyncEngine]]:
    engine = AsyncEngine(config, model_name=MODEL_NAME)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn_config(build_app(engine), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = start_in_thread(server, [sock])
    try:
        yield f"http://127.0.0.1:{port}", engine
    finally:
        stop_thread(server, thread)
        sock.close()


def _stream(base_url: str, stop: list[str] | None = None) -> list[dict[str, Any]]:
    """The chunks of a streamed greedy chat completion with logprobs."""
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": REPEATING_PROMPT}],
        "temperature": 0,
        "max_tokens": 40,
        "logprobs": True,
        "top_logprobs": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if stop is not None:
        body["stop"] = stop
    chunks = []
    with (
        httpx.Client(base_url=base_url, timeout=120.0, trust_env=False) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    return chunks


def _answer(chunks: list[dict[str, Any]]) -> tuple[str, list[tuple[str, float]], Any, Any]:
    text, logprobs, finish_reason, usage = "", [], None, None
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            text += choice["delta"].get("content") or ""
            finish_reason = choice.get("finish_reason") or finish_reason
            for entry in (choice.get("logprobs") or {}).get("content") or []:
                logprobs.append((entry["token"], entry["logprob"]))
    return text, logprobs, finish_reason, usage


def _most_tokens_in_a_chunk(chunks: list[dict[str, Any]]) -> int:
    return max(
        len((choice.get("logprobs") or {}).get("content") or [])
        for chunk in chunks
        for choice in chunk["choices"]
    )


def test_a_speculative_stream_says_what_a_plain_one_says(
    demo_checkpoint: Callable[..., Path],
) -> None:
    config = EngineConfig(model=str(demo_checkpoint()), num_kv_blocks=128, show_progress=False)
    with _serving(config) as (base_url, _):
        plain = _stream(base_url)
    with _serving(replace(config, speculative_proposer="ngram")) as (base_url, engine):
        speculative = _stream(base_url)
        (counts,) = engine.stats().speculative.values()
    assert counts.num_accepted_tokens > 0, "no draft was kept: the test proves nothing"
    assert _most_tokens_in_a_chunk(plain) == 1
    assert _most_tokens_in_a_chunk(speculative) > 1  # a step's kept drafts, streamed together
    plain_text, plain_logprobs, plain_finish, plain_usage = _answer(plain)
    text, logprobs, finish, usage = _answer(speculative)
    assert (text, finish, usage["completion_tokens"]) == (
        plain_text,
        plain_finish,
        plain_usage["completion_tokens"],
    )
    assert [token for token, _ in logprobs] == [token for token, _ in plain_logprobs]
    for (_, value), (_, plain_value) in zip(logprobs, plain_logprobs, strict=True):
        assert abs(value - plain_value) < 1e-3


def test_a_stop_string_inside_a_kept_run_ends_the_stream_where_it_would_have(
    demo_checkpoint: Callable[..., Path],
) -> None:
    config = EngineConfig(model=str(demo_checkpoint()), num_kv_blocks=128, show_progress=False)
    with _serving(config) as (base_url, _):
        plain_text, _, _, _ = _answer(_stream(base_url))
    # A stop string from the middle of the plain answer (text the speculative run keeps in a
    # run of drafts, since the answer repeats itself).
    stop = plain_text[len(plain_text) // 2 : len(plain_text) // 2 + 3]
    assert stop.strip(), f"the plain answer has no text to stop on: {plain_text!r}"
    with _serving(config) as (base_url, _):
        expected = _answer(_stream(base_url, stop=[stop]))
    with _serving(replace(config, speculative_proposer="ngram")) as (base_url, _):
        got = _answer(_stream(base_url, stop=[stop]))
    assert got[0] == expected[0]
    assert got[2] == expected[2] == "stop"
    assert got[3]["completion_tokens"] == expected[3]["completion_tokens"]
