"""Turning logits into next tokens: greedy, temperature, top-k, top-p, seeds, logprobs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from backend_engine.outputs import TokenLogprob
from backend_engine.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor,  # [num_seqs, vocab] float32
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator,
) -> tuple[list[int], list[TokenLogprob | None]]:
    """One token per row, and its logprobs where asked for: :func:`choose_tokens`, then
    :func:`token_logprobs` for the rows that want them."""
    token_ids = choose_tokens(logits, params, generators, default_generator)
    logprobs: list[TokenLogprob | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if rows:
        chosen = token_logprobs(
            logits[rows], [token_ids[i] for i in rows], [params[i].logprobs or 0 for i in rows]
        )
        for row, logprob in zip(rows, chosen, strict=True):
            logprobs[row] = logprob
    return token_ids, logprobs


def choose_tokens(
    logits: torch.Tensor,  # [num_seqs, vocab] float32
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator,
) -> list[int]:
    """One token per row. A row with its own generator (a seeded request) draws
    only from it, so the same seed gives the same output whatever else is batched.

    Every per-row setting is turned into tensors before any generator draws, so a row whose
    settings raise leaves every generator as it was: the batch can be retried without it.
    """
    is_greedy = [p.temperature == 0.0 for p in params]
    if all(is_greedy):
        token_ids = argmax_rows(logits)
    else:
        token_ids = _sample_random(logits, params, generators, default_generator, is_greedy)
    token_list: list[int] = token_ids.tolist()
    return token_list


def argmax_rows(values: torch.Tensor) -> torch.Tensor:  # [rows, vocab] -> [rows] int64
    """Each row's first largest index (the first NaN, if any), as ``values.argmax(dim=-1)``.
    On the CPU through NumPy: PyTorch's CPU argmax is scalar code, 84 us for one row of
    49,152 float32 on the development machine and 690 us for 16, NumPy's vectorized 7 and
    72 us, the same indices."""
    if values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.argmax(values.detach().numpy(), axis=-1))
    return values.argmax(dim=-1)


def token_logprobs(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    token_ids: Sequence[int],
    num_top: Sequence[int],
) -> list[TokenLogprob]:
    """Each row's chosen token's log-probability and its ``num_top`` best alternatives
    (only possible ones: a structured output's row may allow fewer than ``num_top``)."""
    all_logprobs = torch.log_softmax(logits, dim=-1)
    out = []
    for lp, chosen, k in zip(all_logprobs, token_ids, num_top, strict=True):
        top_values, top_ids = lp.topk(k) if k else (lp[:0], lp[:0].long())
        top = zip(top_ids.tolist(), top_values.tolist(), strict=True)
        out.append(
            TokenLogprob(
                token_id=chosen,
                logprob=float(lp[chosen]),
                top=tuple((t, v) for t, v in top if v != float("-inf")),
            )
        )
    return out


def sampling_probs(
    logits: torch.Tensor,  # [num_rows, vocab] float32
    params: Sequence[SamplingParams],
) -> torch.Tensor:
    """The distribution each row samples from: temperature, then top-k and top-p
    ([num_rows, vocab], rows summing to one; a greedy row's is its softmax at temperature 1).
    Sampling draws from it, and speculative decoding verifies drafts against it."""
    temperatures = torch.tensor(
        [p.temperature if p.temperature > 0 else 1.0 for p in params], device=logits.device
    )
    scaled = logits / temperatures.unsqueeze(1)
    top_ks = [p.top_k for p in params]
    top_ps = [p.top_p for p in params]
    if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
        scaled = _apply_top_k_top_p(scaled, top_ks, top_ps)
    return torch.softmax(scaled, dim=-1)


def _sample_random(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator,
    is_greedy: list[bool],
) -> torch.Tensor:
    device = logits.device
    probs = sampling_probs(logits, params)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, and lets each
    # row take its noise from its own generator.
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        noise[unseeded] = torch.empty((len(unseeded), probs.shape[1]), device=device).exponential_(
            generator=default_generator
        )
    for i, generator in enumerate(generators):
        if generator is not None:
            noise[i].exponential_(generator=generator)
    sampled = argmax_rows(probs / noise)
    if any(is_greedy):
        greedy_rows = torch.tensor(is_greedy, device=device)
        sampled = torch.where(greedy_rows, argmax_rows(logits), sampled)
    return sampled


def _apply_top_k_top_p(
    logits: torch.Tensor, top_ks: list[int], top_ps: list[float]
) -> torch.Tensor:
    vocab = logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([k if k > 0 else vocab for k in top_ks], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    remove = ranks >= ks.unsqueeze(1)
    ps = torch.tensor(top_ps, device=logits.device).unsqueeze(1)
    sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    # Keep the smallest set whose mass reaches p: drop a token when the mass
    # before it already reaches p (the top token always stays).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    remove |= mass_before >= ps
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)
