"""The output processor acts on the scheduler's stop decision; it does not make its own."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from backend_engine.core.request import Request, RequestStatus
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
        deltas[rid], _ = outputs.process(request, None)
    # The processor does not re-check stop_token_ids: only the scheduler's word hides a token.
    assert deltas["shown"].new_text == tokenizer.decode([token])
    assert deltas["stopped"].new_text == ""
    assert deltas["stopped"].new_token_ids == [token]
    assert deltas["stopped"].finished
    assert deltas["stopped"].finish_reason == "stop"
