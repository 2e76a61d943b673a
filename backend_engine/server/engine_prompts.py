"""A request's prompts as the engine takes them, every one checked before any starts.

A chat has one prompt (its rendered messages); a completion has one per entry of its
``prompt`` list (`CompletionRequest.prompts`). Each becomes an :class:`EnginePrompt`: its
token ids (within the vocabulary), its SamplingParams (``max_tokens`` within the context left
by that prompt) and, for ``echo``, its text. Token ids outside the vocabulary and a prompt too
long for the context are 400s here, so a request whose last prompt is refused never started
its first (what the engine refuses, it refuses for every prompt alike: `ChoiceStreams`
submits them together and aborts the rest).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import anyio

from backend_engine.async_engine import AsyncEngine
from backend_engine.sampling_params import SamplingParams
from backend_engine.server.errors import invalid_request
from backend_engine.server.sampling import completion_budget, sampling_params
from model_files.tokenizer import Tokenizer
from openai_protocol.request_models import CompletionRequest, ConstrainedRequest, Prompt


@dataclass(frozen=True)
class EnginePrompt:
    token_ids: list[int]
    params: SamplingParams
    text: str = ""  # what ``echo`` repeats: the prompt as sent, or its token ids decoded


def engine_prompt(
    engine: AsyncEngine,
    body: ConstrainedRequest,
    token_ids: list[int],
    *,
    prompt_param: str,
    text: str = "",
) -> EnginePrompt:
    """One prompt checked against the model's context; its SamplingParams from ``body``."""
    if not token_ids:
        raise invalid_request("the prompt is empty", param=prompt_param)
    max_tokens = completion_budget(
        len(token_ids), body.requested_max_tokens(), engine.max_model_len, prompt_param
    )
    return EnginePrompt(token_ids, sampling_params(body, max_tokens), text)


async def completion_prompts(engine: AsyncEngine, body: CompletionRequest) -> list[EnginePrompt]:
    """Every prompt of a completion, in order (tokenized off the event loop, all at once)."""
    prompts = body.prompts()
    params = ["prompt"] if len(prompts) == 1 else [f"prompt[{n}]" for n in range(len(prompts))]
    vocab_size = engine.tokenizer.vocab_size
    for prompt, param in zip(prompts, params, strict=True):
        if isinstance(prompt, list) and any(not 0 <= t < vocab_size for t in prompt):
            raise invalid_request(f"{param} token ids must be in [0, {vocab_size})", param=param)
    tokenized = await anyio.to_thread.run_sync(
        partial(_tokenized, engine.tokenizer, prompts, echo=body.echo)
    )
    return [
        engine_prompt(engine, body, token_ids, prompt_param=param, text=text)
        for (token_ids, text), param in zip(tokenized, params, strict=True)
    ]


def _tokenized(
    tokenizer: Tokenizer, prompts: Sequence[Prompt], *, echo: bool
) -> list[tuple[list[int], str]]:
    """Each prompt's token ids and its text (token ids decoded only when echoed)."""
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            out.append((tokenizer.encode(prompt), prompt))
        else:
            text = tokenizer.decode(prompt, skip_special_tokens=False) if echo else ""
            out.append((list(prompt), text))
    return out
