"""Choosing each int4 group's scale and minimum: a search over rounding grids (GGUF Q4_1's form).

A group of ``G`` weights becomes ``w ~= code * scale + min`` with codes 0..15. The plain rule
(min/max rounding: ``scale = (max - min) / 15``, ``min = min``) spends its grid on the two
extremes; one outlier stretches every step. The search tries that rule and 21 more grids,
keeping per group whichever reconstructs the group with the smallest squared error (so it is
never worse than min/max rounding). It is llama.cpp's ``make_qkx2_quants`` idea::

    candidate i = 0..20:  iscale = (14 + 0.1 i) / (max - min)
                          codes  = clamp(round((w - min) * iscale), 0, 15)
                          scale, min = least squares fit of w on those codes
    every candidate:      scale, min rounded to the stored dtype (float16 on the load path),
                          codes re-chosen against the rounded pair (nearest point of the grid),
                          error = sum over the group of (code * scale + min - w)^2

Codes are chosen against the rounded scale and minimum, so the error compared is the error of
what is stored. With ``importance`` (one non-negative weight per input column, e.g. the mean
squared activation of that input: llama.cpp's "importance matrix") every sum above is weighted
by it, so the grid fits the columns whose errors reach the output most; GPTQ
(:mod:`kernels.gptq_quantization`) chooses each group's grid this way.

The fit is vectorized over groups and done a chunk of rows at a time
(``CHUNK_VALUES`` weights) so a 4096 x 11008 matrix needs tens of MB of temporaries, not GBs;
the result does not depend on the chunking (every group is fitted on its own).
"""

from __future__ import annotations

import torch

INT4_MAX_CODE = 15
SEARCH_STEPS = 20  # candidates i = 0..SEARCH_STEPS
SEARCH_RMIN = -1.0  # the first candidate's iscale is (15 + rmin) / (max - min)
SEARCH_RDELTA = 0.1
CHUNK_VALUES = 1 << 20  # weights fitted at a time: float32 temporaries of 4 MiB each


