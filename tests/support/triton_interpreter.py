"""Run Triton kernels under Triton's interpreter when there is no GPU.

Triton reads ``TRITON_INTERPRET`` when it is first imported and when a kernel is defined, so
the conftests of the folders whose tests reach the kernels (``tests/backend_engine``,
``tests/kernels``) call this before anything there can import triton (or transformers, which
probes for it). The root conftest does not: it must not import torch, so that the gateway's
and the policies' tests run where torch is not installed.
"""

from __future__ import annotations

import os


def use_interpreter_without_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
