"""The stream relay measures exactly what it relays, and strips the usage chunk on request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from gateway.errors import usage_records_unavailable
from gateway.storage.models import UsageStatus
from gateway.upstream.drain_deadline import DrainDeadline
from gateway.upstream.pool import UpstreamCall
from gateway.upstream.stream_relay import UsageMeter, measure_body, relay_events


def chunk(content: str | None = None, usage: dict[str, object] | None = None) -> str:
    choices = [] if content is None else [{"index": 0, "delta": {"content": content}}]
    return json.dumps({"object": "chat.completion.chunk", "choices": choices, "usage": usage})


USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}


def call_with(
    payloads: list[str], *, fail_after: int | None = None, batch_size: int = 1
) -> UpstreamCall:
    """An upstream whose events arrive ``batch_size`` at a time (one read each)."""

    async def events() -> AsyncIterator[list[str]]:
        for n in range(0, len(payloads), batch_size):
            if fail_after is not None and n >= fail_after:
                raise httpx.ReadError("engine went away")
            yield payloads[n : n + batch_size]

    response = httpx.Response(200, request=httpx.Request("POST", "http://engine"))
    return UpstreamCall(response, "http://engine", events=events())


async def collect(events: AsyncIterator[str]) -> list[str]:
    return [e async for e in events]


def split_events(sent: list[str]) -> list[str]:
    """What the client received, event by event."""
    return [f"{e}\n\n" for e in "".join(sent).split("\n\n") if e]


@pytest.mark.parametrize("include_usage", [True, False])
async def test_usage_comes_from_the_final_chunk(include_usage: bool) -> None:
    payloads = [chunk("a"), chunk("b"), chunk("c"), chunk(usage=USAGE), "[DONE]"]
    meter = UsageMeter()
    out = await collect(relay_events(call_with(payloads), meter, include_usage=include_usage))
    assert meter.status is UsageStatus.COMPLETED
    assert meter.usage == USAGE
    assert meter.tokens(counted_prompt_tokens=99) == (7, 2, 3)
    assert len(out) == (5 if include_usage else 4)
    assert out[-1] == "data: [DONE]\n\n"
    assert ('"usage"' in "".join(out)) is include_usage


async def test_a_client_that_leaves_is_charged_for_the_chunks_relayed() -> None:
    payloads = [chunk(str(n)) for n in range(10)] + [chunk(usage=USAGE), "[DONE]"]
    meter = UsageMeter()
    events = relay_events(call_with(payloads), meter, include_usage=False)
    for _ in range(4):
        await events.__anext__()
    await events.aclose()
    assert not meter.is_finished
    assert meter.num_relayed_tokens == 4
    assert meter.tokens(counted_prompt_tokens=11) == (11, 0, 4)


async def test_an_engine_failure_mid_stream_ends_with_an_error_event() -> None:
    meter = UsageMeter()
    payloads = [chunk("a"), chunk("b"), chunk("c")]
    out = await collect(relay_events(call_with(payloads, fail_after=2), meter, include_usage=True))
    assert meter.status is UsageStatus.UPSTREAM_ERROR
    assert meter.num_relayed_tokens == 2
    received = split_events(out)
    assert json.loads(received[-2].removeprefix("data: "))["error"]["code"] == "upstream_error"
    assert received[-1] == "data: [DONE]\n\n"
    assert len(received) == 4


async def test_events_that_arrive_together_are_sent_together() -> None:
    payloads = [chunk("a"), chunk("b"), chunk("c"), chunk(usage=USAGE), "[DONE]"]
    meter = UsageMeter()
    out = await collect(relay_events(call_with(payloads, batch_size=3), meter, include_usage=False))
    assert len(out) == 2  # one send per upstream read
    received = split_events(out)
    assert [json.loads(e.removeprefix("data: ")) for e in received[:3]] == [
        {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": c}}]}
        for c in "abc"
    ]
    assert received[3:] == ["data: [DONE]\n\n"]  # the usage-only chunk was dropped
    assert meter.status is UsageStatus.COMPLETED
    assert meter.num_relayed_tokens == 3
    assert meter.usage == USAGE


async def test_an_error_event_inside_a_batch_ends_the_stream_after_what_came_before() -> None:
    error = json.dumps({"error": {"message": "engine failed", "code": "internal"}})
    payloads = [chunk("a"), chunk("b"), error, chunk("never")]
    meter = UsageMeter()
    out = await collect(relay_events(call_with(payloads, batch_size=4), meter, include_usage=True))
    received = split_events(out)
    assert [json.loads(e.removeprefix("data: ")).get("choices") for e in received[:2]] == [
        [{"index": 0, "delta": {"content": c}}] for c in "ab"
    ]
    assert json.loads(received[2].removeprefix("data: "))["error"]["code"] == "upstream_error"
    assert received[3:] == ["data: [DONE]\n\n"]
    assert meter.status is UsageStatus.UPSTREAM_ERROR
    assert meter.num_relayed_tokens == 2


async def test_chunks_without_a_usage_value_lose_the_key_and_nothing_else() -> None:
    compact = (",", ":")
    engine_style = [
        json.dumps({"choices": [{"delta": {"content": "a"}}], "usage": None}, separators=compact),
        json.dumps({"choices": [{"delta": {"content": "b"}}], "usage": None}),  # other spacing
        json.dumps({"choices": [{"delta": {"content": "c"}}]}),
        chunk(usage=USAGE),
        "[DONE]",
    ]
    meter = UsageMeter()
    out = await collect(relay_events(call_with(engine_style), meter, include_usage=False))
    chunks = [json.loads(e.removeprefix("data: ")) for e in out[:-1]]
    assert chunks == [{"choices": [{"delta": {"content": c}}]} for c in "abc"]
    assert out[0] == 'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    assert meter.usage == USAGE
    assert meter.num_relayed_tokens == 3


@pytest.mark.parametrize("fail_after", [None, 2])
async def test_before_end_runs_once_the_meter_is_final_and_before_done_is_sent(
    fail_after: int | None,
) -> None:
    """The request path writes the usage record there: before the client has [DONE]."""
    payloads = [chunk("a"), chunk("b"), chunk(usage=USAGE), "[DONE]"]
    meter = UsageMeter()
    sent: list[str] = []
    seen_at_end: list[tuple[UsageStatus, int, bool]] = []

    async def before_end() -> None:
        is_done_sent = "[DONE]" in "".join(sent)
        seen_at_end.append((meter.status, meter.num_relayed_tokens, is_done_sent))

    call = call_with(payloads, fail_after=fail_after)
    async for batch in relay_events(call, meter, include_usage=True, before_end=before_end):
        sent.append(batch)
    status = UsageStatus.COMPLETED if fail_after is None else UsageStatus.UPSTREAM_ERROR
    assert seen_at_end == [(status, 2, False)]
    assert sent[-1].endswith("data: [DONE]\n\n")


@pytest.mark.parametrize("fail_after", [None, 2])
async def test_a_record_not_accepted_sends_its_503_error_event_before_done(
    fail_after: int | None,
) -> None:
    """No answer ends without its record: the client sees the refusal, not a clean end."""
    payloads = [chunk("a"), chunk("b"), chunk(usage=USAGE), "[DONE]"]

    async def before_end() -> None:
        raise usage_records_unavailable()

    relay = relay_events(
        call_with(payloads, fail_after=fail_after),
        UsageMeter(),
        include_usage=True,
        before_end=before_end,
    )
    received = split_events(await collect(relay))
    error = json.loads(received[-2].removeprefix("data: "))["error"]
    assert (error["code"], error["type"]) == ("usage_records_unavailable", "server_error")
    assert received[-1] == "data: [DONE]\n\n"


async def test_before_end_does_not_run_for_a_client_that_leaves() -> None:
    called: list[None] = []
    payloads = [chunk("a"), chunk("b"), chunk(usage=USAGE), "[DONE]"]

    async def before_end() -> None:
        called.append(None)

    events = relay_events(
        call_with(payloads), UsageMeter(), include_usage=True, before_end=before_end
    )
    await events.__anext__()
    await events.aclose()
    assert called == []


@pytest.mark.parametrize("include_usage", [True, False])
async def test_every_chunk_carries_the_clients_model_name(include_usage: bool) -> None:
    """An engine that knows the model by another id (``upstream_model``, a rollout's
    version): the client sees its own name in every chunk, and the usage as it asked."""

    def named(payload: str) -> str:
        return json.dumps({**json.loads(payload), "model": "meta-llama/Llama-3.1-8B"})

    payloads = [named(chunk("a")), named(chunk("b")), named(chunk(usage=USAGE)), "[DONE]"]
    meter = UsageMeter()
    out = await collect(
        relay_events(call_with(payloads), meter, include_usage=include_usage, model_name="large")
    )
    sent = [json.loads(e[len("data: ") :]) for e in split_events(out) if "[DONE]" not in e]
    assert [c["model"] for c in sent] == ["large"] * len(sent)
    assert len(sent) == (3 if include_usage else 2)
    assert all(("usage" in c) == include_usage for c in sent)
    assert meter.usage == USAGE
    assert meter.num_relayed_tokens == 2


def tool_call_chunk(n: int) -> str:
    """The ``n``-th delta of a tool call: ``content`` null, a piece of the arguments."""
    call: dict[str, object] = {"index": 0, "function": {"arguments": f"piece{n}"}}
    if n == 0:
        call = {**call, "id": "call_1", "type": "function"}
        call["function"] = {"name": "get_weather", "arguments": "piece0"}
    delta = {"content": None, "tool_calls": [call]}
    return json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})


FINISH_TOOL_CALLS = json.dumps(
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}], "usage": None}
)


async def test_a_tool_call_is_measured_as_content_is() -> None:
    role = json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]})
    payloads = [role, *(tool_call_chunk(n) for n in range(4)), FINISH_TOOL_CALLS]
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0
        return now[0]

    first_token_after: list[float] = []
    meter = UsageMeter(clock=clock, started_at=0.0, on_first_token=first_token_after.append)
    out = await collect(relay_events(call_with([*payloads, "[DONE]"]), meter, include_usage=False))
    assert meter.status is UsageStatus.COMPLETED
    assert meter.finish_reason == "tool_calls"
    assert meter.num_relayed_tokens == 4  # one per delta with a piece of the call
    assert first_token_after == [1.0]  # the call's first delta, not the role chunk
    assert meter.ttft_ms == 1000
    received = [json.loads(e.removeprefix("data: ")) for e in split_events(out)[:-1]]
    assert received[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert [c["choices"][0]["delta"] for c in received[1:5]] == [
        json.loads(tool_call_chunk(n))["choices"][0]["delta"] for n in range(4)
    ]


def test_a_whole_answer_that_calls_a_tool_has_its_first_token() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    body = {"choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}]}
    meter = UsageMeter()
    measure_body({**body, "usage": USAGE}, meter)
    assert meter.first_token_at is not None
    assert meter.finish_reason == "tool_calls"
    assert meter.tokens(counted_prompt_tokens=99) == (7, 2, 3)


def finish_chunk(reason: object) -> str:
    return json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]})


@pytest.mark.parametrize("reason", ["stop", "length", "tool_calls", "content_filter", "abort"])
async def test_the_meter_keeps_the_finish_reason_the_engine_sent(reason: str) -> None:
    """The finish chunk's reason, not erased by the usage chunk after it."""
    payloads = [chunk("a"), chunk("b"), finish_chunk(reason), chunk(usage=USAGE), "[DONE]"]
    meter = UsageMeter()
    await collect(relay_events(call_with(payloads), meter, include_usage=False))
    assert meter.finish_reason == reason
    assert meter.num_relayed_tokens == 2


