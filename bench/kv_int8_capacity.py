"""The int8 KV cache's worth: at one fixed KV memory budget, the largest batch that fits
(sequences running at once, none preempted) with float32 KV against int8 KV, and the
offline throughput at that batch, side by side in one run.

    python -m bench.kv_int8_capacity                 # the shipped SmolLM2 Q4_1, 256 MiB of KV
    python -m bench.kv_int8_capacity --kv-cache-memory-bytes 134217728 --dequantize

Per arm, one engine with ``--kv-cache-memory-bytes`` and ``--kv-cache-dtype`` auto (float32)
or int8 (a float32 scale per block and KV head beside int8 values). The batch that fits is
``num_kv_blocks // blocks per sequence`` for sequences of ``--prompt-len`` +
``--output-len`` tokens (each keeps its whole KV to the end). Each repeat runs exactly that
many requests at ``max_num_seqs`` = that batch: the peak of running sequences and the
preemptions show they fit; throughput is their output tokens over the wall time, prefill
included, and over the decode steps alone (from the step after which every sequence has
its first token). Weights are the GGUF's blocks as stored (``--dequantize``: float32).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workloads import add_common_args, checkpoint, command_line

ARMS = {"float32 KV": "auto", "int8 KV": "int8"}


@dataclass(frozen=True)
class BatchRun:
    num_kv_blocks: int
    batch: int  # sequences that fit at once
    peak_running: int
    num_preemptions: int
    output_tokens_per_s: float  # the whole run's: prefill included
    decode_tokens_per_s: float  # once every sequence has its first token: decode steps only


def batch_that_fits(num_kv_blocks: int, block_size: int, seq_len: int) -> int:
    """Sequences of ``seq_len`` tokens that ``num_kv_blocks`` blocks hold at once."""
    return num_kv_blocks // -(-seq_len // block_size)


def run_arm(args: argparse.Namespace, model: str, kv_cache_dtype: str, seed: int) -> BatchRun:
    import torch

    from backend_engine import EngineConfig, SamplingParams
    from backend_engine.llm_engine import LLMEngine
    from backend_engine.worker.model_runner import kv_bytes_per_block
    from model_files.checkpoint import Checkpoint

    seq_len = args.prompt_len + args.output_len
    config = EngineConfig(
        model=model,
        dtype="float32",
        dequantize=args.dequantize,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        enable_prefix_caching=False,
        watermark=0.0,  # every block may hold a running sequence
        max_num_seqs=1,  # set below, once the blocks are known
        num_threads=args.num_threads or None,
        show_progress=False,
    )
    model_config = Checkpoint(model).check()
    block_bytes = kv_bytes_per_block(model_config, config.block_size, torch.float32, kv_cache_dtype)
    num_blocks = config.kv_cache_memory_bytes // block_bytes  # as LLMEngine derives it
    batch = batch_that_fits(num_blocks, config.block_size, seq_len)
    if batch < 1:
        raise SystemExit(f"{kv_cache_dtype} KV: not one {seq_len}-token sequence fits")
    engine = LLMEngine(replace(config, max_num_seqs=batch))
    if engine.kv_cache.num_blocks != num_blocks:
        raise RuntimeError(
            f"expected {num_blocks} KV blocks, the engine has {engine.kv_cache.num_blocks}"
        )
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(10, vocab - 16) for _ in range(args.prompt_len)]
        engine.add_request(f"kv-{i}", prompt, params)
    peak = 0
    start = time.perf_counter()
    decode_start, tokens_before_decode = 0.0, 0
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        peak = max(peak, len(running))
        is_full = len(running) == batch
        if not decode_start and is_full and all(r.num_output_tokens >= 1 for r in running):
            decode_start = time.perf_counter()
            tokens_before_decode = engine.num_generation_tokens
    end = time.perf_counter()
    num_outputs = batch * args.output_len
    return BatchRun(
        num_blocks,
        batch,
        peak,
        engine.scheduler.num_preemptions,
        num_outputs / (end - start),
        (num_outputs - tokens_before_decode) / (end - decode_start) if decode_start else 0.0,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=256 * 1024 * 1024)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dequantize", action="store_true", help="float32 weights")
    add_common_args(parser, default_model="smollm2")
    args = parser.parse_args()

    import torch

    model = checkpoint(args.model, args.size)
    runs: dict[str, list[BatchRun]] = {label: [] for label in ARMS}
    for seed in range(args.repeats):
        for label, kv_cache_dtype in ARMS.items():
            runs[label].append(run_arm(args, model, kv_cache_dtype, seed))

    print(f"command: {command_line()}")
    print(
        f"model: {model} ({'--dequantize, float32' if args.dequantize else 'blocks as stored'}"
        f"); KV budget {args.kv_cache_memory_bytes / 2**20:.0f} MiB; sequences of "
        f"{args.prompt_len} prompt + {args.output_len} output tokens; torch threads: "
        f"{torch.get_num_threads()}; repeats: {args.repeats}"
    )
    for label, values in runs.items():
        first = values[0]
        print(
            f"{label + ':':12} {first.num_kv_blocks} blocks -> batch {first.batch} "
            f"(peak running: {', '.join(str(r.peak_running) for r in values)}; preemptions: "
            f"{', '.join(str(r.num_preemptions) for r in values)})"
        )
        print(f"  whole run (prefill included): {_rates([r.output_tokens_per_s for r in values])}")
        print(f"  decode steps only:            {_rates([r.decode_tokens_per_s for r in values])}")
    fp, q = runs["float32 KV"], runs["int8 KV"]
    print(f"ratio of batch (int8 / float32 KV): {q[0].batch / fp[0].batch:.2f}x")
    for name, pick in (
        ("whole run", "output_tokens_per_s"),
        ("decode only", "decode_tokens_per_s"),
    ):
        ratio = statistics.median(getattr(r, pick) for r in q) / statistics.median(
            getattr(r, pick) for r in fp
        )
        print(f"ratio of throughput at that batch, {name} (int8 / float32 KV): {ratio:.2f}x")


def _rates(values: list[float]) -> str:
    return f"{statistics.median(values):7.1f} output tokens/s  (runs: " + (
        ", ".join(f"{x:.1f}" for x in values) + ")"
    )


if __name__ == "__main__":
    main()
