"""Turns sampled tokens into text increments: detokenization and stop strings; a request's
prompt logprobs ride on its first delta.

This is the only place that looks at output text. A stop string found here
finishes the request through the scheduler; the text never contains it. Token-level
stops (eos, stop tokens, lengths) are the scheduler's decision (:mod:`.stop_rules`):
this module only acts on it, leaving the stop token out of the text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from backend_engine.core.request import Request
from backend_engine.outputs import FinishReason, RequestOutputDelta, TokenLogprob
from backend_engine.text.detokenizer import IncrementalDetokenizer
from backend_engine.text.stop_strings import StopStringMatcher
from model_files.tokenizer import Tokenizer


@dataclass
class _RequestText:
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher | None
    num_emitted_tokens: int = 0
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    sent_prompt_logprobs: bool = False


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestText] = {}

    def add(self, request: Request) -> None:
        params = request.sampling_params
        self._states[request.request_id] = _RequestText(
            IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params.skip_special_tokens
            ),
            StopStringMatcher(params.stop) if params.stop else None,
        )

    def process(
        self, request: Request, logprobs: Sequence[TokenLogprob | None] = ()
    ) -> tuple[RequestOutputDelta, bool]:
        """The delta for a request that just received one token or more (speculative
        decoding keeps several in a step), ``logprobs`` one per new token where asked for;
        the flag says a stop string was hit (the caller then finishes the request).

        New tokens are read one at a time, as if each had come in its own step: a stop
        string found at one of them drops those after it from the request (they would never
        have been sampled), so the output is the same with or without speculation."""
        state = self._states[request.request_id]
        start = request.num_prompt_tokens + state.num_emitted_tokens
        new_token_ids = request.all_token_ids[start:]
        pieces = []
        hit_stop = False
        for index, token_id in enumerate(new_token_ids):
            if index == len(new_token_ids) - 1 and request.stop_token_id is not None:
                break  # the scheduler stopped it on this token: no text
            piece = state.detokenizer.add(token_id)
            if state.stop_matcher is not None:
                piece, hit_stop = state.stop_matcher.feed(piece)
            pieces.append(piece)
            if hit_stop:
                del request.all_token_ids[start + index + 1 :]
                break
        num_kept = request.num_tokens - start
        state.pending_logprobs.extend(lp for lp in logprobs[:num_kept] if lp is not None)
        text = "".join(pieces)
        finished = request.is_finished or hit_stop
        reason: FinishReason | None = "stop" if hit_stop else request.finish_reason
        if finished and not hit_stop:
            text += self._flush(state)
        return self._delta(request, state, text, finished, reason), hit_stop

    @staticmethod
    def _flush(state: _RequestText) -> str:
        """Release held-back text at the end: incomplete bytes, then any stop-string prefix."""
        tail = state.detokenizer.flush()
        if state.stop_matcher is None:
            return tail
        text, hit_stop = state.stop_matcher.feed(tail)
        return text if hit_stop else text + state.stop_matcher.flush()

    def finish_without_token(self, request: Request) -> RequestOutputDelta:
        """The closing delta of a request finished by abort (no new token)."""
        state = self._states.get(request.request_id)
        if state is None:
            return RequestOutputDelta(
                request.group_id,
                [],
                "",
                request.num_prompt_tokens,
                request.num_output_tokens,
                request.num_cached_tokens,
                finished=True,
                finish_reason=request.finish_reason,
                index=request.choice_index,
            )
        return self._delta(request, state, self._flush(state), True, request.finish_reason)

    def fail(self, request: Request, error: str) -> RequestOutputDelta:
        """The closing delta of a request whose own work failed: no more text (its text
        state may be what failed), only the tokens already delivered are counted."""
        state = self._states.pop(request.request_id, None)
        return RequestOutputDelta(
            request.group_id,
            [],
            "",
            request.num_prompt_tokens,
            state.num_emitted_tokens if state is not None else 0,
            request.num_cached_tokens,
            finished=True,
            finish_reason="error",
            error=error,
            index=request.choice_index,
        )

    def _delta(
        self,
        request: Request,
        state: _RequestText,
        text: str,
        finished: bool,
        reason: FinishReason | None,
    ) -> RequestOutputDelta:
        new_tokens = request.all_token_ids[request.num_prompt_tokens + state.num_emitted_tokens :]
        state.num_emitted_tokens = request.num_output_tokens
        logprobs, state.pending_logprobs = state.pending_logprobs, []
        prompt_logprobs = None
        if not state.sent_prompt_logprobs and not request.owes_prompt_logprobs:
            state.sent_prompt_logprobs = True
            if request.prompt_logprobs is not None:
                prompt_logprobs = list(request.prompt_logprobs)
        if finished:
            self._states.pop(request.request_id, None)
        return RequestOutputDelta(
            request_id=request.group_id,  # the caller's id; ``index`` tells its choices apart
            index=request.choice_index,
            new_token_ids=new_tokens,
            new_text=text,
            num_prompt_tokens=request.num_prompt_tokens,
            num_completion_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            new_logprobs=logprobs,
            finished=finished,
            finish_reason=reason if finished else None,
            prompt_logprobs=prompt_logprobs,
        )
