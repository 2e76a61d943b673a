"""When a request stops on a token: the one rule, a pure function of the request and its new token.

Where each kind of stop is decided, and why there:
- eos, ``stop_token_ids``, a finished grammar (structured outputs), ``max_tokens`` and the
  model length are token-level facts, known
  the moment a token is sampled. The scheduler applies :func:`token_stop` in
  ``update_from_output`` and finishes the request there, so its blocks are freed before the
  next step is planned. Nothing else checks these.
- stop *strings* are text-level: whether one occurred is known only after detokenizing, and
  it may span tokens. ``OutputProcessor`` finds them (it is the only place that sees text)
  and reports the hit; ``LLMEngine`` then finishes the request through the scheduler.

The output processor acts on the scheduler's decision: a request finished on a stop token
(``Request.stop_token_id``) gets no text for that token.
"""

from __future__ import annotations

from dataclasses import dataclass

from backend_engine.core.request import Request
from backend_engine.outputs import FinishReason


@dataclass(frozen=True)
class TokenStop:
    reason: FinishReason
    on_stop_token: bool  # the token is eos or a stop token: it ends the text, unshown


def token_stop(
    request: Request, token_id: int, eos_token_ids: frozenset[int], max_model_len: int
) -> TokenStop | None:
    """Whether ``request`` stops now that ``token_id`` (already appended) was sampled."""
    params = request.sampling_params
    if token_id in params.stop_token_ids:
        return TokenStop("stop", on_stop_token=True)
    if not params.ignore_eos and token_id in eos_token_ids:
        return TokenStop("stop", on_stop_token=True)
    if request.matcher is not None and request.matcher.is_finished:
        # The grammar ends only on eos (even with ignore_eos): nothing may follow it.
        return TokenStop("stop", on_stop_token=token_id in eos_token_ids)
    if request.num_output_tokens >= request.max_tokens:
        return TokenStop("length", on_stop_token=False)
    if request.num_tokens >= max_model_len:
        return TokenStop("length", on_stop_token=False)
    return None
