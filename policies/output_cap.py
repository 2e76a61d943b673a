"""Max-output cap: the effective ``max_tokens`` for a request, or a refusal.

Two ceilings apply, the tenant's ``max_output_tokens`` and the room the model's
context window leaves after the prompt (``context_window - prompt_tokens``):

- No ``max_tokens`` in the request: the tenant's ``default_max_output_tokens``
  (else its cap, else the whole room), silently cut to the room.
- An explicit ``max_tokens`` above either ceiling is cut to it when the quota has
  ``clamp_max_output``, otherwise refused with a 400.

The result is always a number, so the budget and rate limits can reserve it.
The gateway passes ``max_completion_tokens`` here when the client sent that instead.
"""

from __future__ import annotations

from policies.decision import Rejection
from policies.quota import TenantQuota


def resolve_max_tokens(
    requested: int | None, quota: TenantQuota, *, prompt_tokens: int, context_window: int
) -> int | Rejection:
    """The ``max_tokens`` to forward (at least 1), or a 400 `Rejection`."""
    room = context_window - prompt_tokens
    if room < 1:
        return _context_rejection(context_window, prompt_tokens, 1)
    if requested is None:
        default = quota.default_max_output_tokens or quota.max_output_tokens or room
        return min(default, room)
    if requested < 1:
        return Rejection(
            status=400,
            code="invalid_value",
            type="invalid_request_error",
            message=f"max_tokens must be at least 1, got {requested}.",
            param="max_tokens",
        )
    cap = quota.max_output_tokens
    if cap is not None and requested > cap:
        if not quota.clamp_max_output:
            return Rejection(
                status=400,
                code="invalid_value",
                type="invalid_request_error",
                message=(
                    f"max_tokens is too large: {requested}. Your plan allows at most {cap} "
                    "completion tokens per request."
                ),
                param="max_tokens",
            )
        requested = cap
    if requested > room:
        if not quota.clamp_max_output:
            return _context_rejection(context_window, prompt_tokens, requested)
        requested = room
    return requested


def _context_rejection(context_window: int, prompt_tokens: int, max_tokens: int) -> Rejection:
    return Rejection(
        status=400,
        code="context_length_exceeded",
        type="invalid_request_error",
        message=(
            f"This model's maximum context length is {context_window} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion."
        ),
        param="messages",
    )
