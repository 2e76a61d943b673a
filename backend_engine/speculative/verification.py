"""Verifying draft tokens: which of a sequence's k drafts the target keeps, and the one token
the target adds after them, so that the output is exactly what the target alone would give.

One forward pass scores the sequence's last token and its k drafts, giving k + 1 rows of the
target's next-token distribution: row i is the target's choice after the drafts before i. The
rows are what the request would sample from *after* its whole logits stage (penalties, bias,
grammar mask, temperature, top-k/top-p), since that, not the raw model, is the distribution
the output must follow; the caller builds them as it builds one decode row.

- **Greedy** (``temperature == 0``): keep drafts while each equals the target's argmax (the
  sampler's own choice, first maximum on ties), then add the argmax at the first disagreement,
  or the last row's argmax (the bonus token) when all k agree. Pass the processed *logits*:
  the argmax is what matters, and softmax could round two near-equal maxima together.
- **Sampling**: rejection sampling (Leviathan et al. 2023, Chen et al. 2023). Draft x_i, drawn
  from the drafter's q_i, is kept with probability min(1, p_i(x_i) / q_i(x_i)); the first
  rejected one is replaced by a draw from normalize(max(0, p_i - q_i)) and the rest are
  dropped; if all are kept, the bonus is drawn from p_k. Each emitted token is then
  distributed exactly as p, whatever q is. Pass *probabilities* (each row sums to one). A
  deterministic proposer (n-gram lookup) has q_i one-hot at x_i: pass ``draft_probs=None``;
  x_i is then kept with probability p_i(x_i), and the residual is p_i without x_i.

Every random draw (k uniforms, then one categorical draw) comes from the generator the caller
passes, a seeded request's own, so the same seed, drafts and distributions give the same
tokens. Acceptance is tested as ``u * q < p`` (no division): a q of zero keeps a possible draft
and rejects an impossible one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from backend_engine.worker.sampler import argmax_rows


@dataclass(frozen=True)
class VerifiedTokens:
    """What one sequence emits this step: its first ``num_accepted_drafts`` drafts, then one
    token of the target's (the correction at the first rejection, or the bonus token)."""

    token_ids: tuple[int, ...]  # 1 to k + 1 tokens
    num_accepted_drafts: int


def accept_greedy(
    draft_token_ids: Sequence[int], target_token_ids: Sequence[int]
) -> VerifiedTokens:
    """Greedy verification over the target's k + 1 argmax tokens (pure Python)."""
    num_drafts = len(draft_token_ids)
    if len(target_token_ids) != num_drafts + 1:
        raise ValueError(
            f"{num_drafts} drafts need {num_drafts + 1} target tokens, got {len(target_token_ids)}"
        )
    num_accepted = 0
    while num_accepted < num_drafts and (
        draft_token_ids[num_accepted] == target_token_ids[num_accepted]
    ):
        num_accepted += 1
    return VerifiedTokens(
        token_ids=tuple(target_token_ids[: num_accepted + 1]),
        num_accepted_drafts=num_accepted,
    )


def verify_greedy(
    draft_token_ids: Sequence[int],
    target_logits: torch.Tensor,  # [k + 1, vocab], after the logits stage
) -> VerifiedTokens:
    """Greedy verification of one sequence's drafts."""
    return verify_greedy_batch([draft_token_ids], target_logits)[0]


def verify_greedy_batch(
    draft_token_ids: Sequence[Sequence[int]],
    target_logits: torch.Tensor,  # [sum(k_i + 1), vocab]: each sequence's rows in turn
) -> list[VerifiedTokens]:
    """Greedy verification of several sequences, with one argmax and one device sync."""
    num_rows = sum(len(drafts) + 1 for drafts in draft_token_ids)
    if target_logits.dim() != 2 or target_logits.shape[0] != num_rows:
        raise ValueError(
            f"the drafts need {num_rows} target rows, got logits of shape "
            f"{tuple(target_logits.shape)}"
        )
    target_token_ids: list[int] = argmax_rows(target_logits).tolist()
    verified = []
    row = 0
    for drafts in draft_token_ids:
        num_seq_rows = len(drafts) + 1
        verified.append(accept_greedy(drafts, target_token_ids[row : row + num_seq_rows]))
        row += num_seq_rows
    return verified


def verify_sampled(
    draft_token_ids: Sequence[int],
    target_probs: torch.Tensor,  # [k + 1, vocab], after the logits stage; rows sum to 1
    draft_probs: torch.Tensor | None,  # [k, vocab] the drafter's q; None: one-hot at the drafts
    generator: torch.Generator,
) -> VerifiedTokens:
    """Rejection-sampling verification of one sequence's drafts (see the module docstring)."""
    num_drafts = len(draft_token_ids)
    _check_sampled_shapes(draft_token_ids, target_probs, draft_probs)
    device = target_probs.device
    drafts = torch.tensor(draft_token_ids, dtype=torch.long, device=device)  # [k]
    rows = torch.arange(num_drafts, device=device)  # [k]
    target_of_drafts = target_probs[rows, drafts].float()  # [k] p_i(x_i)
    uniforms = torch.rand(num_drafts, generator=generator, device=device)  # [k] in [0, 1)
    if draft_probs is None:
        is_accepted = uniforms < target_of_drafts
    else:
        is_accepted = uniforms * draft_probs[rows, drafts].float() < target_of_drafts
    num_accepted = int(is_accepted.long().cumprod(dim=0).sum())
    if num_accepted < num_drafts:
        weights = _residual(
            target_probs[num_accepted],
            None if draft_probs is None else draft_probs[num_accepted],
            draft_token_ids[num_accepted],
        )
    else:
        weights = target_probs[num_drafts].float()
    last_token_id = int(torch.multinomial(weights, 1, generator=generator))
    return VerifiedTokens(
        token_ids=(*draft_token_ids[:num_accepted], last_token_id),
        num_accepted_drafts=num_accepted,
    )


def _residual(
    target_row: torch.Tensor,  # [vocab] p_i
    draft_row: torch.Tensor | None,  # [vocab] q_i, or None: one-hot at draft_token_id
    draft_token_id: int,
) -> torch.Tensor:
    """max(0, p - q), unnormalized (multinomial normalizes). It has mass whenever a rejection
    is possible; if rounding left it none, p itself is the right distribution to fall back on
    (a rejection then had probability zero)."""
    target_row = target_row.float()
    if draft_row is None:
        residual = target_row.clone()
        residual[draft_token_id] = 0.0
    else:
        residual = (target_row - draft_row.float()).clamp_(min=0.0)
    if float(residual.sum()) <= 0.0:
        return target_row
    return residual


def _check_sampled_shapes(
    draft_token_ids: Sequence[int], target_probs: torch.Tensor, draft_probs: torch.Tensor | None
) -> None:
    num_drafts = len(draft_token_ids)
    if target_probs.dim() != 2 or target_probs.shape[0] != num_drafts + 1:
        raise ValueError(
            f"{num_drafts} drafts need {num_drafts + 1} target rows, got target_probs of "
            f"shape {tuple(target_probs.shape)}"
        )
    vocab_size = target_probs.shape[1]
    if draft_probs is not None and tuple(draft_probs.shape) != (num_drafts, vocab_size):
        raise ValueError(
            f"draft_probs must have shape {(num_drafts, vocab_size)}, "
            f"got {tuple(draft_probs.shape)}"
        )
    outside = [t for t in draft_token_ids if not 0 <= t < vocab_size]
    if outside:
        raise ValueError(f"draft tokens {outside} are outside the vocabulary of {vocab_size}")
