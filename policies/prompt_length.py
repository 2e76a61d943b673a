"""Prompt-length limit: the tenant's ``max_prompt_tokens`` and the model's context window."""

from __future__ import annotations

from policies.decision import Rejection
from policies.quota import TenantQuota


def check_prompt_length(
    prompt_tokens: int, quota: TenantQuota, context_window: int, *, is_lower_bound: bool = False
) -> Rejection | None:
    """None if the prompt fits, else a 400 ``context_length_exceeded``.

    ``is_lower_bound``: the prompt has at least ``prompt_tokens`` tokens (a bound from its
    length, checked before it is tokenized); the message then says "at least".

    A prompt of exactly ``max_prompt_tokens`` is allowed. The context window must
    leave room for at least one completion token, so the longest prompt it admits
    is ``context_window - 1``. Whether ``max_tokens`` also fits is the output cap's
    question (`policies.output_cap.resolve_max_tokens`).
    """
    if context_window < 1:
        raise ValueError(f"context_window must be at least 1, got {context_window}")
    limit = context_window - 1
    if quota.max_prompt_tokens is not None and quota.max_prompt_tokens < limit:
        limit = quota.max_prompt_tokens
    if prompt_tokens <= limit:
        return None
    counted = f"at least {prompt_tokens}" if is_lower_bound else str(prompt_tokens)
    if limit == context_window - 1:
        message = (
            f"This model's maximum context length is {context_window} tokens. However, your "
            f"messages resulted in {counted} tokens, leaving no room for a completion. "
            "Please reduce the length of the messages."
        )
    else:
        message = (
            f"Your plan allows prompts of at most {limit} tokens. However, your messages "
            f"resulted in {counted} tokens. Please reduce the length of the messages."
        )
    return Rejection(
        status=400,
        code="context_length_exceeded",
        type="invalid_request_error",
        message=message,
        param="messages",
    )
