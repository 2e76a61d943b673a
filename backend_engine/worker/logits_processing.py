"""The per-request logits stage: ``logit_bias`` and the penalties, in place on a step's logits,
before the grammar mask, greedy choice, sampling and logprobs (so all four see the same row).

In the order vLLM applies them (its sampler: the logit-bias processor, then repetition, then
frequency and presence):

1. ``logit_bias``: ``logits[t] += bias[t]`` for each listed token id.
2. ``repetition_penalty`` (transformers' ``RepetitionPenaltyLogitsProcessor``): each token seen
   in the prompt or the output so far has its logit divided by the penalty when positive,
   multiplied by it otherwise.
3. ``presence_penalty`` and ``frequency_penalty`` (OpenAI's formula, over the output only):
   ``logits[t] -= presence * (count[t] > 0) + frequency * count[t]``.

Every step works on the (row, token) pairs involved, never on whole ``[rows, vocab]``
tensors: a step costs in proportion to the biased ids and the tokens seen. A row whose params
use none of them is never touched, and a batch with no such row returns after one check of
each row's ``processes_logits``.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch

from backend_engine.sampling_params import SamplingParams


class LogitsRow(Protocol):
    """What the stage needs of the request behind one row of logits (a `ScheduledRequest`
    has it; a forked choice has its own params over its leader's prompt)."""

    @property
    def sampling_params(self) -> SamplingParams: ...

    @property
    def all_token_ids(self) -> Sequence[int]:
        """Its tokens so far: the prompt, then the output (not the token about to be chosen)."""
        ...

    @property
    def num_prompt_tokens(self) -> int: ...


def apply_logits_stage(logits: torch.Tensor, rows: Sequence[LogitsRow]) -> None:
    """Apply each row's ``logit_bias`` and penalties to ``logits`` ([len(rows), vocab]), in
    place. Rows that use none of them are left exactly as they were."""
    processed = [r for r, row in enumerate(rows) if row.sampling_params.processes_logits]
    if not processed:
        return
    params = [rows[r].sampling_params for r in processed]
    biased = [(r, p.logit_bias) for r, p in zip(processed, params, strict=True) if p.logit_bias]
    if biased:
        _add_logit_bias(logits, biased)
    repeated = [r for r, p in zip(processed, params, strict=True) if p.repetition_penalty != 1.0]
    if repeated:
        _apply_repetition_penalty(
            logits,
            repeated,
            [rows[r].all_token_ids for r in repeated],
            [rows[r].sampling_params.repetition_penalty for r in repeated],
        )
    counted = [
        r
        for r, p in zip(processed, params, strict=True)
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
    ]
    if counted:
        _apply_presence_frequency(
            logits,
            counted,
            [rows[r].all_token_ids[rows[r].num_prompt_tokens :] for r in counted],
            [rows[r].sampling_params for r in counted],
        )


def _add_logit_bias(
    logits: torch.Tensor, biased: Sequence[tuple[int, Mapping[int, float]]]
) -> None:
    row_ids = array("q")
    token_ids = array("q")
    biases = array("d")
    for row, bias in biased:
        row_ids.extend(array("q", (row,)) * len(bias))
        token_ids.extend(bias.keys())
        biases.extend(bias.values())
    device = logits.device
    index = (_tensor(row_ids, torch.int64).to(device), _tensor(token_ids, torch.int64).to(device))
    # A row's ids are a dict's keys, so each (row, token) pair occurs once.
    values = _tensor(biases, torch.float64).to(device=device, dtype=logits.dtype)
    logits.index_put_(index, values, accumulate=True)


def _apply_repetition_penalty(
    logits: torch.Tensor,
    rows: Sequence[int],
    histories: Sequence[Sequence[int]],
    penalties: Sequence[float],
) -> None:
    row_index, token_index = _pairs(rows, histories, logits.device)
    per_token = array("d")
    for history, penalty_of_row in zip(histories, penalties, strict=True):
        per_token.extend(array("d", (penalty_of_row,)) * len(history))
    penalty = _tensor(per_token, torch.float64).to(device=logits.device, dtype=logits.dtype)
    seen = logits[row_index, token_index]  # [num_pairs]
    # A token seen twice is written twice with the same value, as transformers' scatter does.
    logits[row_index, token_index] = torch.where(seen < 0, seen * penalty, seen / penalty)


def _apply_presence_frequency(
    logits: torch.Tensor,
    rows: Sequence[int],
    outputs: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
) -> None:
    vocab = logits.shape[1]
    device = logits.device
    local_index, token_index = _pairs(range(len(rows)), outputs, device)
    if local_index.numel() == 0:  # nothing generated yet: nothing to penalize
        return
    pairs, counts = torch.unique(local_index * vocab + token_index, return_counts=True)
    local_rows = pairs // vocab  # index into ``rows`` and ``params``
    presence = _tensor(array("d", (p.presence_penalty for p in params)), torch.float64)
    frequency = _tensor(array("d", (p.frequency_penalty for p in params)), torch.float64)
    presence = presence.to(device=device, dtype=logits.dtype)
    frequency = frequency.to(device=device, dtype=logits.dtype)
    penalty = presence[local_rows] + frequency[local_rows] * counts.to(logits.dtype)
    row_ids = _int64(rows).to(device)[local_rows]
    token_ids = pairs % vocab
    logits[row_ids, token_ids] = logits[row_ids, token_ids] - penalty


def _pairs(
    rows: Iterable[int], histories: Sequence[Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, token) index pairs of each row's history: one pair per token, repeats kept.

    Built in C arrays, not with torch's ``repeat_interleave``: on a loaded CPU that op's
    thread hand-off cost up to a scheduler slice (~12 ms) a call, measured inside the engine."""
    row_ids = array("q")
    token_ids = array("q")
    for row, history in zip(rows, histories, strict=True):
        row_ids.extend(array("q", (row,)) * len(history))
        token_ids.extend(history)
    return _tensor(row_ids, torch.int64).to(device), _tensor(token_ids, torch.int64).to(device)


def _int64(values: Iterable[int]) -> torch.Tensor:
    return _tensor(array("q", values), torch.int64)


def _tensor(values: array[Any], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor over a C array's memory: building one from a Python list element by
    element is several times slower, and this stage runs every step."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(values, dtype=dtype)
