"""GPTQ: int4 codes chosen against a layer's inputs, not only its weights (Frantar et al., 2022).

Round-to-nearest makes each weight's error as small as it can on its own. What matters is the
layer's output error ``||W X - Q X||^2`` over real inputs ``X`` ``[K, num_tokens]``, which is
``sum_n (w_n - q_n) H (w_n - q_n)^T`` with ``H = 2 X X^T / num_tokens`` ``[K, K]``, the same for
every output row ``n``. GPTQ quantizes the columns in order and, after each, spreads its
rounding error over the columns not yet quantized, through the inverse Hessian, so that they
absorb it (the Optimal Brain Surgeon update)::

    H += damp_ratio * mean(diag H) * I          (dampened: X X^T is often singular)
    U = cholesky(H^-1, upper)                   rows of U: the inverse Hessian's updates
    for column k = 0..K-1:
        at a group's first column: its (scale, min) per row, searched on the *updated* weights
            of the group, each column weighted by diag(H) (the inputs' mean square)
        q_k = nearest grid point of w_k
        w_j -= (w_k - q_k) / U[k, k] * U[k, j]  for every j > k

done a block of ``BLOCK_COLUMNS`` columns at a time (the "lazy batch" update: inside the block
rank-1 updates, the rest of the matrix once per block). The result is the same format as
round-to-nearest (codes 0..15, a float16-rounded scale and minimum per group, contiguous
groups), so every kernel and the GGUF writer read it unchanged. Rows are independent given
``H``: a fused q/k/v matrix quantized at once is the same as its three parts one by one.

Deterministic: no randomness, and the same float operations for the same inputs.
"""

from __future__ import annotations

import torch

from kernels.int4_quantization import nearest_codes, searched_codes

BLOCK_COLUMNS = 128  # columns updated lazily together (GPTQ's block size); a multiple of groups
DEFAULT_DAMP_RATIO = 0.01  # of the Hessian's mean diagonal, added to the diagonal


def gptq_codes(
    weight: torch.Tensor,  # [N, K] float
    hessian: torch.Tensor,  # [K, K] float: 2 X X^T / num_tokens of the layer's inputs
    group_size: int,
    scale_dtype: torch.dtype,
    damp_ratio: float = DEFAULT_DAMP_RATIO,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes ``[N, K]`` uint8 in 0..15, scales and mins ``[N, K // group_size]`` in
    ``scale_dtype``, the ``int4_codes`` format, chosen by GPTQ (module docstring)."""
    num_rows, in_features = (int(size) for size in weight.shape)
    if tuple(hessian.shape) != (in_features, in_features):
        raise ValueError(
            f"the Hessian must be [{in_features}, {in_features}] for this weight, "
            f"got {list(hessian.shape)}"
        )
    if in_features % group_size or BLOCK_COLUMNS % group_size:
        raise ValueError(f"in_features {in_features} must be whole groups of {group_size}")
    if not damp_ratio > 0:
        raise ValueError(f"damp_ratio must be positive, got {damp_ratio}")
    w = weight.detach().float().clone()  # [N, K], updated as columns are quantized
    h = hessian.detach().float().clone()  # [K, K]
    diagonal = torch.diagonal(h)
    diagonal[diagonal == 0] = 1.0  # an input never seen: its column updates nothing
    diagonal += damp_ratio * float(diagonal.mean())
    importance = diagonal.clone()  # [K]: the inputs' mean square, dampened
    upper = _inverse_cholesky_upper(h)  # [K, K]
    codes = torch.empty((num_rows, in_features), dtype=torch.uint8, device=weight.device)
    num_groups = in_features // group_size
    scales = torch.empty((num_rows, num_groups), dtype=scale_dtype, device=weight.device)
    mins = torch.empty_like(scales)
    scale = minimum = torch.empty(0)
    column_codes = torch.empty((num_rows, 1), device=weight.device)
    for first in range(0, in_features, BLOCK_COLUMNS):
        end = min(first + BLOCK_COLUMNS, in_features)
        block = w[:, first:end]  # [N, B], a view: updated in place
        errors = torch.empty_like(block)  # [N, B]: each column's scaled error
        block_upper = upper[first:end, first:end]  # [B, B]
        for i in range(end - first):
            column = first + i
            if column % group_size == 0:
                group = column // group_size
                _, group_scales, group_mins = searched_codes(
                    block[:, i : i + group_size],
                    group_size,
                    scale_dtype,
                    importance[column : column + group_size],
                )
                scales[:, group : group + 1], mins[:, group : group + 1] = group_scales, group_mins
                scale, minimum = group_scales.float(), group_mins.float()  # [N, 1] each
            value = block[:, i : i + 1]  # [N, 1]
            nearest_codes(value, scale, minimum, column_codes)
            codes[:, column] = column_codes[:, 0].to(torch.uint8)
            error = (value - (column_codes * scale + minimum)) / block_upper[i, i]  # [N, 1]
            block[:, i:] -= error @ block_upper[i : i + 1, i:]
            errors[:, i : i + 1] = error
        w[:, end:] -= errors @ upper[first:end, end:]
    return codes, scales, mins


def _inverse_cholesky_upper(hessian: torch.Tensor) -> torch.Tensor:  # [K, K] upper triangular
    """``U`` with ``U^T U = H^-1``: row ``k`` of ``U / U[k, k]`` is how column ``k``'s error
    moves the columns after it once the columns before it are fixed."""
    lower = torch.linalg.cholesky(hessian.double())
    inverse = torch.cholesky_inverse(lower)
    return torch.linalg.cholesky(inverse, upper=True).to(hessian.dtype)
