"""Text completions of several choices: streamed chunks add up to the whole answer, choice by
choice, with ``echo`` and the legacy logprobs (the prompt's tokens first, the first null)."""

from __future__ import annotations

import pytest

from backend_engine.outputs import RequestOutputDelta, TokenLogprob
from backend_engine.sampling_params import SamplingParams
from backend_engine.server.choice_streams import ChoiceDelta
from backend_engine.server.completion_format import CompletionFormatter
from backend_engine.server.engine_prompts import EnginePrompt
from backend_engine.server.openai_format import JSON, ResponseIdentity
from backend_engine.server.token_text import TokenText
from tests.backend_engine.server.response_schema import check_answer
from tests.support.byte_level_tokenizer import byte_level_tokenizer

IDENT = ResponseIdentity("cmpl-1", 0, "m", "fp_0123456789")
USAGE = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
PROMPT_TEXTS = ["Hi", "Yo!"]
ANSWERS = {0: ["ab", "c"], 1: ["d", "ef"], 2: ["g", "hi"], 3: ["", "jk"]}  # by choice index
N = 2  # choices per prompt


@pytest.fixture(scope="module")
def token_text() -> TokenText:
    return TokenText(byte_level_tokenizer())


def ids(text: str) -> list[int]:
    return byte_level_tokenizer().encode(text, add_special_tokens=False)


def prompts() -> list[EnginePrompt]:
    return [EnginePrompt(ids(text), SamplingParams(n=N), text) for text in PROMPT_TEXTS]


def prompt_logprobs(text: str) -> list[TokenLogprob | None]:
    return [None] + [TokenLogprob(t, -1.5, ((t, -1.5),)) for t in ids(text)[1:]]


def interleaved() -> list[ChoiceDelta]:
    """Each choice's deltas, the choices taking turns (as the engine's steps mix them); a
    choice's first delta carries its prompt's logprobs."""
    out = []
    for step in range(2):
        for index, pieces in ANSWERS.items():
            prompt_index = index // N
            piece = pieces[step]
            delta = RequestOutputDelta(
                f"r{prompt_index}",
                ids(piece),
                piece,
                len(ids(PROMPT_TEXTS[prompt_index])),
                step + 1,
                0,
                [TokenLogprob(t, -0.5, ((t, -0.5),)) for t in ids(piece)],
                finished=step == 1,
                finish_reason="length" if step == 1 else None,
                index=index % N,
                prompt_logprobs=prompt_logprobs(PROMPT_TEXTS[prompt_index]) if step == 0 else None,
            )
            out.append(ChoiceDelta(prompt_index, index, delta))
    return out


def streamed_choices(chunks: list[JSON]) -> dict[int, JSON]:
    """The chunks added up per index, in the shape of a whole answer's choices."""
    choices: dict[int, JSON] = {}
    for chunk in chunks:
        check_answer(chunk, is_chunk=True)
        [choice] = chunk["choices"]
        state = choices.setdefault(choice["index"], {"index": choice["index"], "text": ""})
        state["text"] += choice["text"]
        state["finish_reason"] = choice["finish_reason"]
        if choice["logprobs"] is not None:
            logprobs = state.setdefault("logprobs", {})
            for key, values in choice["logprobs"].items():
                logprobs.setdefault(key, []).extend(values)
        else:
            state.setdefault("logprobs", None)
    return dict(sorted(choices.items()))


@pytest.mark.parametrize("echo", [False, True])
@pytest.mark.parametrize("want_logprobs", [False, True])
def test_streamed_choices_add_up_to_the_whole_answer(
    token_text: TokenText, echo: bool, want_logprobs: bool
) -> None:
    whole = CompletionFormatter(IDENT, token_text, want_logprobs, prompts(), echo=echo).whole(
        interleaved(), USAGE
    )
    check_answer(whole)
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    expected_texts = [
        (PROMPT_TEXTS[index // N] if echo else "") + "".join(pieces)
        for index, pieces in ANSWERS.items()
    ]
    assert [c["text"] for c in whole["choices"]] == expected_texts
    stream = CompletionFormatter(IDENT, token_text, want_logprobs, prompts(), echo=echo)
    chunks = [chunk for choice in interleaved() for chunk in stream.chunks(choice)]
    assert list(streamed_choices(chunks).values()) == whole["choices"]


def test_echoed_logprobs_start_with_the_prompts_tokens(token_text: TokenText) -> None:
    formatter = CompletionFormatter(IDENT, token_text, True, prompts(), echo=True)
    choices = formatter.whole(interleaved(), USAGE)["choices"]
    for choice in choices:
        prompt = PROMPT_TEXTS[choice["index"] // N]
        answer = "".join(ANSWERS[choice["index"]])
        logprobs = choice["logprobs"]
        assert "".join(logprobs["tokens"]) == prompt + answer
        assert logprobs["token_logprobs"] == [None] + [-1.5] * (len(prompt) - 1) + [-0.5] * len(
            answer
        )
        assert logprobs["top_logprobs"][0] is None
        assert logprobs["top_logprobs"][1] == {prompt[1]: -1.5}
        # Each choice's offsets count its own text from 0, prompt first.
        assert logprobs["text_offset"] == list(range(len(prompt + answer)))


def test_a_choice_without_its_prompt_logprobs_takes_its_prompts(token_text: TokenText) -> None:
    """Choices of one prompt share its logprobs: a choice whose first delta lacks them (it
    came before) reports those of its prompt's other choice."""
    deltas = [c for c in interleaved() if not (c.index == 1 and c.delta.prompt_logprobs)]
    bare = RequestOutputDelta("r0", ids("d"), "d", 2, 1, 0, [TokenLogprob(ids("d")[0], -0.5)])
    deltas.insert(1, ChoiceDelta(0, 1, bare))
    formatter = CompletionFormatter(IDENT, token_text, True, prompts(), echo=True)
    choices = formatter.whole(deltas, USAGE)["choices"]
    assert choices[1]["logprobs"]["token_logprobs"][:2] == [None, -1.5]