async def test_a_stream_left_before_its_finish_chunk_has_no_finish_reason() -> None:
    payloads = [chunk("a"), chunk("b"), finish_chunk("length"), chunk(usage=USAGE), "[DONE]"]
    meter = UsageMeter()
    events = relay_events(call_with(payloads), meter, include_usage=False)
    for _ in range(2):
        await events.__anext__()
    await events.aclose()
    assert meter.finish_reason is None


async def test_an_engine_failure_before_the_finish_chunk_has_no_finish_reason() -> None:
    meter = UsageMeter()
    payloads = [chunk("a"), chunk("b"), finish_chunk("stop")]
    await collect(relay_events(call_with(payloads, fail_after=2), meter, include_usage=True))
    assert meter.status is UsageStatus.UPSTREAM_ERROR
    assert meter.finish_reason is None


@pytest.mark.parametrize(
    ("reason", "kept"),
    [
        ("r" * 32, "r" * 32),
        ("r" * 33, None),  # not cut short: a truncated reason is one nobody sent
        ("", None),
        ("stop\x00", None),  # PostgreSQL's text refuses NUL: the record would be lost
        ("stop\n", None),
        ("arrêt", None),
        (7, None),
        (["stop"], None),
    ],
)
def test_a_finish_reason_the_record_cannot_keep_as_sent_is_none(
    reason: object, kept: str | None
) -> None:
    body = {"choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": reason}]}
    meter = UsageMeter()
    measure_body(body, meter)
    assert meter.finish_reason == kept
    assert meter.num_relayed_tokens == 1


