"""The quantized-linear kernel against ``gguf``'s dequantize + matmul, the referee.

Tolerances: ``DECODE_TO_FLOAT`` is the dequantized matmul up to summation order, so within
float32 rounding of ``|x| @ |W|.T``. ``INT8_ACTIVATIONS`` computes ``W @ x_hat``, x_hat being x
rounded to int8 per block of 32 with step ``d = max|x_block| / 127``: each element of x moves by
at most ``d / 2``, so ``|y - x @ W.T| <= (d / 2) @ |W|.T`` plus the same float rounding.
"""

from __future__ import annotations

import ctypes
import platform
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kernels import cpu_quant_linear
from kernels.cpu_build import (
    COMPILE_FLAGS,
    DISABLE_ENV,
    LINK_FLAGS,
    find_compiler,
    native_kernels_enabled,
)
from kernels.cpu_quant_linear import (
    BLOCK_BYTES,
    BLOCK_VALUES,
    SUPER_BLOCK_TYPES,
    GGUFBlockWeight,
    GGUFQuantType,
    QuantLinearMethod,
    dequantize,
    gathered_rows,
    quantized_linear,
)
from model_files.gguf_metadata import open_gguf

needs_native = pytest.mark.skipif(
    find_compiler() is None or not native_kernels_enabled(),
    reason=f"no C compiler, or {DISABLE_ENV}=reference",
)
ALL_TYPES = tuple(GGMLQuantizationType(int(kind)) for kind in GGUFQuantType)
TYPES = tuple(kind for kind in ALL_TYPES if BLOCK_VALUES[GGUFQuantType(kind)] == 32)
SUPER_TYPES = tuple(kind for kind in ALL_TYPES if GGUFQuantType(kind) in SUPER_BLOCK_TYPES)
METHODS = tuple(QuantLinearMethod)
ROUNDING = 1e-5  # float32 rounding over these sums, relative to |x| @ |W|.T
X_BLOCK = 32  # INT8_ACTIVATIONS rounds x per block of 32 values, whatever W's type
# where the super-block types keep their fp16 scales (gguf has no quantizer for them)
FP16_SCALE_OFFSETS = {
    GGMLQuantizationType.Q4_K: (0, 2),  # d, dmin
    GGMLQuantizationType.Q5_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),  # d, after ql, qh and the int8 scales
}


def random_blocks(
    kind: GGMLQuantizationType, out_features: int, in_features: int, seed: int
) -> np.ndarray:
    """Random bytes with finite fp16 scales: a valid block of any super-block type."""
    rng = np.random.default_rng(seed)
    per_row = in_features // BLOCK_VALUES[GGUFQuantType(kind)]
    shape = (out_features, per_row, BLOCK_BYTES[GGUFQuantType(kind)])
    blocks = rng.integers(0, 256, shape, dtype=np.uint8)
    for offset in FP16_SCALE_OFFSETS[kind]:
        scale = rng.uniform(0.0, 0.01, (out_features, per_row, 1)).astype(np.float16)
        blocks[:, :, offset : offset + 2] = scale.view(np.uint8)
    return blocks.reshape(out_features, -1)


def quantized_case(
    kind: GGMLQuantizationType, out_features: int, in_features: int, seed: int = 0
) -> tuple[GGUFBlockWeight, torch.Tensor]:
    """A random weight quantized by ``gguf`` (random blocks for the types it cannot quantize),
    and ``gguf``'s dequantization of it."""
    if kind in FP16_SCALE_OFFSETS:
        blocks = random_blocks(kind, out_features, in_features, seed)
    else:
        rng = np.random.default_rng(seed)
        dense = rng.standard_normal((out_features, in_features), dtype=np.float32)
        dense += rng.uniform(-1, 1, (out_features, 1)).astype(np.float32)  # Q4_1's min matters
        blocks = quants.quantize(dense, kind)
    weight = GGUFBlockWeight.from_blocks(torch.from_numpy(blocks), int(kind))
    return weight, torch.from_numpy(quants.dequantize(blocks, kind))


def assert_close(
    y: torch.Tensor, x: torch.Tensor, reference: torch.Tensor, method: QuantLinearMethod
) -> None:
    want = x.double() @ reference.double().T
    scale = x.double().abs() @ reference.double().abs().T
    bound = ROUNDING * scale + 1e-6
    if method != QuantLinearMethod.DECODE_TO_FLOAT:
        # int8: half a step of max|x_block| / 127; split: a step 256 times finer, whole where
        # the lo part's clamp to +-127 bites (half a step elsewhere)
        steps = 127 * 2 if method != QuantLinearMethod.INT8_SPLIT_ACTIVATIONS else 127 * 256
        blocks = x.double().reshape(x.shape[0], -1, X_BLOCK)
        half_step = blocks.abs().amax(dim=2, keepdim=True) / steps  # [rows, blocks, 1]
        half_step = half_step.expand_as(blocks).reshape(x.shape)
        bound = bound + half_step @ reference.double().abs().T
    error = (y.double() - want).abs()
    assert y.dtype == torch.float32
    assert bool((error <= bound).all()), f"max error {error.max():.3g}, bound {bound.min():.3g}"


