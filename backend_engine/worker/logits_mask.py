"""Structured outputs on the logits: each constrained row keeps only the tokens its grammar
allows next. Unconstrained rows are not touched, so their tokens are exactly what they would
be without constrained neighbours.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from backend_engine.core.request import OutputMatcher

_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def mask_logits(
    logits: torch.Tensor, matchers: Mapping[int, OutputMatcher]
) -> dict[int, Exception]:
    """Set to -inf, in place, each ``logits`` row's tokens that its matcher does not allow
    next (``matchers``: row -> matcher). Returns the rows whose matcher failed (they are left
    as they were; the caller fails their requests alone)."""
    failed: dict[int, Exception] = {}
    if not matchers:
        return failed
    num_words = next(iter(matchers.values())).mask_bytes // 4
    bitmask = torch.zeros((len(matchers), num_words), dtype=torch.int32)  # [rows, vocab / 32]
    rows = []
    for i, (row, matcher) in enumerate(matchers.items()):
        try:
            matcher.fill_mask(bitmask[i].data_ptr())  # one contiguous int32 row
        except Exception as exc:
            failed[row] = exc
            continue
        rows.append((i, row))
    if rows:
        masks = bitmask[[i for i, _ in rows]]
        allowed = ((masks.unsqueeze(-1) >> _BIT_SHIFTS) & 1).bool().flatten(1)  # [n, words * 32]
        vocab = logits.shape[1]
        allowed = allowed[:, :vocab].to(logits.device, non_blocking=True)
        if allowed.shape[1] < vocab:  # logits wider than the grammar's vocabulary: padding rows
            pad = torch.zeros((allowed.shape[0], vocab - allowed.shape[1]), dtype=torch.bool)
            allowed = torch.cat([allowed, pad.to(logits.device)], dim=1)
        disallowed = ~allowed
        masked_rows = [row for _, row in rows]
        if masked_rows == list(range(logits.shape[0])):  # every row: one in-place fill
            logits.masked_fill_(disallowed, float("-inf"))
        else:  # in place on each row's view (a gather and scatter cost twice as much)
            for k, row in enumerate(masked_rows):
                logits[row].masked_fill_(disallowed[k], float("-inf"))
    return failed


def accept_tokens(
    matchers: Mapping[int, OutputMatcher], token_ids: Mapping[int, int]
) -> dict[int, Exception]:
    """Advance each row's matcher past its sampled token; the rows whose matcher refused it."""
    failed: dict[int, Exception] = {}
    for row, matcher in matchers.items():
        token_id = token_ids.get(row)
        if token_id is None:
            continue
        try:
            matcher.accept(token_id)
        except Exception as exc:
            failed[row] = exc
    return failed
