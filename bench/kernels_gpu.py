"""GPU kernel timings: the Triton paged-attention kernels against the PyTorch reference and
against ``scaled_dot_product_attention`` on KV already gathered into dense tensors, and the
quantized linears (int8, int4) against a float16 matmul (:mod:`bench.kernels_gpu_quant_linear`).

    python -m bench.kernels_gpu                        # fp16 + bf16, H200 peak 4800 GB/s
    python -m bench.kernels_gpu --dtype bf16 --peak-gbps 3350 --batches 1,64 --contexts 4096

Decode is memory bound: its figure of merit is the KV bytes read per second as a fraction of
the device's peak bandwidth (``--peak-gbps``). The grid is batch x context (all sequences
at the full context), skipping combinations whose cache (plus SDPA's gathered copy) does
not fit in free memory; the reference also gathers a float32 copy and is skipped (``-``)
when that does not fit. Times are medians over ``--repeats`` runs timed with CUDA events
after warm-up. ``err`` is the largest |Triton - SDPA| difference, a sanity check that also
covers cache pools whose element offsets overflow int32.
Exits 0 with a message where CUDA is absent.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workloads import command_line
from kernels import reference

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_MEMORY_HEADROOM = 0.8  # fraction of free memory a configuration may plan to use


@dataclass(frozen=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:  # K and V of one token, all KV heads
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).itemsize


@dataclass(frozen=True)
class PagedBatch:
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, blocks_per_seq] int32, shuffled block ids
    seq_lens: torch.Tensor  # [num_seqs] int32

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [b, num_kv_heads, L, d]
        num_seqs, seq_len = self.block_tables.shape[0], int(self.seq_lens[0])
        ids = self.block_tables.reshape(-1).long()

        def gather(cache: torch.Tensor) -> torch.Tensor:
            dense = cache.index_select(0, ids).view(num_seqs, -1, *cache.shape[2:])
            return dense[:, :seq_len].transpose(1, 2).contiguous()

        return gather(self.key_cache), gather(self.value_cache)


def make_paged_batch(shape: Shape, num_seqs: int, seq_len: int) -> PagedBatch:
    blocks_per_seq = -(-seq_len // shape.block_size)
    num_blocks = num_seqs * blocks_per_seq
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    key_cache = torch.randn(cache_shape, dtype=shape.dtype, device="cuda")
    value_cache = torch.randn(cache_shape, dtype=shape.dtype, device="cuda")
    ids = torch.randperm(num_blocks, device="cuda", dtype=torch.int64).to(torch.int32)
    tables = ids.view(num_seqs, blocks_per_seq)
    lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device="cuda")
    return PagedBatch(key_cache, value_cache, tables, lens)


def time_ms(fn: Callable[[], object], repeats: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` runs, each bracketed by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def fits(num_bytes: int) -> bool:
    free, _ = torch.cuda.mem_get_info()
    return num_bytes < _MEMORY_HEADROOM * free


def fmt(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.3f}"


def optional_time(fn: Callable[[], object], repeats: int, needed_bytes: int) -> float | None:
    if not fits(needed_bytes):
        return None
    try:
        return time_ms(fn, repeats)
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        torch.cuda.empty_cache()


def bench_decode(
    triton: ModuleType,
    shape: Shape,
    batches: list[int],
    contexts: list[int],
    args: argparse.Namespace,
) -> None:
    print(f"\n## decode  {_name(shape)}")
    print(
        f"{'batch':>6} {'context':>8} {'triton ms':>10} {'GB/s':>8} {'% peak':>7} "
        f"{'ref ms':>9} {'sdpa ms':>9} {'err':>9}"
    )
    for num_seqs in batches:
        for seq_len in contexts:
            kv_bytes = num_seqs * seq_len * shape.bytes_per_token
            if fits(2 * kv_bytes):  # the paged cache and SDPA's gathered copy
                print(decode_row(triton, shape, num_seqs, seq_len, args))
            else:
                print(f"{num_seqs:>6} {seq_len:>8}   skipped: {2 * kv_bytes / 2**30:.1f} GiB")
            torch.cuda.empty_cache()


def decode_row(
    triton: ModuleType, shape: Shape, num_seqs: int, seq_len: int, args: argparse.Namespace
) -> str:
    scale = shape.head_dim**-0.5
    kv_bytes = num_seqs * seq_len * shape.bytes_per_token
    batch = make_paged_batch(shape, num_seqs, seq_len)
    q = torch.randn(num_seqs, shape.num_heads, shape.head_dim, dtype=shape.dtype, device="cuda")
    paged = (q, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens)
    ms = time_ms(lambda: triton.paged_decode_attention(*paged, scale), args.repeats)
    out = triton.paged_decode_attention(*paged, scale)
    ref_ms = optional_time(
        lambda: reference.paged_decode_attention(*paged, scale), args.repeats, 3 * kv_bytes
    )
    k, v = batch.gathered()
    qd = q.unsqueeze(2)  # [b, num_heads, 1, d]

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(qd, k, v, scale=scale, enable_gqa=True)

    sdpa_ms = time_ms(sdpa, args.repeats)
    err = (out.float() - sdpa().squeeze(2).float()).abs().max().item()
    gbps = kv_bytes / (ms * 1e-3) / 1e9
    return (
        f"{num_seqs:>6} {seq_len:>8} {ms:>10.3f} {gbps:>8.0f} "
        f"{100 * gbps / args.peak_gbps:>6.1f}% {fmt(ref_ms):>9} {sdpa_ms:>9.3f} {err:>9.2e}"
    )


# (sequences, cached prefix, new tokens each): whole prompts, then chunks after a prefix
PREFILL_CASES = [(1, 0, 4096), (8, 0, 1024), (16, 0, 512), (4, 4096, 512)]


def bench_prefill(triton: ModuleType, shape: Shape, args: argparse.Namespace) -> None:
    """TFLOP/s counts only the causal (visible) query-key pairs."""
    print(f"\n## prefill  {_name(shape)}")
    print(
        f"{'seqs':>5} {'prefix':>7} {'chunk':>6} {'triton ms':>10} {'TFLOP/s':>8} "
        f"{'ref ms':>9} {'sdpa ms':>9} {'err':>9}"
    )
    for num_seqs, prefix, chunk in PREFILL_CASES:
        print(prefill_row(triton, shape, num_seqs, prefix, chunk, args))
        torch.cuda.empty_cache()


def prefill_row(
    triton: ModuleType,
    shape: Shape,
    num_seqs: int,
    prefix: int,
    chunk: int,
    args: argparse.Namespace,
) -> str:
    scale = shape.head_dim**-0.5
    seq_len = prefix + chunk
    batch = make_paged_batch(shape, num_seqs, seq_len)
    q = torch.randn(
        num_seqs * chunk, shape.num_heads, shape.head_dim, dtype=shape.dtype, device="cuda"
    )
    cu = torch.arange(0, num_seqs + 1, dtype=torch.int32, device="cuda") * chunk
    paged = (q, batch.key_cache, batch.value_cache, batch.block_tables, cu, batch.seq_lens)
    ms = time_ms(lambda: triton.paged_prefill_attention(*paged, scale), args.repeats)
    out = triton.paged_prefill_attention(*paged, scale)
    ref_ms = optional_time(
        lambda: reference.paged_prefill_attention(*paged, scale),
        args.repeats,
        4 * num_seqs * seq_len * shape.bytes_per_token,
    )
    k, v = batch.gathered()
    qd = q.view(num_seqs, chunk, shape.num_heads, shape.head_dim).transpose(1, 2)
    # query i of a chunk sits at position prefix + i: a bottom-right aligned causal mask
    mask = torch.ones(chunk, seq_len, dtype=torch.bool, device="cuda").tril(prefix)

    def sdpa() -> torch.Tensor:
        if prefix == 0:
            return F.scaled_dot_product_attention(
                qd, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
        return F.scaled_dot_product_attention(
            qd, k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )

    sdpa_ms = time_ms(sdpa, args.repeats)
    expected = sdpa().transpose(1, 2).reshape(out.shape)
    err = (out.float() - expected.float()).abs().max().item()
    # QK^T and PV: 4 * head_dim flops per (query head, visible key) pair
    pairs = num_seqs * (chunk * prefix + chunk * (chunk + 1) / 2)
    tflops = 4 * shape.head_dim * shape.num_heads * pairs / (ms * 1e-3) / 1e12
    return (
        f"{num_seqs:>5} {prefix:>7} {chunk:>6} {ms:>10.3f} {tflops:>8.1f} "
        f"{fmt(ref_ms):>9} {sdpa_ms:>9.3f} {err:>9.2e}"
    )


def bench_store_kv(triton: ModuleType, shape: Shape, args: argparse.Namespace) -> None:
    print(f"\n## store_kv  {_name(shape)}")
    print(f"{'tokens':>7} {'triton ms':>10} {'GB/s':>8} {'ref ms':>9}")
    for num_tokens in (256, 8192, 65536):
        print(store_kv_row(triton, shape, num_tokens, args))
        torch.cuda.empty_cache()


def store_kv_row(
    triton: ModuleType, shape: Shape, num_tokens: int, args: argparse.Namespace
) -> str:
    batch = make_paged_batch(shape, 1, 2 * num_tokens)
    kv_shape = (num_tokens, shape.num_kv_heads, shape.head_dim)
    key = torch.randn(kv_shape, dtype=shape.dtype, device="cuda")
    value = torch.randn(kv_shape, dtype=shape.dtype, device="cuda")
    slots = torch.randperm(2 * num_tokens, device="cuda")[:num_tokens]
    inputs = (key, value, batch.key_cache, batch.value_cache, slots)
    ms = time_ms(lambda: triton.store_kv(*inputs), args.repeats)
    ref_ms = time_ms(lambda: reference.store_kv(*inputs), args.repeats)
    gbps = 2 * num_tokens * shape.bytes_per_token / (ms * 1e-3) / 1e9  # read + write
    return f"{num_tokens:>7} {ms:>10.3f} {gbps:>8.0f} {ref_ms:>9.3f}"


def _name(shape: Shape) -> str:
    dtype = str(shape.dtype).removeprefix("torch.")
    return (
        f"{dtype}, {shape.num_heads} heads / {shape.num_kv_heads} KV heads, "
        f"head_dim {shape.head_dim}, block_size {shape.block_size}"
    )


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peak-gbps", type=float, default=4800.0, help="peak HBM GB/s (H200)")
    parser.add_argument("--dtype", choices=[*_DTYPES, "all"], default="all")
    parser.add_argument("--batches", type=_int_list, default=[1, 16, 64, 256])
    parser.add_argument("--contexts", type=_int_list, default=[512, 4096, 32768])
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--skip", choices=["store_kv", "decode", "prefill", "quant_linear"], action="append"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("CUDA not available: bench.kernels_gpu times the Triton kernels on a GPU; skipping.")
        return 0
    from kernels import triton_attention

    skip = set(args.skip or [])
    print(command_line())
    print(f"device: {torch.cuda.get_device_name()}  peak {args.peak_gbps:.0f} GB/s (--peak-gbps)")
    names = list(_DTYPES) if args.dtype == "all" else [args.dtype]
    for name in names:
        shape = Shape(
            args.num_heads, args.num_kv_heads, args.head_dim, args.block_size, _DTYPES[name]
        )
        torch.manual_seed(0)
        if "store_kv" not in skip:
            bench_store_kv(triton_attention, shape, args)
        if "decode" not in skip:
            bench_decode(triton_attention, shape, args.batches, args.contexts, args)
        if "prefill" not in skip:
            bench_prefill(triton_attention, shape, args)
    if "quant_linear" not in skip:
        from bench.kernels_gpu_quant_linear import bench_quant_linear

        torch.manual_seed(0)
        bench_quant_linear(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
