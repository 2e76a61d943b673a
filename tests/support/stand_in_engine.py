"""An OpenAI-compatible stand-in engine for gateway benchmarks: a bare ASGI app, no model.

``/v1/chat/completions`` answers streamed (a role chunk, ``num_chunks`` content chunks, a
finish chunk, a usage chunk when ``stream_options.include_usage``, ``[DONE]``) or as one JSON
body, echoing the requested model. Given ``tools`` (and a ``tool_choice`` but ``"none"``) it
calls one, as an engine would: the named one or the first, its arguments' JSON in
``num_chunks`` pieces (``content`` null, ``finish_reason: "tool_calls"``).
``/v1/completions`` answers the same in its own shape (no role chunk: its first chunk is the
first content). By default it answers at once; with pacing it takes as long as a generating
engine would: ``ttft_ms`` before the first content and ``itl_ms`` between content chunks, so
a non-streamed answer comes after ``ttft_ms + (num_chunks - 1) * itl_ms``. Chunks keep that
schedule, counted from the request, however long each write takes (an engine's tokens come
from its steps, not from its writes): pausing ``itl_ms`` after each write instead let a
slower reader push a stream's end later, write by write.
``/v1/models``, ``/metrics`` (the gauges the gateway's pool-load reader scrapes) and
``/health`` answer at once; anything else is a 404.

    python -m tests.support.stand_in_engine --uds /tmp/engine.sock     # or --port 8100
    python -m tests.support.stand_in_engine --ttft-ms 50 --itl-ms 20   # ~50 tokens/s per stream
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time
from typing import TYPE_CHECKING, Any

from starlette.types import Message, Receive, Scope, Send

if TYPE_CHECKING:
    import uvicorn

MODEL = "stand-in"
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_TEXT = [(b"content-type", b"text/plain; version=0.0.4")]
_METRICS = (
    b"tollway_engine_requests_waiting 0\n"
    b"tollway_engine_kv_blocks_used 0\n"
    b"tollway_engine_kv_blocks_total 1024\n"
)


class StandInEngine:
    """The ASGI app. Every answer has ``num_chunks`` completion tokens, one word each, paced
    by ``ttft_ms`` and ``itl_ms`` (0: instant)."""

    def __init__(self, num_chunks: int = 8, ttft_ms: float = 0.0, itl_ms: float = 0.0) -> None:
        if num_chunks < 0 or ttft_ms < 0 or itl_ms < 0:
            raise ValueError(
                f"need num_chunks, ttft_ms and itl_ms >= 0; got num_chunks={num_chunks}, "
                f"ttft_ms={ttft_ms}, itl_ms={itl_ms}"
            )
        self.num_chunks = num_chunks
        self.ttft_s = ttft_ms / 1000
        self.itl_s = itl_ms / 1000

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        path, method = scope["path"], scope["method"]
        if path == "/v1/chat/completions" and method == "POST":
            request = json.loads(await _read_body(receive))
            await self._chat(request, send)
        elif path == "/v1/completions" and method == "POST":
            request = json.loads(await _read_body(receive))
            await self._completion(request, send)
        elif path == "/v1/models":
            body = {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0}]}
            await _answer(send, 200, _JSON, json.dumps(body).encode())
        elif path == "/metrics":
            await _answer(send, 200, _TEXT, _METRICS)
        elif path == "/health":
            await _answer(send, 200, _JSON, b'{"status":"ok"}')
        else:
            await _answer(send, 404, _JSON, b'{"error":{"message":"not found"}}')

    async def _chat(self, request: dict[str, Any], send: Send) -> None:
        model = str(request.get("model") or MODEL)
        prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in request["messages"])
        head = {"id": "chatcmpl-standin", "created": int(time.time()), "model": model}
        function = _called_function(request)
        finish_reason = "length" if function is None else "tool_calls"
        pieces = _argument_pieces(self.num_chunks)
        if not request.get("stream"):
            message: dict[str, Any] = {
                "role": "assistant",
                "content": " ".join(["word"] * self.num_chunks),
            }
            if function is not None:
                called = {**function, "arguments": "".join(pieces)}
                call = {"id": _CALL_ID, "type": "function", "function": called}
                message = {**message, "content": None, "tool_calls": [call]}
            choice = {"index": 0, "message": message, "finish_reason": finish_reason}
            body = {**head, "object": "chat.completion", "choices": [choice]}
            await self._answer_whole(body, prompt_tokens, send)
            return
        head["object"] = "chat.completion.chunk"
        deltas = [{"role": "assistant", "content": ""}, *[{"content": "word "}] * self.num_chunks]
        if function is not None:
            deltas = [{"role": "assistant", "content": None}, *_call_deltas(function, pieces)]
        chunks = [
            {**head, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas
        ]
        finish = {"index": 0, "delta": {}, "finish_reason": finish_reason}
        chunks.append({**head, "choices": [finish]})
        await self._stream(request, chunks, prompt_tokens, send)

    async def _completion(self, request: dict[str, Any], send: Send) -> None:
        model = str(request.get("model") or MODEL)
        prompt_tokens = len(str(request.get("prompt", "")).split())
        head = {"id": "cmpl-standin", "object": "text_completion", "created": int(time.time())}
        head["model"] = model
        if not request.get("stream"):
            text = " ".join(["word"] * self.num_chunks)
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
            await self._answer_whole({**head, "choices": [choice]}, prompt_tokens, send)
            return
        chunks = [
            {**head, "choices": [{"index": 0, "text": t, "logprobs": None, "finish_reason": f}]}
            for t, f in [*[("word ", None)] * self.num_chunks, ("", "length")]
        ]
        # A role-less first chunk: content chunk k is chunks[k - 1]; shift by an empty head.
        await self._stream(request, [{}, *chunks], prompt_tokens, send)

    def _usage(self, prompt_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": self.num_chunks,
            "total_tokens": prompt_tokens + self.num_chunks,
        }

    async def _answer_whole(self, body: dict[str, Any], prompt_tokens: int, send: Send) -> None:
        body["usage"] = self._usage(prompt_tokens)
        await _pause(self.ttft_s + max(self.num_chunks - 1, 0) * self.itl_s)
        await _answer(send, 200, _JSON, json.dumps(body).encode())

    async def _stream(
        self, request: dict[str, Any], chunks: list[dict[str, Any]], prompt_tokens: int, send: Send
    ) -> None:
        """``chunks``: a head chunk (``{}``: none is sent), ``num_chunks`` content chunks and
        the finish chunk; the usage chunk and ``[DONE]`` are added here."""
        if (request.get("stream_options") or {}).get("include_usage"):
            usage_head = {k: v for k, v in chunks[-1].items() if k != "choices"}
            chunks = [*chunks, {**usage_head, "choices": [], "usage": self._usage(prompt_tokens)}]
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        # Chunk 0 is the head (a chat role), 1..num_chunks the content: the head goes with the
        # first content. Content chunk k is due ttft + (k - 1) * itl after the request, as an
        # engine's steps come on their own clock: how long a write takes does not push the
        # next token later.
        start = time.monotonic()
        for i, chunk in enumerate(chunks):
            if i == 0:
                await _pause(self.ttft_s)
                if not chunk:
                    continue
            elif 2 <= i <= self.num_chunks:
                await _pause(start + self.ttft_s + (i - 1) * self.itl_s - time.monotonic())
            event = b"data: " + json.dumps(chunk).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


_CALL_ID = "call_standin"


def _called_function(request: dict[str, Any]) -> dict[str, Any] | None:
    """``{"name": ...}`` of the function the answer calls, or None for a text answer."""
    tools, choice = request.get("tools"), request.get("tool_choice", "auto")
    if not tools or choice == "none":
        return None
    if isinstance(choice, dict):
        return {"name": choice["function"]["name"]}
    return {"name": tools[0]["function"]["name"]}


def _argument_pieces(num_chunks: int) -> list[str]:
    """``{"text": "word word ..."}`` in ``num_chunks`` pieces, one word each."""
    pieces = ["word "] * num_chunks
    if pieces:
        pieces[0] = '{"text": "' + pieces[0]
        pieces[-1] += '"}'
    return pieces


def _call_deltas(function: dict[str, Any], pieces: list[str]) -> list[dict[str, Any]]:
    """One call's deltas: the first names it, each carries a piece of its arguments."""
    deltas: list[dict[str, Any]] = []
    for n, piece in enumerate(pieces):
        call: dict[str, Any] = {"index": 0, "function": {"arguments": piece}}
        if n == 0:
            call = {**call, "id": _CALL_ID, "type": "function"}
            call["function"] = {"name": function["name"], "arguments": piece}
        deltas.append({"tool_calls": [call]})
    return deltas