def test_dequantize_matches_gguf() -> None:
    for kind in ALL_TYPES:
        in_features = 96 if kind in TYPES else 768
        weight, reference = quantized_case(kind, 7, in_features)
        assert torch.equal(dequantize(weight), reference), kind.name


@needs_native
def test_native_library_builds_here() -> None:
    assert cpu_quant_linear.is_available()


@needs_native
def test_int8_method_uses_vnni_where_the_cpu_has_it() -> None:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    has_vnni = {"avx512_vnni", "avx512vl"} <= flags or "avx_vnni" in flags
    if not has_vnni and "avx2" not in flags:
        pytest.skip("neither VNNI nor AVX2 here")
    assert cpu_quant_linear.int8_instruction_set() == ("vnni" if has_vnni else "avx2")


@needs_native
@pytest.mark.parametrize("kind", TYPES, ids=lambda kind: kind.name)
@pytest.mark.parametrize("method", METHODS, ids=lambda method: method.name)
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 130])  # 130: past the kernel's 64-row chunks
def test_matches_dequantized_matmul(
    kind: GGMLQuantizationType, method: QuantLinearMethod, rows: int
) -> None:
    for out_features, in_features in ((1, 32), (37, 96), (131, 320)):
        weight, reference = quantized_case(kind, out_features, in_features, seed=rows)
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
        assert_close(quantized_linear(x, weight, method), x, reference, method)


@needs_native
@pytest.mark.parametrize("kind", [*SUPER_TYPES, *TYPES], ids=lambda kind: kind.name)
@pytest.mark.parametrize("method", METHODS, ids=lambda method: method.name)
@pytest.mark.parametrize("rows", [1, 3, 5, 67])  # 67: tiles of 4 and a remainder of 3
def test_matches_dequantized_matmul_whole_super_blocks(
    kind: GGMLQuantizationType, method: QuantLinearMethod, rows: int
) -> None:
    for out_features, in_features in ((1, 256), (37, 512), (103, 768)):
        weight, reference = quantized_case(kind, out_features, in_features, seed=rows)
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
        assert_close(quantized_linear(x, weight, method), x, reference, method)


# The library as built here takes the widest path this CPU has; these flags take the others.
NARROWER_INSTRUCTION_SETS = {
    "avx2": ("-mno-avx512vnni", "-mno-avxvnni"),  # maddubs + madd instead of VNNI
    "plain C": ("-mno-avx2", "-mno-fma", "-mno-f16c", "-mno-avxvnni"),  # no intrinsics at all
}


@needs_native
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 instruction-set flags")
@pytest.mark.parametrize("instruction_set", list(NARROWER_INSTRUCTION_SETS))
def test_narrower_instruction_sets(tmp_path: Path, instruction_set: str) -> None:
    """The int8 paths a CPU without VNNI (or without AVX2) runs, built here with those
    instructions switched off, against the same referee."""
    cpu_flags = set(Path("/proc/cpuinfo").read_text().split())
    if instruction_set == "avx2" and not {"avx2", "fma"} <= cpu_flags:
        pytest.skip("no AVX2 here")
    library_path, compiler = tmp_path / "quant_linear.so", find_compiler()
    assert compiler is not None
    flags = (*COMPILE_FLAGS, *NARROWER_INSTRUCTION_SETS[instruction_set])
    subprocess.run(
        [
            compiler,
            *flags,
            "-c",
            "-o",
            str(tmp_path / "quant_linear.o"),
            str(cpu_quant_linear.SOURCE),
        ],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [compiler, *LINK_FLAGS, "-o", str(library_path), str(tmp_path / "quant_linear.o"), "-lm"],
        check=True,
        capture_output=True,
    )
    library = ctypes.CDLL(str(library_path))
    assert ("plain C", "avx2", "vnni")[library.tollway_quant_linear_int8_isa()] == instruction_set
    kernel = library.tollway_quant_linear
    kernel.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    kernel.argtypes += [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_int]

    def run(weight: GGUFBlockWeight, x: torch.Tensor, method: int, threads: int) -> torch.Tensor:
        y = torch.empty(x.shape[0], weight.out_features)
        status = kernel(
            weight.blocks.data_ptr(), int(weight.quant_type), x.data_ptr(), y.data_ptr(),
            x.shape[0], weight.out_features, weight.in_features, method, threads,
        )  # fmt: skip
        assert status == 0
        return y

    for kind in ALL_TYPES:
        weight, reference = quantized_case(kind, 37, 512, seed=5)
        x = torch.randn(5, 512, generator=torch.Generator().manual_seed(5))
        for method in METHODS:
            y = run(weight, x, int(method), 2)
            assert_close(y, x, reference, method)
            assert torch.equal(run(weight, x, int(method), 1), y), kind.name


