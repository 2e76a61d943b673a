"""Prompt logprobs: the log-probability of each prompt token given those before it, and its
best alternatives, from the logits of every position of a prompt's prefill chunks.

Prompt token ``j`` is predicted at position ``j - 1``; the first has nothing before it (its
entry is None), and the prompt's last position predicts the first output token, which the
sampler reports. A request is prefilled in chunks, so each chunk adds the entries its
positions predict, continuing those already reported: a recompute after preemption computes
none twice. These are the model's own logprobs; the logits stage (bias, penalties) does not
apply to them.

Logits are computed only for the requests that ask, ``MAX_POSITIONS_PER_SLICE`` positions
at a time, so a long chunk never holds its whole ``[num_tokens, vocab]`` at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from backend_engine.core.scheduler import ScheduledRequest
from backend_engine.outputs import TokenLogprob

MAX_POSITIONS_PER_SLICE = 256

ComputeLogits = Callable[[torch.Tensor], torch.Tensor]  # [n, hidden] -> [n, vocab]


def owes_prompt_logprobs(item: ScheduledRequest) -> bool:
    """Whether this chunk's request asks for prompt logprobs and some are still unreported."""
    return (
        item.sampling_params.prompt_logprobs is not None
        and item.num_reported_prompt_logprobs < item.num_prompt_tokens
    )


def chunk_prompt_logprobs(
    compute_logits: ComputeLogits,
    hidden: torch.Tensor,  # [item.num_tokens, hidden_size]: the chunk's hidden states
    item: ScheduledRequest,
) -> list[TokenLogprob | None]:
    """The prompt-logprob entries this chunk adds after the ``num_reported_prompt_logprobs``
    already reported (none when its positions predict no unreported prompt token)."""
    start = item.start_position
    reported = item.num_reported_prompt_logprobs
    entries: list[TokenLogprob | None] = []
    if reported == 0:
        entries.append(None)  # the first prompt token: nothing comes before it
        reported = 1
    first = reported - 1  # the position that predicts the next unreported prompt token
    end = min(start + item.num_tokens, item.num_prompt_tokens - 1)
    if first < start:
        raise RuntimeError(
            f"request {item.request_id!r} owes prompt logprobs from position {first}, "
            f"but its chunk starts at {start}"
        )
    num_top = item.sampling_params.prompt_logprobs or 0
    token_ids = item.all_token_ids
    for low in range(first, end, MAX_POSITIONS_PER_SLICE):
        high = min(low + MAX_POSITIONS_PER_SLICE, end)
        logits = compute_logits(hidden[low - start : high - start])  # [m, vocab]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.tensor(token_ids[low + 1 : high + 1], device=logprobs.device)
        chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        if num_top:
            top_values, top_ids = logprobs.topk(num_top, dim=-1)
            tops = [
                tuple(zip(ids, values, strict=True))
                for ids, values in zip(top_ids.tolist(), top_values.tolist(), strict=True)
            ]
        else:
            tops = [()] * (high - low)
        entries.extend(
            TokenLogprob(token_id, logprob, top)
            for token_id, logprob, top in zip(targets.tolist(), chosen, tops, strict=True)
        )
    return entries
