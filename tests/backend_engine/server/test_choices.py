"""Several choices in one answer, over HTTP: ``n``, completions' prompt lists, and ``echo``.

The real engine over the tiny demo checkpoint (``test_app``'s server). Greedy answers do not
depend on what else is in the batch, so a choice can be compared with the same prompt sent
alone. Every answer and chunk is checked against OpenAI's response schema on the way.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from backend_engine.sampling_params import SamplingParams
from tests.backend_engine.server.test_app import (
    CHAT,
    COMPLETIONS,
    MAX_MODEL_LEN,
    MESSAGES,
    LiveServer,
    assert_openai_error,
    greedy,
    live_server,
    sse_events,
    wait_idle,
)
from tests.support.polling import wait_until

__all__ = ["live_server"]  # the fixture, shared with test_app

JSON = dict[str, Any]
PROMPTS = ["The cat sat on the", "Once upon a time", "Hi"]
TOKEN_PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]


def answer(server: LiveServer, path: str, body: JSON) -> JSON:
    with server.client() as client:
        response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    result: JSON = response.json()
    return result


def streamed(server: LiveServer, path: str, body: JSON) -> list[JSON]:
    """The chunks of a stream with usage, the usage chunk last."""
    request = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with server.client() as client, client.stream("POST", path, json=request) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks: list[JSON] = events[:-1]
    return chunks


def texts(choices: list[JSON]) -> list[str]:
    return [c["message"]["content"] if "message" in c else c["text"] for c in choices]


def streamed_choices(chunks: list[JSON]) -> dict[int, JSON]:
    """Each index's text and finish reason, added up as a client does; a choice's finish
    reason arrives once, on its last chunk."""
    choices: dict[int, JSON] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            state = choices.setdefault(choice["index"], {"text": "", "finish_reason": None})
            assert state["finish_reason"] is None, "a chunk after the choice's finish"
            delta = choice.get("delta", {})
            state["text"] += choice.get("text", delta.get("content") or "")
            state["finish_reason"] = choice["finish_reason"]
    return dict(sorted(choices.items()))


def without_cached(usage: JSON) -> JSON:
    """Usage but the cached tokens (which a repeated prompt changes)."""
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}


@pytest.mark.parametrize("prompts", [PROMPTS, TOKEN_PROMPTS])
def test_a_prompt_list_gives_one_indexed_choice_each(
    live_server: LiveServer, prompts: list[Any]
) -> None:
    alone = [answer(live_server, COMPLETIONS, greedy(prompt=p, max_tokens=6)) for p in prompts]
    together = answer(live_server, COMPLETIONS, greedy(prompt=prompts, max_tokens=6))
    num = len(prompts)
    assert [c["index"] for c in together["choices"]] == list(range(num))
    assert texts(together["choices"]) == [a["choices"][0]["text"] for a in alone]
    assert all(c["finish_reason"] == "length" for c in together["choices"])
    prompt_tokens = sum(a["usage"]["prompt_tokens"] for a in alone)
    assert without_cached(together["usage"]) == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 6 * num,
        "total_tokens": prompt_tokens + 6 * num,
    }
    chunks = streamed(live_server, COMPLETIONS, greedy(prompt=prompts, max_tokens=6))
    *choice_chunks, usage_chunk = chunks
    assert all(len(c["choices"]) == 1 for c in choice_chunks)
    assert streamed_choices(choice_chunks) == {
        n: {"text": text, "finish_reason": "length"}
        for n, text in enumerate(texts(together["choices"]))
    }
    assert without_cached(usage_chunk["usage"]) == without_cached(together["usage"])


@pytest.mark.parametrize("prompts", [PROMPTS, TOKEN_PROMPTS])
def test_echo_puts_each_prompt_before_its_completion(
    live_server: LiveServer, prompts: list[Any]
) -> None:
    tokenizer = live_server.engine.tokenizer
    prompt_texts = [p if isinstance(p, str) else tokenizer.decode(p, False) for p in prompts]
    plain = answer(live_server, COMPLETIONS, greedy(prompt=prompts, max_tokens=5))
    echoed = answer(live_server, COMPLETIONS, greedy(prompt=prompts, max_tokens=5, echo=True))
    assert texts(echoed["choices"]) == [
        prompt + text for prompt, text in zip(prompt_texts, texts(plain["choices"]), strict=True)
    ]
    assert without_cached(echoed["usage"]) == without_cached(plain["usage"])
    chunks = streamed(live_server, COMPLETIONS, greedy(prompt=prompts, max_tokens=5, echo=True))
    firsts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        [choice] = chunk["choices"]
        firsts.setdefault(choice["index"], choice["text"])
    assert [firsts[n].startswith(text) for n, text in enumerate(prompt_texts)] == [True] * len(
        prompts
    )
    assert [c["text"] for c in streamed_choices(chunks[:-1]).values()] == texts(echoed["choices"])


def test_echo_with_logprobs_reports_the_prompt_tokens_first(live_server: LiveServer) -> None:
    ids = [5, 6, 7, 8, 9]
    token_texts = [live_server.engine.tokenizer.decode([t], False) for t in ids]
    body = greedy(prompt=ids, max_tokens=3, logprobs=2)
    plain = answer(live_server, COMPLETIONS, body)["choices"][0]["logprobs"]
    echoed = answer(live_server, COMPLETIONS, {**body, "echo": True})["choices"][0]["logprobs"]
    assert echoed["tokens"] == token_texts + plain["tokens"]
    # The first prompt token has nothing before it; the others have their logprob, given
    # the tokens before them, and their alternatives.
    assert echoed["token_logprobs"][0] is None
    assert echoed["top_logprobs"][0] is None
    prompt_logprobs = echoed["token_logprobs"][1 : len(ids)]
    assert all(isinstance(lp, float) and lp <= 0 for lp in prompt_logprobs), prompt_logprobs
    assert all(1 <= len(top) <= 2 for top in echoed["top_logprobs"][1 : len(ids)])
    assert echoed["token_logprobs"][len(ids) :] == pytest.approx(plain["token_logprobs"], abs=1e-4)
    offsets = echoed["text_offset"]
    assert offsets[0] == 0
    assert all(
        offsets[n + 1] == offsets[n] + len(token) for n, token in enumerate(echoed["tokens"][:-1])
    )
    chunks = streamed(live_server, COMPLETIONS, {**body, "echo": True})
    first = chunks[0]["choices"][0]["logprobs"]
    assert first["tokens"][: len(ids)] == token_texts
    streamed_tokens = [t for c in chunks[:-1] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert streamed_tokens == echoed["tokens"]
    streamed_offsets = [o for c in chunks[:-1] for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert streamed_offsets == offsets


def test_n_greedy_choices_are_one_answer_each(live_server: LiveServer) -> None:
    one = answer(live_server, CHAT, greedy(messages=MESSAGES, max_tokens=5))
    three = answer(live_server, CHAT, greedy(messages=MESSAGES, max_tokens=5, n=3))
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert texts(three["choices"]) == texts(one["choices"]) * 3
    prompt_tokens = one["usage"]["prompt_tokens"]  # counted once, as OpenAI does
    assert without_cached(three["usage"]) == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 15,
        "total_tokens": prompt_tokens + 15,
    }
    chunks = streamed(live_server, CHAT, greedy(messages=MESSAGES, max_tokens=5, n=3))
    roles = [c["choices"][0] for c in chunks[:3]]
    assert [(r["index"], r["delta"]["role"]) for r in roles] == [(n, "assistant") for n in range(3)]
    assert streamed_choices(chunks[:-1]) == {
        n: {"text": text, "finish_reason": "length"}
        for n, text in enumerate(texts(one["choices"]) * 3)
    }
    assert without_cached(chunks[-1]["usage"]) == without_cached(three["usage"])


def test_n_choices_of_each_prompt_of_a_list(live_server: LiveServer) -> None:
    prompts = PROMPTS[:2]
    alone = [answer(live_server, COMPLETIONS, greedy(prompt=p, max_tokens=4)) for p in prompts]
    four = answer(live_server, COMPLETIONS, greedy(prompt=prompts, max_tokens=4, n=2))
    # Choice index = prompt index * n + the prompt's choice.
    expected = [a["choices"][0]["text"] for a in alone for _ in range(2)]
    assert texts(four["choices"]) == expected
    assert [c["index"] for c in four["choices"]] == [0, 1, 2, 3]
    assert four["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert four["usage"]["completion_tokens"] == 16
    chunks = streamed(live_server, COMPLETIONS, greedy(prompt=prompts, max_tokens=4, n=2))
    assert [c["text"] for c in streamed_choices(chunks[:-1]).values()] == expected


def test_seeded_choices_differ_and_repeat(live_server: LiveServer) -> None:
    body = greedy(prompt="Once upon a time", max_tokens=8, n=4, temperature=1.0, seed=7)
    first = texts(answer(live_server, COMPLETIONS, body)["choices"])
    assert texts(answer(live_server, COMPLETIONS, body)["choices"]) == first
    assert len(set(first)) > 1
    # Choice 0 draws from the seed itself: the n=1 answer.
    single = answer(live_server, COMPLETIONS, {**body, "n": 1})
    assert texts(single["choices"]) == first[:1]


def test_sampling_fields_reach_the_engine(
    live_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = live_server.engine
    seen: list[SamplingParams] = []
    original = engine.generate

    def spy(request_id: str, prompt: Any, params: SamplingParams, **kw: Any) -> AsyncIterator[Any]:
        seen.append(params)
        return original(request_id, prompt, params, **kw)

    monkeypatch.setattr(engine, "generate", spy)
    fields = {
        "presence_penalty": 0.5,
        "frequency_penalty": -1.5,
        "repetition_penalty": 1.2,
        "logit_bias": {"7": -100, "11": 2.5},
        "n": 2,
    }
    answer(live_server, CHAT, greedy(messages=MESSAGES, max_tokens=2, **fields))
    answer(live_server, COMPLETIONS, greedy(prompt="Hi", max_tokens=2, echo=True, logprobs=3))
    answer(live_server, COMPLETIONS, greedy(prompt="Hi", max_tokens=2, logprobs=3))
    answer(live_server, COMPLETIONS, greedy(prompt="Hi", max_tokens=2, echo=True))
    chat_params, *completion_params = seen
    assert chat_params.n == 2
    assert (chat_params.presence_penalty, chat_params.frequency_penalty) == (0.5, -1.5)
    assert chat_params.repetition_penalty == 1.2
    assert chat_params.logit_bias == {7: -100.0, 11: 2.5}
    assert chat_params.prompt_logprobs is None
    # Prompt logprobs only for echo with logprobs, as many alternatives as asked.
    assert [p.prompt_logprobs for p in completion_params] == [3, None, None]
    assert [p.logprobs for p in completion_params] == [3, 3, None]


def test_a_refused_prompt_of_a_list_starts_none(live_server: LiveServer) -> None:
    before = wait_idle(live_server)
    too_long = [7] * MAX_MODEL_LEN
    with live_server.client() as client:
        refused = client.post(COMPLETIONS, json=greedy(prompt=[[1, 2, 3], too_long], max_tokens=2))
        out_of_vocab = client.post(COMPLETIONS, json=greedy(prompt=[[1, 2], [3, 10**6]]))
        # Refused by the engine, for every prompt alike.
        biased = [
            client.post(COMPLETIONS, json=greedy(prompt=PROMPTS, logit_bias={"512": 1}, **extra))
            for extra in ({}, {"stream": True}, {"n": 3})
        ]
    error = assert_openai_error(refused, 400, "context_length_exceeded")
    assert error["param"] == "prompt[1]"
    assert assert_openai_error(out_of_vocab, 400)["param"] == "prompt[1]"
    for response in biased:
        error = assert_openai_error(response, 400)
        assert error["param"] == "logit_bias"
        assert "512" in error["message"]
    assert live_server.engine.stats().num_requests == before.num_requests


LONG_MAX_TOKENS = 1000  # seconds of work, and 4 choices of it fit the KV cache at once


def _long(**extra: Any) -> JSON:
    return greedy(prompt=["Once upon a time", "The cat"], max_tokens=LONG_MAX_TOKENS, **extra)


def test_leaving_a_stream_of_several_prompts_aborts_them_all(live_server: LiveServer) -> None:
    engine = live_server.engine
    idle = wait_idle(live_server)
    with (
        live_server.client() as client,
        client.stream("POST", COMPLETIONS, json=_long(stream=True, n=2)) as response,
    ):
        line = next(response.iter_lines())
        assert line.startswith("data: "), line
        assert engine.stats().num_running == 4, engine.stats()  # 2 prompts, 2 choices each
    wait_until(lambda: engine.stats().num_running == 0, 30, "the requests aborted")
    assert engine.stats().num_kv_blocks_used == idle.num_kv_blocks_used


def test_abort_request_stops_every_prompt_of_a_list(live_server: LiveServer) -> None:
    engine = live_server.engine
    idle = wait_idle(live_server)
    answers: dict[str, httpx.Response] = {}

    def send() -> None:
        with live_server.client() as client:
            answers["r"] = client.post(
                COMPLETIONS, json=_long(), headers={"x-request-id": "list-1"}
            )

    sender = threading.Thread(target=send)
    sender.start()
    wait_until(
        lambda: engine.stats().num_generation_tokens > idle.num_generation_tokens + 4,
        what="generation under way",
    )
    with live_server.client() as client:
        assert client.post("/abort_request", json={"request_id": "list-1"}).json() == {
            "aborted": True
        }
    sender.join(timeout=30)
    result = answers["r"].json()
    assert [c["finish_reason"] for c in result["choices"]] == ["abort", "abort"]
    assert 0 < result["usage"]["completion_tokens"] < 2 * LONG_MAX_TOKENS
    assert wait_idle(live_server).num_kv_blocks_used == idle.num_kv_blocks_used