@needs_native
def test_only_the_int8_method_rounds_x() -> None:
    """The float method is the dequantized matmul to rounding; the int8 one is measurably not
    (so the tests above see the path they name)."""
    weight, reference = quantized_case(GGMLQuantizationType.Q8_0, 64, 256)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
    want = x.double() @ reference.double().T

    def error(method: QuantLinearMethod) -> float:
        return (quantized_linear(x, weight, method).double() - want).abs().max().item()

    assert error(QuantLinearMethod.DECODE_TO_FLOAT) < 1e-4
    assert 1e-3 < error(QuantLinearMethod.INT8_ACTIVATIONS) < 1.0


@needs_native
@pytest.mark.parametrize("kind", ALL_TYPES, ids=lambda kind: kind.name)
@pytest.mark.parametrize("method", METHODS, ids=lambda method: method.name)
def test_bit_identical_for_any_thread_count(
    kind: GGMLQuantizationType, method: QuantLinearMethod
) -> None:
    in_features = 192 if kind in TYPES else 512
    weight, _ = quantized_case(kind, 101, in_features)
    x = torch.randn(9, in_features, generator=torch.Generator().manual_seed(2))
    one = quantized_linear(x, weight, method, num_threads=1)
    for threads in (2, 3, 7, 64, 200):
        assert torch.equal(quantized_linear(x, weight, method, num_threads=threads), one)


@needs_native
@pytest.mark.parametrize(
    "kind", [GGMLQuantizationType.Q4_1, *SUPER_TYPES], ids=lambda kind: kind.name
)
def test_zero_rows_and_zero_activations(kind: GGMLQuantizationType) -> None:
    in_features = BLOCK_VALUES[GGUFQuantType(kind)] * 2
    weight, _ = quantized_case(kind, 5, in_features)
    assert quantized_linear(torch.empty(0, in_features), weight).shape == (0, 5)
    zeros = torch.zeros(2, in_features)
    for method in METHODS:  # an all-zero block of x has scale 0: no division by it
        assert torch.equal(quantized_linear(zeros, weight, method), torch.zeros(2, 5))


