"""An OpenAI-compatible stand-in engine for gateway benchmarks: a bare ASGI app, no model.

``/v1/chat/completions`` answers streamed (a role chunk, ``num_chunks`` content chunks, a
finish chunk, a usage chunk when ``stream_options.include_usage``, ``[DONE]``) or as one JSON
body, echoing the requested model, with ``n`` choices (each chunk names its choice's
``index``; the choices' chunks of one step go out together), ``refusal: null`` and a
``system_fingerprint``, as OpenAI's. Given ``tools`` (and a ``tool_choice`` but ``"none"``)
it calls one, as an engine would: the named one or the first, its arguments' JSON in
``num_chunks`` pieces (``content`` null, ``finish_reason: "tool_calls"``).
``/v1/completions`` answers the same in its own shape (no role chunk: its first chunk is the
first content), one choice per prompt of a list times ``n``, with ``echo`` the prompt first.
Usage counts each prompt once (a word, or a token id, is a token) and ``num_chunks``
completion tokens for every choice.
By default it answers at once; with pacing it takes as long as a generating engine would:
``ttft_ms`` before the first content and ``itl_ms`` between content chunks, so
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
SYSTEM_FINGERPRINT = "fp_stand_in"
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
        num_choices = int(request.get("n") or 1)
        head = _head("chatcmpl-standin", model)
        function = _called_function(request)
        finish_reason = "length" if function is None else "tool_calls"
        pieces = _argument_pieces(self.num_chunks)
        if not request.get("stream"):
            message: dict[str, Any] = {
                "role": "assistant",
                "content": " ".join(["word"] * self.num_chunks),
                "refusal": None,
            }
            if function is not None:
                called = {**function, "arguments": "".join(pieces)}
                call = {"id": _CALL_ID, "type": "function", "function": called}
                message = {**message, "content": None, "tool_calls": [call]}
            choices = [
                {"index": i, "message": message, "logprobs": None, "finish_reason": finish_reason}
                for i in range(num_choices)
            ]
            body = {**head, "object": "chat.completion", "choices": choices}
            await self._answer_whole(body, prompt_tokens, num_choices, send)
            return
        head["object"] = "chat.completion.chunk"
        role = {"role": "assistant", "content": "", "refusal": None}
        deltas = [role, *[{"content": "word "}] * self.num_chunks]
        if function is not None:
            deltas = [{**role, "content": None}, *_call_deltas(function, pieces)]
        finish = {"delta": {}, "logprobs": None, "finish_reason": finish_reason}
        steps = [
            [
                {
                    **head,
                    "choices": [{"index": i, "delta": d, "logprobs": None, "finish_reason": None}],
                }
                for i in range(num_choices)
            ]
            for d in deltas
        ]
        steps.append([{**head, "choices": [{"index": i, **finish}]} for i in range(num_choices)])
        await self._stream(request, steps, prompt_tokens, num_choices, send)

    async def _completion(self, request: dict[str, Any], send: Send) -> None:
        """One choice per prompt of a list, times ``n`` (choice ``i * n + j`` is prompt ``i``'s
        ``j``-th); with ``echo`` a choice's text starts with its prompt's (streamed: in a chunk
        of its own, before the completion's first)."""
        model = str(request.get("model") or MODEL)
        prompts = _prompts(request.get("prompt", ""))
        prompt_tokens = sum(num_tokens for _, num_tokens in prompts)
        n = int(request.get("n") or 1)
        echoed = [text if request.get("echo") else "" for text, _ in prompts for _ in range(n)]
        num_choices = len(echoed)
        head = {**_head("cmpl-standin", model), "object": "text_completion"}

        def choice(i: int, text: str, finish_reason: str | None) -> dict[str, Any]:
            return {"index": i, "text": text, "logprobs": None, "finish_reason": finish_reason}

        if not request.get("stream"):
            words = " ".join(["word"] * self.num_chunks)
            choices = [choice(i, e + words, "length") for i, e in enumerate(echoed)]
            await self._answer_whole({**head, "choices": choices}, prompt_tokens, num_choices, send)
            return
        # A role-less first step: the echoed prompts, when asked for; else nothing.
        steps = [[{**head, "choices": [choice(i, e, None)]} for i, e in enumerate(echoed) if e]]
        for text, reason in [*[("word ", None)] * self.num_chunks, ("", "length")]:
            steps.append(
                [{**head, "choices": [choice(i, text, reason)]} for i in range(num_choices)]
            )
        await self._stream(request, steps, prompt_tokens, num_choices, send)

    def _usage(self, prompt_tokens: int, num_choices: int) -> dict[str, int]:
        """As OpenAI counts: each prompt once, every choice's completion tokens."""
        completion_tokens = self.num_chunks * num_choices
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    async def _answer_whole(
        self, body: dict[str, Any], prompt_tokens: int, num_choices: int, send: Send
    ) -> None:
        body["usage"] = self._usage(prompt_tokens, num_choices)
        await _pause(self.ttft_s + max(self.num_chunks - 1, 0) * self.itl_s)
        await _answer(send, 200, _JSON, json.dumps(body).encode())

    async def _stream(
        self,
        request: dict[str, Any],
        steps: list[list[dict[str, Any]]],
        prompt_tokens: int,
        num_choices: int,
        send: Send,
    ) -> None:
        """``steps``: each step's chunks (one per choice, as an engine's step makes a token
        for each): a head step (a chat's roles, a completion's echoes; ``[]``: none is sent),
        ``num_chunks`` content steps and the finish step; the usage chunk and ``[DONE]`` are
        added here."""
        if (request.get("stream_options") or {}).get("include_usage"):
            last = steps[-1][-1]
            usage_head = {k: v for k, v in last.items() if k != "choices"}
            usage = self._usage(prompt_tokens, num_choices)
            steps = [*steps, [{**usage_head, "choices": [], "usage": usage}]]
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        # Step 0 is the head, 1..num_chunks the content: the head goes with the first content.
        # Content step k is due ttft + (k - 1) * itl after the request, as an engine's steps
        # come on their own clock: how long a write takes does not push the next token later.
        start = time.monotonic()
        for i, step in enumerate(steps):
            if i == 0:
                await _pause(self.ttft_s)
            elif 2 <= i <= self.num_chunks:
                await _pause(start + self.ttft_s + (i - 1) * self.itl_s - time.monotonic())
            if not step:
                continue
            events = b"".join(b"data: " + json.dumps(chunk).encode() + b"\n\n" for chunk in step)
            await send({"type": "http.response.body", "body": events, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def _head(request_id: str, model: str) -> dict[str, Any]:
    return {
        "id": request_id,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }


def _prompts(prompt: Any) -> list[tuple[str, int]]:
    """Each prompt of a completion request and its tokens (one per word; a token id is one,
    echoed as its digits)."""
    if isinstance(prompt, str):
        return [(prompt, len(prompt.split()))]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [(" ".join(map(str, prompt)), len(prompt))]
    return [p for item in prompt for p in _prompts(item)]


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
