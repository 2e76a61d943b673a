"""``tollway plan --measure``: the per-GPU output rate of a real engine, at the stream speed.

A short load against an OpenAI-compatible ``/v1/completions`` endpoint (a Tollway engine,
local or remote): rounds of 1, 2, 4, ... concurrent streaming requests, each with a prompt of
about ``prompt_tokens`` tokens and exactly ``output_tokens`` output tokens (``ignore_eos``).
A stream's speed is its decode rate, from its first token to its last; a round's rate is every
output token over the round's wall time. The result is the fastest round in which every stream
still got the per-stream target, as the article says: "measure it with your model, prompts
and server". Rounds stop at the first one that misses the target, or at ``max_concurrency``.

One request first warms the engine up and is not counted (a CPU engine builds its kernels on
first use). Each stream's prompt starts with its own number, so no two share a cached prefix.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from capacity_planner.plan_inputs import GpuThroughput

UNIX_PREFIX = "unix:"


class MeasurementError(RuntimeError):
    """The engine could not be measured (unreachable, refused the load); says which."""


@dataclass(frozen=True)
class LoadSpec:
    base_url: str  # the engine's: http://127.0.0.1:8001, or unix:/path/to/engine.sock
    prompt_tokens: int
    output_tokens: int
    stream_tokens_per_s: float  # the per-stream target
    max_concurrency: int = 64
    model: str | None = None  # None: the first of GET /v1/models
    api_key: str | None = None
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 2:
            raise ValueError("a measured request needs a prompt and at least 2 output tokens")
        if self.max_concurrency < 1:
            raise ValueError(
                f"--measure-max-concurrency must be at least 1, got {self.max_concurrency}"
            )


@dataclass(frozen=True)
class StreamTiming:
    completion_tokens: int
    first_token_s: float  # since the request was sent
    last_token_s: float

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: tokens after the first over the time they took."""
        elapsed = self.last_token_s - self.first_token_s
        return (self.completion_tokens - 1) / elapsed if elapsed > 0 else float("inf")


@dataclass(frozen=True)
class LoadRound:
    concurrency: int
    streams: tuple[StreamTiming, ...]
    wall_s: float

    @property
    def output_tokens_per_s(self) -> float:
        return sum(s.completion_tokens for s in self.streams) / self.wall_s

    @property
    def slowest_stream_tokens_per_s(self) -> float:
        return min(s.tokens_per_s for s in self.streams)

    def meets(self, stream_tokens_per_s: float) -> bool:
        return self.slowest_stream_tokens_per_s >= stream_tokens_per_s


@dataclass(frozen=True)
class Measurement:
    model: str
    rounds: tuple[LoadRound, ...]
    stream_tokens_per_s: float  # the target the rounds were judged by

    @property
    def best(self) -> LoadRound | None:
        passing = [r for r in self.rounds if r.meets(self.stream_tokens_per_s)]
        return max(passing, key=lambda r: r.output_tokens_per_s, default=None)

    def gpu_throughput(self, num_gpus: int = 1) -> GpuThroughput:
        """The best round's rate per GPU of an engine on ``num_gpus`` GPUs."""
        best = self.best
        if best is None:
            first = self.rounds[0]
            raise MeasurementError(
                f"no stream of {self.model} reached {self.stream_tokens_per_s:g} tokens/s, not "
                f"even alone: the slowest got {first.slowest_stream_tokens_per_s:,.1f} tokens/s"
            )
        return GpuThroughput(
            output_tokens_per_s=best.output_tokens_per_s / num_gpus,
            stream_tokens_per_s=best.output_tokens_per_s / best.concurrency,
            source="measured",
        )


async def measure_engine(spec: LoadSpec) -> Measurement:
    headers = {"authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    timeout = httpx.Timeout(spec.timeout_s, connect=10.0)
    base_url, transport = spec.base_url, None
    if base_url.startswith(UNIX_PREFIX):  # as the gateway's upstreams name a local engine
        transport = httpx.AsyncHTTPTransport(uds=base_url.removeprefix(UNIX_PREFIX))
        base_url = "http://engine"
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=timeout, transport=transport
    ) as client:
        model = spec.model or await _first_model(client)
        await _stream(client, spec, model, 0)  # warms the engine up (kernels built on first use)
        rounds: list[LoadRound] = []
        concurrency, num_sent = 1, 1
        while concurrency <= spec.max_concurrency:
            started = time.monotonic()
            streams = await asyncio.gather(
                *(_stream(client, spec, model, num_sent + i) for i in range(concurrency))
            )
            rounds.append(LoadRound(concurrency, tuple(streams), time.monotonic() - started))
            num_sent += concurrency
            if not rounds[-1].meets(spec.stream_tokens_per_s):
                break
            concurrency *= 2
    return Measurement(model, tuple(rounds), spec.stream_tokens_per_s)


async def _first_model(client: httpx.AsyncClient) -> str:
    try:
        response = await client.get("/v1/models")
    except httpx.HTTPError as exc:
        raise MeasurementError(f"cannot reach {client.base_url}: {exc!r}") from None
    if response.status_code != 200:
        raise MeasurementError(f"GET {response.url} answered {response.status_code}")
    models = response.json().get("data") or []
    if not models:
        raise MeasurementError(f"{client.base_url} serves no model")
    return str(models[0]["id"])


async def _stream(
    client: httpx.AsyncClient, spec: LoadSpec, model: str, number: int
) -> StreamTiming:
    body: dict[str, Any] = {
        "model": model,
        "prompt": f"{number}:" + " the" * max(0, spec.prompt_tokens - 2),
        "max_tokens": spec.output_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.monotonic()
    first = last = None
    completion_tokens = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                raise MeasurementError(
                    f"{model} refused a measured request ({response.status_code}): {detail}"
                )
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: ") :])
                if chunk.get("choices"):
                    last = time.monotonic() - sent
                    first = last if first is None else first
                if chunk.get("usage"):
                    completion_tokens = int(chunk["usage"]["completion_tokens"])
    except httpx.HTTPError as exc:
        raise MeasurementError(f"measuring {client.base_url} failed: {exc!r}") from None
    if first is None or last is None or completion_tokens < 1:
        raise MeasurementError(f"{model} streamed no tokens (or no usage) for a measured request")
    return StreamTiming(completion_tokens, first, last)
