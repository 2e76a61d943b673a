"""The output processor acts on the scheduler's stop decision; it does not make its own."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from backend_engine.core.request import Request, RequestStatus
from backend_engine.outputs import TokenLogprob
from backend_engine.sampling_params import SamplingParams
from backend_engine.text.output_processor import OutputProcessor
from model_files.tokenizer import Tokenizer


def test_the_token_a_request_stopped_on_is_left_out_of_the_text(
    demo_checkpoint: Callable[..., Path],
) -> None:
    tokenizer = Tokenizer.from_pretrained(demo_checkpoint())
    token = tokenizer.encode(" hello")[-1]
    assert tokenizer.decode([token])
    outputs = OutputProcessor(tokenizer)
    deltas = {}
    for rid, stopped_on_it in (("shown", False), ("stopped", True)):
        request = Request(rid, [5, 6], SamplingParams(stop_token_ids=[token]), 4, arrival_seq=0)
        outputs.add(request)
        request.all_token_ids.append(token)
        request.status = RequestStatus.FINISHED
        request.finish_reason = "stop"
        if stopped_on_it:  # what the scheduler records when token_stop says so
            request.stop_token_id = token
        deltas[rid], _ = outputs.process(request)
    # The processor does not re-check stop_token_ids: only the scheduler's word hides a token.
    assert deltas["shown"].new_text == tokenizer.decode([token])
    assert deltas["stopped"].new_text == ""
    assert deltas["stopped"].new_token_ids == [token]
    assert deltas["stopped"].finished
    assert deltas["stopped"].finish_reason == "stop"


def test_prompt_logprobs_ride_on_the_first_delta_only(
    demo_checkpoint: Callable[..., Path],
) -> None:
    outputs = OutputProcessor(Tokenizer.from_pretrained(demo_checkpoint()))
    asking = Request("asks", [5, 6, 7], SamplingParams(prompt_logprobs=1), 4, arrival_seq=0)
    plain = Request("plain", [5, 6, 7], SamplingParams(), 4, arrival_seq=1)
    computed = [None, TokenLogprob(6, -1.0, ((6, -1.0),)), TokenLogprob(7, -2.0, ((8, -0.5),))]
    assert asking.prompt_logprobs is not None
    asking.prompt_logprobs.extend(computed)  # as the engine records them, chunk by chunk
    firsts, seconds = [], []
    for request in (asking, plain):
        outputs.add(request)
        request.all_token_ids.append(9)
        firsts.append(outputs.process(request)[0])
        request.all_token_ids.append(10)
        seconds.append(outputs.process(request)[0])
    assert firsts[0].prompt_logprobs == computed
    assert firsts[1].prompt_logprobs is None
    assert [d.prompt_logprobs for d in seconds] == [None, None]