def searched_codes(
    weight: torch.Tensor,  # [N, K] float
    group_size: int,
    scale_dtype: torch.dtype,
    importance: torch.Tensor | None = None,  # [K] float >= 0; None: every column alike
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes ``[N, K]`` uint8 in 0..15, scales and mins ``[N, K // group_size]`` in
    ``scale_dtype`` (module docstring); ``K`` must be a multiple of ``group_size``."""
    num_rows, in_features = (int(size) for size in weight.shape)
    num_groups = in_features // group_size
    codes = torch.empty((num_rows, in_features), dtype=torch.uint8, device=weight.device)
    scales = torch.empty((num_rows, num_groups), dtype=scale_dtype, device=weight.device)
    mins = torch.empty_like(scales)
    rows_per_chunk = max(1, CHUNK_VALUES // max(1, in_features))
    for first in range(0, num_rows, rows_per_chunk):
        end = min(first + rows_per_chunk, num_rows)
        groups = weight[first:end].float().reshape(-1, group_size)  # [rows * num_groups, G]
        group_weights = (
            None
            if importance is None
            else importance.float().reshape(1, num_groups, group_size).expand(end - first, -1, -1)
        )
        group_codes, group_scales, group_mins = _search_groups(
            groups,
            scale_dtype,
            None if group_weights is None else group_weights.reshape(-1, group_size),
        )
        codes[first:end] = group_codes.reshape(end - first, in_features)
        scales[first:end] = group_scales.reshape(end - first, num_groups)
        mins[first:end] = group_mins.reshape(end - first, num_groups)
    return codes, scales, mins


def _search_groups(
    x: torch.Tensor,  # [B, G] float32
    scale_dtype: torch.dtype,
    weights: torch.Tensor | None,  # [B, G] float32 >= 0, or None: all ones
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # codes [B, G] uint8, scale, min [B]
    low = x.amin(dim=1, keepdim=True)  # [B, 1]
    value_range = x.amax(dim=1, keepdim=True) - low
    safe_range = torch.where(value_range == 0, torch.ones_like(value_range), value_range)
    codes = torch.empty_like(x)  # reused by every candidate (float32 codes)
    work = torch.empty_like(x)
    best_scale = _rounded(value_range / INT4_MAX_CODE, scale_dtype)  # min/max rounding
    best_min = _rounded(low, scale_dtype)
    best_error = _squared_error(x, best_scale, best_min, codes, weights)
    weighted_x = x if weights is None else x * weights
    sum_x = weighted_x.sum(dim=1, keepdim=True)
    sum_w = (
        torch.full_like(sum_x, x.shape[1]) if weights is None else weights.sum(dim=1, keepdim=True)
    )
    shifted = x - low  # [B, G], >= 0
    for step in range(SEARCH_STEPS + 1):
        iscale = (INT4_MAX_CODE + SEARCH_RMIN + SEARCH_RDELTA * step) / safe_range
        torch.mul(shifted, iscale, out=codes).round_().clamp_(0, INT4_MAX_CODE)
        scale, minimum = _least_squares(weighted_x, codes, sum_x, sum_w, weights, work)
        is_fitted = scale.isfinite() & minimum.isfinite()
        scale = _rounded(torch.where(is_fitted, scale.clamp(min=0), best_scale), scale_dtype)
        minimum = _rounded(torch.where(is_fitted, minimum, best_min), scale_dtype)
        error = _squared_error(x, scale, minimum, codes, weights)
        is_better = error < best_error
        best_error = torch.where(is_better, error, best_error)
        best_scale = torch.where(is_better, scale, best_scale)
        best_min = torch.where(is_better, minimum, best_min)
    nearest_codes(x, best_scale, best_min, codes)
    return (
        codes.to(torch.uint8),
        best_scale.squeeze(1).to(scale_dtype),
        best_min.squeeze(1).to(scale_dtype),
    )


def _least_squares(
    weighted_x: torch.Tensor,  # [B, G]: x, times the weights if any
    codes: torch.Tensor,  # [B, G] float32
    sum_x: torch.Tensor,  # [B, 1]: sum of weighted_x
    sum_w: torch.Tensor,  # [B, 1]: sum of the weights (G without)
    weights: torch.Tensor | None,  # [B, G]
    work: torch.Tensor,  # [B, G], overwritten
) -> tuple[torch.Tensor, torch.Tensor]:  # scale, min [B, 1]; NaN where the fit is singular
    """The ``scale, min`` minimizing ``sum w (codes * scale + min - x)^2`` for fixed codes."""
    weighted_codes = codes if weights is None else torch.mul(codes, weights, out=work)
    sum_c = weighted_codes.sum(dim=1, keepdim=True)
    sum_cx = torch.mul(codes, weighted_x, out=work).sum(dim=1, keepdim=True)
    weighted_codes = codes if weights is None else torch.mul(codes, weights, out=work)
    sum_cc = torch.mul(weighted_codes, codes, out=work).sum(dim=1, keepdim=True)
    determinant = sum_w * sum_cc - sum_c * sum_c  # 0 iff the (weighted) codes are all equal
    safe = torch.where(determinant > 0, determinant, torch.full_like(determinant, torch.nan))
    scale = (sum_w * sum_cx - sum_c * sum_x) / safe
    minimum = (sum_cc * sum_x - sum_c * sum_cx) / safe
    return scale, minimum


def nearest_codes(
    x: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Into ``out``: for each value the code whose ``code * scale + min`` is nearest."""
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    torch.sub(x, minimum, out=out).div_(safe).round_().clamp_(0, INT4_MAX_CODE)
    return out.mul_(scale != 0)  # a zero scale: every value is the minimum, code 0


def _squared_error(
    x: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor,
    work: torch.Tensor,
    weights: torch.Tensor | None,
) -> torch.Tensor:  # [B, 1]; ``work`` [B, G] overwritten
    residual = nearest_codes(x, scale, minimum, work).mul_(scale).add_(minimum).sub_(x)
    squared = residual.mul_(residual)
    return (squared if weights is None else squared.mul_(weights)).sum(dim=1, keepdim=True)


def _rounded(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # float32, on dtype's grid
    return values.to(dtype).float()
