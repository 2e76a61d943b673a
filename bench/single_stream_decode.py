"""Single-stream decode (batch 1), two arms of ours against each one's memory roofline, with
llama.cpp's ``llama-server`` (one slot) on the same GGUF beside them, in one run.

    python -m bench.single_stream_decode                   # the shipped SmolLM2 Q4_1 GGUF
    python -m bench.single_stream_decode --gguf FILE.gguf --repeats 5

Our arms, one engine each in this process:

- ``tollway (GGUF blocks as stored)``: the file's quantized blocks, read by the CPU kernels;
- ``tollway --dequantize (float32)``: the blocks widened to float32 at load (the old path).

One decoding sequence reads every weight once per token, so its speed is bounded by
memory bandwidth: ``roofline = bandwidth / bytes read per token``, per arm. Each repeat
measures, back to back: the bandwidth (a large ``torch`` copy, read + written bytes over
the time, best of a few, on the engine's threads, on huge pages as the engine's GGUF blocks
and KV cache are; the same copy on the 4 KiB pages PyTorch allocates is printed beside it:
alternated 12-20 times it was 1.04-1.10x slower, though back to back either may read faster
on a noisy host); each arm's decode rate (one greedy request, ``--output-len`` tokens after
a ``--prompt-len`` prompt, the engine steps after the prefill step, sampling included);
llama.cpp's own ``predicted_per_second`` on the same prompt with flash attention off and on
(its best is compared). Our engines serve as they would online: greedy steps in decode runs
(``--decode-run-steps 1`` turns them off).

Bytes per token are what the arm's model holds and a token reads (:func:`weight_bytes_read`):
every linear's weight as stored (a quantized one's blocks, a float one's float32), the
output projection over the whole vocabulary included, and the norms; the embedding table
is left out (a token reads one row). Plus the KV cache read at the mean context. The
fraction ours / roofline is computed per repeat against that repeat's bandwidth; medians
are quoted (target >= 80% for the quantized arm, and >= 1.0x llama.cpp's best).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.llamacpp_server import (
    LlamaServer,
    add_llamacpp_args,
    llamacpp_arm,
    missing_binary_note,
)
from bench.workloads import add_common_args, checkpoint, command_line, shipped_gguf

if TYPE_CHECKING:
    from backend_engine import LLM
    from backend_engine.worker.model_runner import ModelRunner

_COPY_BYTES = 1 << 30  # per buffer: far beyond any cache here (L3 is up to a few hundred MB)
_COPY_TRIES = 3
# Our arms: label -> --dequantize.
ARMS = {"tollway (GGUF blocks as stored)": False, "tollway --dequantize (float32)": True}


def copy_bandwidth(num_bytes: int = _COPY_BYTES, huge_pages: bool = False) -> float:
    """Bytes per second a large ``torch`` copy moves (read + written), best of a few; on
    huge pages (:mod:`kernels.huge_pages`, as the engine's weights and KV cache) or on the
    4 KiB pages PyTorch allocates."""
    from kernels.huge_pages import huge_page_empty

    if huge_pages:
        src = huge_page_empty((num_bytes // 4,), torch.float32).fill_(1.0)
        dst = huge_page_empty((num_bytes // 4,), torch.float32)
    else:
        src = torch.ones(num_bytes // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(_COPY_TRIES))
    return 2 * num_bytes / best


def weight_bytes_read(model: nn.Module) -> int:
    """The weight bytes one decode step of one sequence reads: every linear as the model
    holds it (quantized blocks, or ``in x out`` float elements however packed), the output
    projection too (tied or not), and every other parameter (norms); each buffer once, and
    no embedding table (a token reads one row of it)."""
    from backend_engine.models.packed_linear import PackedLinear
    from backend_engine.models.quantized_linear import QuantizedEmbedding, QuantizedLinear

    seen: set[int] = set()
    total = 0

    def count(tensor: torch.Tensor) -> None:
        nonlocal total
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.nbytes

    for module in model.modules():
        if isinstance(module, nn.Embedding | QuantizedEmbedding):
            continue
        if isinstance(module, QuantizedLinear):
            for segment in module.segments:
                total += _segment_bytes(segment, seen)
            if module.bias is not None:
                count(module.bias)
        elif isinstance(module, PackedLinear):  # packed twice maybe, read once, as float
            element_size = module.packed_weight.element_size()
            total += module.in_features * module.out_features * element_size
            if module.bias is not None:
                count(module.bias)
        else:
            for parameter in module.parameters(recurse=False):
                count(parameter)
    return total


def _segment_bytes(segment: object, seen: set[int]) -> int:
    from backend_engine.models.quantized_linear import weight_bytes

    tensor = getattr(segment, "blocks", None)
    if tensor is not None:  # ggml blocks, possibly shared with a tied embedding
        if tensor.data_ptr() in seen:
            return 0
        seen.add(tensor.data_ptr())
    return weight_bytes(segment)  # type: ignore[arg-type]


def kv_bytes_read(llm: LLM, context_len: float) -> float:
    """KV cache bytes one decode step reads at ``context_len`` tokens (every layer's K and
    V, in the cache's element type)."""
    from backend_engine.worker.model_runner import kv_bytes_per_block

    runner = model_runner(llm)
    config = llm.engine.config
    per_block = kv_bytes_per_block(
        llm.engine.model_config, config.block_size, runner.dtype, config.kv_cache_dtype
    )
    return per_block / config.block_size * context_len


def model_runner(llm: LLM) -> ModelRunner:
    """The engine's torch model runner (the one a real checkpoint gets)."""
    from backend_engine.worker.model_runner import ModelRunner

    runner = llm.engine.runner
    if not isinstance(runner, ModelRunner):
        raise TypeError(f"expected a ModelRunner, got {type(runner).__name__}")
    return runner


def our_decode_rate(llm: LLM, prompt: list[int], output_len: int) -> float:
    """Tokens per second of one greedy sequence's decode steps (the prefill step excluded;
    a step may be a decode run of several tokens, as the engine serves it)."""
    from backend_engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len + 1, ignore_eos=True)
    engine.add_request(f"decode-{time.monotonic_ns()}", list(prompt), params)
    engine.step()  # the prefill, which samples the first token
    start = time.perf_counter()
    num_tokens = 0
    while engine.has_unfinished():
        num_tokens += sum(len(delta.new_token_ids) for delta in engine.step())
    elapsed = time.perf_counter() - start
    assert num_tokens == output_len
    return num_tokens / elapsed


def _timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


def _runs(values: list[float], fmt: str = ".1f") -> str:
    return "(runs: " + ", ".join(f"{x:{fmt}}" for x in values) + ")"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--decode-run-steps",
        type=int,
        default=None,
        help="our engines' decode runs (default: the engine's; 1: step by step)",
    )
    add_llamacpp_args(parser)
    add_common_args(parser, repeats=5, default_model="smollm2")
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    num_threads = torch.get_num_threads()

    from backend_engine import LLM

    model = checkpoint(args.model, args.size)
    context = args.prompt_len + args.output_len + 16
    ours = {
        label: LLM(
            model=model,
            dtype="float32",
            dequantize=dequantize,
            enable_prefix_caching=False,
            num_threads=num_threads,
            kv_cache_memory_bytes=64 * 1024 * 1024,
            **(
                {} if args.decode_run_steps is None else {"decode_run_steps": args.decode_run_steps}
            ),
        )
        for label, dequantize in ARMS.items()
    }
    first = next(iter(ours.values()))
    vocab = first.engine.model_config.vocab_size
    prompt = [10 + (i * 7919) % (vocab - 20) for i in range(args.prompt_len)]
    mean_context = args.prompt_len + args.output_len / 2
    per_token: dict[str, tuple[int, float]] = {}
    for label, llm in ours.items():
        our_decode_rate(llm, prompt, 8)  # warm-up
        weights = weight_bytes_read(model_runner(llm).model)
        per_token[label] = (weights, weights + kv_bytes_read(llm, mean_context))

    binary, gguf, fa_run = llamacpp_arm(args, model, shipped_gguf())
    servers = {
        fa: LlamaServer(binary, gguf, 1, context, fa, num_threads)
        for fa in fa_run
        if binary is not None and gguf is not None
    }
    for server in servers.values():
        server.__enter__()

    bandwidths: list[float] = []
    by_pages: dict[str, list[float]] = {"4 KiB pages": [], "huge pages": []}
    rates: dict[str, list[float]] = {label: [] for label in ours}
    theirs: dict[bool, list[float]] = {fa: [] for fa in servers}
    try:
        for server in servers.values():
            server.complete(prompt, 8)  # warm-up
        for _ in range(args.repeats):
            for pages, values in by_pages.items():
                values.append(copy_bandwidth(huge_pages=pages == "huge pages"))
            bandwidths.append(by_pages["huge pages"][-1])
            for label, llm in ours.items():
                rates[label].append(our_decode_rate(llm, prompt, args.output_len))
            for fa, server in servers.items():
                theirs[fa].append(server.complete(prompt, args.output_len).decode_tokens_per_s)
    finally:
        for server in servers.values():
            server.__exit__(None, None, None)

    bandwidth = statistics.median(bandwidths)
    print(f"command: {command_line()}")
    print(
        f"model: {model}; torch threads: {num_threads}; prompt {args.prompt_len} tokens, "
        f"{args.output_len} decoded (mean context {mean_context:.0f}), repeats: {args.repeats}"
    )
    print(
        f"memory bandwidth (torch copy, read + write, on huge pages): {bandwidth / 1e9:6.2f} "
        "GB/s  " + _runs([b / 1e9 for b in bandwidths], ".2f")
    )
    small = by_pages["4 KiB pages"]
    print(
        f"  the same copy on 4 KiB pages: {statistics.median(small) / 1e9:6.2f} GB/s  "
        + _runs([b / 1e9 for b in small], ".2f")
    )
    best = 0.0
    if servers:
        print("llama.cpp flags: " + "; ".join(server.settings for server in servers.values()))
        for fa, values in theirs.items():
            print(
                f"llama.cpp -np 1 -fa {'on ' if fa else 'off'}: {statistics.median(values):7.1f} "
                f"tokens/s  {_runs(values)}  (reads {gguf})"
            )
        best = max(statistics.median(v) for v in theirs.values())
    else:
        print(missing_binary_note() if binary is None else "llama.cpp arm skipped")
    for label, values in rates.items():
        weights, total = per_token[label]
        fractions = [rate * total / bw for rate, bw in zip(values, bandwidths, strict=True)]
        fraction = statistics.median(fractions)
        rate = statistics.median(values)
        print(f"{label}:")
        print(
            f"  bytes read per token: {total / 1e6:.1f} MB (weights {weights / 1e6:.1f} MB + "
            f"KV {(total - weights) / 1e6:.1f} MB) -> roofline {bandwidth / total:.1f} tokens/s"
        )
        print(f"  decode: {rate:7.1f} tokens/s  {_runs(values)}")
        target = "; target >= 80%: " + ("met" if fraction >= 0.8 else "NOT met")
        print(
            f"  fraction of its roofline: {fraction:.0%}  "
            f"{_runs([f * 100 for f in fractions], '.0f')}" + (target if not ARMS[label] else "")
        )
        if best:
            met = "met" if rate >= best else "NOT met"
            print(f"  ratio to llama.cpp's best: {rate / best:.2f}x  (target >= 1.0x: {met})")


if __name__ == "__main__":
    main()
