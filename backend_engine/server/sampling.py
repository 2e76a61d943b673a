"""From an API request to the engine's SamplingParams, enforcing the model's length.

Every sampling field OpenAI defines maps onto one of SamplingParams (``n``, the penalties,
``logit_bias`` by token id); a completion with ``echo`` and ``logprobs`` asks for as many
prompt logprobs, so its prompt's tokens can be reported before the completion's. What only
the model can judge (a ``logit_bias`` id outside its vocabulary) the engine refuses when the
request is made, and `param_named_by` names the field its refusal is about.
"""

from __future__ import annotations

import re

from backend_engine.sampling_params import SamplingParams
from backend_engine.server.errors import context_length_exceeded, invalid_request
from backend_engine.server.output_constraints import output_constraint
from backend_engine.structured_output.constraint import InvalidConstraint
from openai_protocol.request_models import CompletionRequest, ConstrainedRequest

# The request fields a SamplingParams (or make_request) refusal may name, by the word its
# message starts with (``"n must be ..."``, ``"Invalid 'logit_bias': ..."``).
_NAMED_FIELDS = frozenset(
    [
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "logprobs",
        "n",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
    ]
)
_PARAM_OF_FIELD = {**{name: name for name in _NAMED_FIELDS}, "prompt_logprobs": "logprobs"}
_LEADING_FIELD = re.compile(r"^(?:Invalid ')?([a-z_]+)")


def param_named_by(message: str) -> str | None:
    """The request field an engine's refusal names at its start, if it names one."""
    match = _LEADING_FIELD.match(message)
    return _PARAM_OF_FIELD.get(match.group(1)) if match else None


def completion_budget(
    num_prompt_tokens: int, requested: int | None, max_model_len: int, prompt_param: str
) -> int:
    """The ``max_tokens`` to give the engine: as requested, or all the room left.

    Raises the ``context_length_exceeded`` APIError when the prompt leaves no room or
    prompt + requested tokens exceed ``max_model_len``.
    """
    total = num_prompt_tokens + (requested or 1)
    if total > max_model_len:
        asked = f"{num_prompt_tokens} in the prompt"
        if requested is not None:
            asked += f", {requested} for the completion"
        raise context_length_exceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {total} tokens ({asked}). Please reduce the length of the prompt "
            "or the completion.",
            param=prompt_param,
        )
    return requested if requested is not None else max_model_len - num_prompt_tokens


def prompt_logprobs(body: ConstrainedRequest) -> int | None:
    """How many alternatives to report for each prompt token: a completion's ``logprobs``
    when it also asks for ``echo``; else None (no prompt logprobs are computed)."""
    if isinstance(body, CompletionRequest) and body.echo:
        return body.logprobs
    return None


def sampling_params(body: ConstrainedRequest, max_tokens: int) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            seed=body.seed,
            stop=body.stop_strings,
            ignore_eos=body.ignore_eos,
            logprobs=body.requested_logprobs(),
            structured_output=output_constraint(body),
            n=body.n,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=body.logit_bias_ids(),
            prompt_logprobs=prompt_logprobs(body),
        )
    except InvalidConstraint as exc:
        raise invalid_request(exc.message, param=exc.param) from None
    except ValueError as exc:
        raise invalid_request(str(exc), param=param_named_by(str(exc))) from None