def choice_chunk(index: int, content: str) -> str:
    delta = {"index": index, "delta": {"content": content}, "finish_reason": None}
    return json.dumps({"object": "chat.completion.chunk", "choices": [delta], "usage": None})


async def test_the_choices_chunks_are_summed_when_the_stream_stops_early() -> None:
    """n=3: the choices' chunks interleave; a client that leaves is charged every choice's."""
    payloads = [choice_chunk(i, f"t{step}") for step in range(4) for i in range(3)]
    meter = UsageMeter(max_completion_tokens=3 * 16)
    events = relay_events(
        call_with([*payloads, "[DONE]"], batch_size=3), meter, include_usage=False
    )
    for _ in range(2):  # two steps of three choices each
        await events.__anext__()
    await events.aclose()
    assert meter.num_relayed_tokens == 6
    assert meter.tokens(counted_prompt_tokens=5) == (5, 0, 6)
    whole = UsageMeter()
    measure_body({"choices": [{"index": i, "message": {"content": "x"}} for i in range(4)]}, whole)
    assert whole.num_relayed_tokens == 4  # a whole answer without usage: one per choice


def completion_chunk(index: int, text: str, logprobs: list[float | None]) -> str:
    entries = {
        "tokens": ["t"] * len(logprobs),
        "token_logprobs": logprobs,
        "top_logprobs": [None] * len(logprobs),
        "text_offset": list(range(len(logprobs))),
    }
    choice = {"index": index, "text": text, "logprobs": entries, "finish_reason": None}
    return json.dumps({"object": "text_completion", "choices": [choice]})