def test_rejects_what_the_kernel_cannot_read() -> None:
    blocks = torch.zeros(4, 34, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not one of"):
        GGUFBlockWeight.from_blocks(blocks, 0)  # F32
    with pytest.raises(ValueError, match="whole blocks of 18"):
        GGUFBlockWeight.from_blocks(blocks, int(GGUFQuantType.Q4_0))
    with pytest.raises(ValueError, match="uint8"):
        GGUFBlockWeight.from_blocks(blocks.float(), int(GGUFQuantType.Q8_0))
    weight = GGUFBlockWeight.from_blocks(blocks, int(GGUFQuantType.Q8_0))
    assert (weight.out_features, weight.in_features) == (4, 32)
    with pytest.raises(ValueError, match=r"\[rows, 32\]"):
        quantized_linear(torch.zeros(2, 64), weight)
    with pytest.raises(ValueError, match="float32"):
        quantized_linear(torch.zeros(2, 32, dtype=torch.float64), weight)


@pytest.mark.parametrize(
    ("kind", "block_bytes"),
    [(GGUFQuantType.Q4_K, 144), (GGUFQuantType.Q5_K, 176), (GGUFQuantType.Q6_K, 210)],
)
def test_super_block_types_need_whole_256_value_blocks(
    kind: GGUFQuantType, block_bytes: int
) -> None:
    assert (BLOCK_BYTES[kind], BLOCK_VALUES[kind]) == (block_bytes, 256)
    for row_bytes in (block_bytes // 8, block_bytes * 3 // 2):  # 32 and 384 values' worth
        with pytest.raises(ValueError, match="in_features must be a multiple of 256"):
            GGUFBlockWeight.from_blocks(torch.zeros(3, row_bytes, dtype=torch.uint8), int(kind))
    weight = GGUFBlockWeight.from_blocks(torch.zeros(3, 2 * block_bytes, dtype=torch.uint8), kind)
    assert (weight.out_features, weight.in_features) == (3, 512)


@needs_native
def test_kernel_checks_the_super_block_size_itself() -> None:
    """The C entry point rejects in_features % 256 != 0 for a super-block type even when the
    Python check is bypassed (the whole-step decoder calls the C code directly)."""
    blocks = torch.zeros(3, 2 * 144, dtype=torch.uint8)
    weight = GGUFBlockWeight(blocks, GGUFQuantType.Q4_K, out_features=3, in_features=288)
    with pytest.raises(ValueError, match="rejected"):
        quantized_linear(torch.zeros(1, 288), weight)


@needs_native
def test_falls_back_to_dequantize_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    weight, reference = quantized_case(GGMLQuantizationType.Q4_0, 33, 64)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    monkeypatch.setenv(DISABLE_ENV, "reference")
    cpu_quant_linear.native_library.cache_clear()
    try:
        assert not cpu_quant_linear.is_available()
        assert torch.equal(quantized_linear(x, weight), x @ reference.T)
    finally:
        monkeypatch.delenv(DISABLE_ENV)
        cpu_quant_linear.native_library.cache_clear()
    assert cpu_quant_linear.is_available()


@needs_native
@pytest.mark.parametrize("method", METHODS, ids=lambda method: method.name)
def test_shipped_smollm2_tensors(smollm2_gguf: Path, method: QuantLinearMethod) -> None:
    """A Q4_1 MLP weight and the Q8_0 embedding table (its first rows) of the shipped file."""
    reader = open_gguf(smollm2_gguf)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    x = torch.randn(5, 1536, generator=torch.Generator().manual_seed(4))
    for name, rows, features in (
        ("blk.0.ffn_down.weight", 576, 1536),
        ("token_embd.weight", 300, 576),
    ):
        tensor = tensors[name]
        blocks = np.asarray(tensor.data[:rows])  # [rows, bytes per row]
        reference = torch.from_numpy(quants.dequantize(blocks, tensor.tensor_type))
        weight = GGUFBlockWeight.from_blocks(
            torch.from_numpy(blocks.copy()), int(tensor.tensor_type)
        )
        assert (weight.out_features, weight.in_features) == (rows, features)
        assert_close(
            quantized_linear(x[:, :features], weight, method), x[:, :features], reference, method
        )


@needs_native
@pytest.mark.parametrize("kind", ALL_TYPES, ids=lambda kind: kind.name)
def test_widened_rows_equal_the_dequantized_weight(kind: GGMLQuantizationType) -> None:
    in_features = 96 if kind in TYPES else 512
    weight, reference = quantized_case(kind, 37, in_features)
    assert torch.equal(cpu_quant_linear.widened(weight), reference)
    assert torch.equal(cpu_quant_linear.widened(weight, 5, 30, num_threads=3), reference[5:30])
    with pytest.raises(ValueError, match="not rows of the weight"):
        cpu_quant_linear.widened(weight, 30, 5)


@needs_native
@pytest.mark.parametrize("rows", [cpu_quant_linear.WIDEN_MIN_ROWS, 300])
def test_many_rows_run_a_float32_matmul_on_widened_slices(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    weight, reference = quantized_case(GGMLQuantizationType.Q4_1, 103, 96)
    monkeypatch.setattr(cpu_quant_linear, "WIDEN_SLICE_BYTES", 96 * 4 * 10)  # 10-row slices
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    y = quantized_linear(x, weight)
    assert y.is_contiguous()
    assert_close(y, x, reference, QuantLinearMethod.DECODE_TO_FLOAT)


@pytest.mark.parametrize("kind", ALL_TYPES, ids=lambda kind: kind.name)
@pytest.mark.parametrize("tiled", [False, True], ids=["file layout", "tiled"])
def test_gathered_rows_are_the_dequantized_rows(kind: GGMLQuantizationType, tiled: bool) -> None:
    """An embedding's tokens, repeated, in any order, from either layout: gguf's values."""
    weight, want = quantized_case(kind, 48, 256, seed=3)
    if tiled:
        if not weight.can_tile():
            pytest.skip(f"{kind.name} is not tiled here")
        weight = weight.tiled_for_kernel()
    rows = torch.tensor([47, 0, 17, 17, 31, 16, 15])
    assert torch.equal(gathered_rows(weight, rows), want[rows])
    assert gathered_rows(weight, rows[:0]).shape == (0, 256)


@needs_native
@pytest.mark.parametrize("row", [-1, 48])
def test_gathering_a_row_outside_the_weight_is_refused(row: int) -> None:
    weight, _ = quantized_case(GGMLQuantizationType.Q8_0, 48, 64)
    with pytest.raises(IndexError, match="48 rows"):
        gathered_rows(weight, torch.tensor([0, row]))
