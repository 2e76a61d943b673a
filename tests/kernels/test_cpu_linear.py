"""The native few-rows linear kernel against ``x @ W.T + b``, and its fallbacks."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from kernels import cpu_linear
from kernels.cpu_build import DISABLE_ENV, find_compiler, native_kernels_enabled

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN"
)
needs_compiler = pytest.mark.skipif(
    find_compiler() is None or not native_kernels_enabled(),
    reason=f"no C compiler, or {DISABLE_ENV}=reference",
)
# oneDNN packs in the kernel's layout with AVX-512; elsewhere everything runs oneDNN.
needs_native = pytest.mark.skipif(
    not cpu_linear.is_available(), reason="no compiler, or oneDNN packs another layout here"
)


def has_avx512() -> bool:
    try:
        return " avx512f " in Path("/proc/cpuinfo").read_text() + " "
    except OSError:
        return False


def packed_case(
    out_features: int, in_features: int, bias: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor | None, cpu_linear.BlockedWeight]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    blocked = cpu_linear.blocked_weight(torch.ops.mkldnn._reorder_linear_weight(weight, 64))
    assert blocked is not None
    return weight, b, blocked


def expected(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ weight.double().T
    return (y if bias is None else y + bias.double()).float()


@needs_compiler
def test_native_library_builds_here() -> None:
    assert cpu_linear.native_library() is not None


@needs_compiler
@pytest.mark.skipif(not has_avx512(), reason="oneDNN packs another layout without AVX-512")
def test_native_path_is_available_on_avx512() -> None:
    assert cpu_linear.is_available()


@needs_native
@pytest.mark.parametrize("num_rows", range(1, cpu_linear.MAX_ROWS + 1))
@pytest.mark.parametrize(
    ("out_features", "in_features"),
    [(7, 33), (129, 50), (64, 512), (201, 1100)],  # odd N, K % 32 != 0, K over one chunk
)
@pytest.mark.parametrize("bias", [False, True])
def test_native_linear_matches_matmul(
    num_rows: int, out_features: int, in_features: int, bias: bool
) -> None:
    weight, b, blocked = packed_case(out_features, in_features, bias, seed=num_rows)
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(1))
    got = cpu_linear.small_batch_linear(x, blocked, b)
    assert got.shape == (num_rows, out_features)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected(x, weight, b), atol=2e-4, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("num_rows", [1, 7])
@pytest.mark.parametrize(("out_features", "in_features"), [(576, 96), (201, 40)])
def test_threads_split_the_outputs_without_changing_a_bit(
    num_rows: int, out_features: int, in_features: int
) -> None:
    """Threads share the outputs in 16-wide slices, so a thread may start or stop inside a
    packed block (576 outputs are 9 blocks): every output is the same sum in the same order
    whatever the thread count."""
    _, b, blocked = packed_case(out_features, in_features, bias=True)
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(2))
    library = cpu_linear.native_library()
    assert library is not None
    results = []
    for threads in (1, 2, 3, 5, 8):
        y = torch.empty(num_rows, out_features)
        status = library.tollway_small_batch_linear(
            blocked.address,
            x.data_ptr(),
            b.data_ptr() if b is not None else None,
            y.data_ptr(),
            num_rows,
            out_features,
            in_features,
            blocked.k_padded,
            threads,
        )
        assert status == 0
        results.append(y)
    assert all(torch.equal(y, results[0]) for y in results[1:])


@needs_native
def test_native_linear_reads_strided_rows_and_empty_batches() -> None:
    weight, b, blocked = packed_case(96, 40, bias=True)
    x = torch.randn(3, 80)[:, ::2]
    assert not x.is_contiguous()
    torch.testing.assert_close(
        cpu_linear.small_batch_linear(x, blocked, b), expected(x, weight, b), atol=1e-4, rtol=1e-5
    )
    assert cpu_linear.small_batch_linear(x[:0], blocked, b).shape == (0, 96)


@needs_native
def test_more_rows_than_the_kernel_takes_run_onednn() -> None:
    weight, b, blocked = packed_case(70, 48, bias=True)
    x = torch.randn(cpu_linear.MAX_ROWS + 5, 48)
    torch.testing.assert_close(
        cpu_linear.small_batch_linear(x, blocked, b), expected(x, weight, b), atol=1e-4, rtol=1e-5
    )


@needs_native
def test_the_kernel_refuses_bad_arguments() -> None:
    library = cpu_linear.native_library()
    assert library is not None
    _, _, blocked = packed_case(64, 32, bias=False)
    x = torch.randn(cpu_linear.MAX_ROWS + 1, 32)
    y = torch.empty(cpu_linear.MAX_ROWS + 1, 64)
    call = library.tollway_small_batch_linear

    def status(num_rows: int, k_padded: int, num_threads: int = 1) -> int:
        args = (blocked.address, x.data_ptr(), None, y.data_ptr(), num_rows, 64, 32, k_padded)
        return int(call(*args, num_threads))

    assert status(cpu_linear.MAX_ROWS, 32) == 0
    assert status(cpu_linear.MAX_ROWS + 1, 32) != 0  # more rows than it holds
    assert status(-1, 32) != 0
    assert status(1, 31) != 0  # k_padded below K
    assert status(1, 32, num_threads=0) != 0
    assert call(blocked.address, None, None, y.data_ptr(), 1, 64, 32, 32, 1) != 0  # no x


@needs_native
def test_weights_in_another_layout_are_not_blocked() -> None:
    """One output feature stays plain in oneDNN; bfloat16 packs in pairs: both oneDNN only."""
    plain = torch.ops.mkldnn._reorder_linear_weight(torch.randn(1, 64), 64)
    assert cpu_linear.blocked_weight(plain) is None
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        bf16 = torch.randn(64, 64, dtype=torch.bfloat16)
        assert cpu_linear.blocked_weight(torch.ops.mkldnn._reorder_linear_weight(bf16, 64)) is None


@needs_native
def test_blocked_weight_reads_the_packed_buffer_in_place() -> None:
    """No second copy: the kernel's address is oneDNN's buffer."""
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(100, 70), 64)
    blocked = cpu_linear.blocked_weight(packed)
    assert blocked is not None
    assert blocked.packed is packed
    assert blocked.address == torch.ops.mkldnn.data_ptr(packed)
    assert (blocked.out_features, blocked.in_features, blocked.k_padded) == (100, 70, 80)
    first = ctypes.c_float.from_address(blocked.address).value
    assert first == packed.to_dense()[0, 0].item()


@needs_native
def test_native_kernels_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    weight, b, blocked = packed_case(130, 45, bias=True)  # made while native was on
    x = torch.randn(2, 45)
    monkeypatch.setenv(DISABLE_ENV, "reference")
    cpu_linear.native_library.cache_clear()
    try:
        assert cpu_linear.native_library() is None
        assert not cpu_linear.is_available()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        assert cpu_linear.blocked_weight(packed) is None
        want = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
        assert torch.equal(cpu_linear.small_batch_linear(x, blocked, b), want)  # oneDNN's
    finally:
        monkeypatch.delenv(DISABLE_ENV)
        cpu_linear.native_library.cache_clear()
    assert cpu_linear.is_available()