async def _pause(seconds: float) -> None:
    if seconds > 0:  # instant answers stay free of a loop round trip per chunk
        await asyncio.sleep(seconds)


async def _read_body(receive: Receive) -> bytes:
    parts = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


async def _answer(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def bench_server(app: Any) -> uvicorn.Server:
    """A uvicorn server for the benchmarks: one worker, httptools, uvloop, no access log."""
    import uvicorn

    config = uvicorn.Config(
        app,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        log_level="warning",
        access_log=False,
        backlog=4096,
    )
    return uvicorn.Server(config)


def serve(
    sockets: list[socket.socket], num_chunks: int = 8, ttft_ms: float = 0.0, itl_ms: float = 0.0
) -> None:
    """Serve on bound sockets until SIGTERM/SIGINT."""
    bench_server(StandInEngine(num_chunks, ttft_ms, itl_ms)).run(sockets=sockets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uds", help="unix socket path (default: TCP on --host/--port)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--num-chunks", type=int, default=8)
    parser.add_argument("--ttft-ms", type=float, default=0.0, help="delay to the first content")
    parser.add_argument("--itl-ms", type=float, default=0.0, help="delay between content chunks")
    args = parser.parse_args()
    if args.uds:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(args.uds)
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
    serve([sock], args.num_chunks, args.ttft_ms, args.itl_ms)


if __name__ == "__main__":
    main()