async def test_an_echoed_prompt_is_not_counted_as_completion_tokens() -> None:
    """echo with logprobs: each choice's first chunk holds its prompt's 5 tokens (the first
    with a null logprob) and its first generated token: one token, not six."""
    echoed = [None, -1.0, -2.0, -0.5, -0.1, -0.3]
    payloads = [completion_chunk(i, "prompt t", echoed) for i in range(2)]
    payloads += [completion_chunk(i, " u", [-0.2]) for i in range(2)]
    meter = UsageMeter()
    await collect(relay_events(call_with([*payloads, "[DONE]"]), meter, include_usage=False))
    assert meter.num_relayed_tokens == 4


async def test_a_fallback_count_never_exceeds_what_the_choices_could_generate() -> None:
    payloads = [chunk(str(n)) for n in range(10)]
    meter = UsageMeter(max_completion_tokens=6)
    await collect(relay_events(call_with(payloads, fail_after=10), meter, include_usage=False))
    assert meter.num_relayed_tokens == 10
    assert meter.tokens(counted_prompt_tokens=3) == (3, 0, 6)  # what the reservation holds
    meter.observe_usage({"prompt_tokens": 3, "completion_tokens": 9})
    assert meter.tokens(counted_prompt_tokens=3) == (3, 0, 9)  # the engine's word is final


async def test_the_drain_s_deadline_ends_a_stream_with_an_error_event_and_done() -> None:
    """A stopping gateway's deadline, reached while the stream waits on its engine: the
    client gets a ``server_shutting_down`` error event and ``[DONE]``; the meter, finished as
    cancelled, holds what was relayed, and the request's record (``before_end``) comes first."""
    deadline = DrainDeadline()
    engine_waits = asyncio.Event()

    async def events() -> AsyncIterator[list[str]]:
        yield [chunk("a"), chunk("b")]
        engine_waits.set()
        await asyncio.sleep(60)  # the engine is slow: nothing more before the deadline
        yield [chunk("c")]

    response = httpx.Response(200, request=httpx.Request("POST", "http://engine"))
    call = UpstreamCall(response, "http://engine", events=events())
    meter = UsageMeter()
    finished_at_record: list[bool] = []

    async def record() -> None:
        finished_at_record.append(meter.is_finished)

    relay = relay_events(call, meter, include_usage=False, before_end=record, deadline=deadline)
    sent = asyncio.ensure_future(collect(relay))
    await asyncio.wait_for(engine_waits.wait(), 5)
    deadline.reach()
    received = split_events(await asyncio.wait_for(sent, 5))
    assert len(received) == 4
    error = json.loads(received[-2].removeprefix("data: "))["error"]
    assert (error["code"], error["type"]) == ("server_shutting_down", "server_error")
    assert received[-1] == "data: [DONE]\n\n"
    assert meter.status is UsageStatus.CANCELLED
    assert meter.num_relayed_tokens == 2
    assert finished_at_record == [True]
