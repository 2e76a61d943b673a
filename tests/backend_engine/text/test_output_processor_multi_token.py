"""The output processor given several new tokens in one step (speculative decoding's kept
drafts): the same text, stop and logprobs as one token a step, and a stop string inside the
run drops the tokens after it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from backend_engine.core.request import Request, RequestStatus
from backend_engine.outputs import RequestOutputDelta, TokenLogprob
from backend_engine.sampling_params import SamplingParams
from backend_engine.text.output_processor import OutputProcessor
from model_files.tokenizer import Tokenizer

TEXT = " the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def tokenizer(demo_model_files: Callable[..., Path]) -> Tokenizer:
    return Tokenizer.from_pretrained(demo_model_files())


def logprob(token_id: int) -> TokenLogprob:
    return TokenLogprob(token_id, -0.5 - token_id / 1000, ((token_id, -0.5),))


def run(
    tokenizer: Tokenizer, params: SamplingParams, steps: list[list[int]]
) -> tuple[Request, list[RequestOutputDelta], list[bool]]:
    """Feed ``steps`` (each a step's new tokens) to a fresh request; the deltas and flags."""
    outputs = OutputProcessor(tokenizer)
    request = Request("r", [5, 6], params, 64, arrival_seq=0)
    outputs.add(request)
    deltas, hits = [], []
    for tokens in steps:
        request.all_token_ids.extend(tokens)
        delta, hit_stop = outputs.process(request, [logprob(t) for t in tokens])
        deltas.append(delta)
        hits.append(hit_stop)
        if hit_stop:
            break
    return request, deltas, hits


def joined(deltas: list[RequestOutputDelta]) -> tuple[str, list[int], list[TokenLogprob]]:
    return (
        "".join(d.new_text for d in deltas),
        [t for d in deltas for t in d.new_token_ids],
        [lp for d in deltas for lp in d.new_logprobs],
    )


def test_a_run_of_tokens_gives_what_one_token_a_step_gives(tokenizer: Tokenizer) -> None:
    tokens = tokenizer.encode(TEXT)
    assert len(tokens) >= 8
    params = SamplingParams(logprobs=1)
    _, single, _ = run(tokenizer, params, [[t] for t in tokens])
    _, runs, _ = run(tokenizer, params, [tokens[:1], tokens[1:5], tokens[5:6], tokens[6:]])
    assert joined(runs) == joined(single)
    assert joined(runs)[0] == TEXT
    assert [len(d.new_token_ids) for d in runs] == [1, 4, 1, len(tokens) - 6]
    assert [d.num_completion_tokens for d in runs] == [1, 5, 6, len(tokens)]


def test_a_stop_string_inside_a_run_drops_the_tokens_after_it(tokenizer: Tokenizer) -> None:
    tokens = tokenizer.encode(TEXT)
    # The stop string ends inside the third step's run, with tokens after it in that run.
    prefix = tokenizer.decode(tokens[:4])
    stop_end = len(tokenizer.decode(tokens[:5]))
    stop = tokenizer.decode(tokens[:5])[len(prefix) - 2 : stop_end]
    assert TEXT.find(stop) == stop_end - len(stop)
    params = SamplingParams(stop=[stop], logprobs=1)
    request, one_by_one, _ = run(tokenizer, params, [[t] for t in tokens])
    assert len(request.output_token_ids) == 5
    request, deltas, hits = run(tokenizer, params, [tokens[:1], tokens[1:3], tokens[3:8]])
    assert hits == [False, False, True]
    assert request.output_token_ids == tokens[:5]  # 6 and 7 were never the request's
    text, token_ids, logprobs = joined(deltas)
    assert (text, token_ids, logprobs) == joined(one_by_one)
    assert text == TEXT[: TEXT.find(stop)]
    assert [lp.token_id for lp in logprobs] == tokens[:5]
    last = deltas[-1]
    assert last.finished
    assert last.finish_reason == "stop"
    assert last.num_completion_tokens == 5


def test_the_token_the_scheduler_stopped_on_ends_a_run_without_text(
    tokenizer: Tokenizer,
) -> None:
    tokens = tokenizer.encode(TEXT)
    stop_token = tokens[4]
    outputs = OutputProcessor(tokenizer)
    request = Request("r", [5, 6], SamplingParams(stop_token_ids=[stop_token]), 64, arrival_seq=0)
    outputs.add(request)
    request.all_token_ids.extend(tokens[:2])
    first, _ = outputs.process(request, [None, None])
    # The scheduler appended the kept drafts up to the stop token and finished the request.
    request.all_token_ids.extend(tokens[2:5])
    request.stop_token_id = stop_token
    request.status = RequestStatus.FINISHED
    request.finish_reason = "stop"
    last, hit_stop = outputs.process(request, [None, None, None])
    assert not hit_stop
    assert first.new_text + last.new_text == tokenizer.decode(tokens[:4])
    assert last.new_token_ids == tokens[2:5]
    assert (last.finished, last.finish_reason, last.num_completion_tokens) == (True, "stop", 5)
    assert last.new_logprobs == []
