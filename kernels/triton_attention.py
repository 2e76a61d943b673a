"""The Triton implementation of the paged-attention kernels (CUDA tensors).

:mod:`kernels.dispatch` loads this module for CUDA tensors; it exposes the same three
functions, with the same signatures, as :mod:`kernels.reference`. Each lives in its own
module: :mod:`kernels.triton_store_kv`, :mod:`kernels.triton_decode` (split-KV decoding with
a log-sum-exp merge) and :mod:`kernels.triton_prefill` (flash attention over chunks).

On a machine without a GPU the kernels run under Triton's interpreter when
``TRITON_INTERPRET=1`` is set before this module is imported (the tests do that).
"""

from __future__ import annotations

from kernels.triton_decode import paged_decode_attention
from kernels.triton_prefill import paged_prefill_attention
from kernels.triton_store_kv import store_kv

__all__ = ["paged_decode_attention", "paged_prefill_attention", "store_kv"]
