"""From an API request to the engine's SamplingParams, enforcing the model's length."""

from __future__ import annotations

from backend_engine.sampling_params import SamplingParams
from backend_engine.server.errors import context_length_exceeded, invalid_request
from backend_engine.server.output_constraints import output_constraint
from backend_engine.structured_output.constraint import InvalidConstraint
from openai_protocol.request_models import ConstrainedRequest


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
        )
    except InvalidConstraint as exc:
        raise invalid_request(exc.message, param=exc.param) from None
    except ValueError as exc:
        raise invalid_request(str(exc)) from None
