"""Single-stream decode (batch 1) against the machine's float32 roofline, with llama.cpp's
``llama-server`` (one slot) on the same GGUF beside it, in one run.

    python -m bench.single_stream_decode                   # SmolLM2-135M GGUF
    python -m bench.single_stream_decode --model DIR --gguf FILE.gguf --repeats 5

One decoding sequence reads every weight once per token, so its speed is bounded by
memory bandwidth: ``roofline = bandwidth / bytes read per token``. Each repeat measures,
back to back:

- the bandwidth: a large ``torch`` copy (``dst.copy_(src)``, buffers far beyond the
  caches; read + written bytes over the time, best of a few), on the engine's threads;
- our decode rate: one request, greedy, ``--output-len`` tokens after a ``--prompt-len``
  prompt; the time of the engine steps after the prefill step (sampling included);
- llama.cpp's decode rate (its own ``predicted_per_second``) on the same prompt, when the
  binary is there.

Bytes per token are the float32 weights every token reads (all linear layers, the output
projection over the whole vocabulary, the norms) plus the KV cache read at the mean
context. The ratio ours / roofline is computed per repeat, against that repeat's
bandwidth; the median is quoted (target >= 80%).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

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
    from model_files.model_config import ModelConfig

_COPY_BYTES = 1 << 30  # per buffer: far beyond any cache here (L3 is up to a few hundred MB)
_COPY_TRIES = 3


def copy_bandwidth(num_bytes: int = _COPY_BYTES) -> float:
    """Bytes per second a large ``torch`` copy moves (read + written), best of a few."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(_COPY_TRIES))
    return 2 * num_bytes / best


def bytes_per_token(config: ModelConfig, context_len: float, element_size: int = 4) -> float:
    """Bytes one decode step of one sequence reads: every weight once (the output projection
    too, tied or not; one embedding row is negligible), and the KV cache of its context."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter + 2 * hidden
    if config.attention_bias:
        per_layer += q + 2 * kv
    weights = config.num_hidden_layers * per_layer + config.vocab_size * hidden + hidden
    kv_cache = config.num_hidden_layers * 2 * kv * context_len
    return (weights + kv_cache) * element_size


def our_decode_rate(llm: LLM, prompt: list[int], output_len: int) -> float:
    """Tokens per second of one greedy sequence's decode steps (the prefill step excluded)."""
    from backend_engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len + 1, ignore_eos=True)
    engine.add_request(f"decode-{time.monotonic_ns()}", list(prompt), params)
    engine.step()  # the prefill, which samples the first token
    start = time.perf_counter()
    num_steps = 0
    while engine.has_unfinished():
        engine.step()
        num_steps += 1
    elapsed = time.perf_counter() - start
    assert num_steps == output_len
    return num_steps / elapsed


def _timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    add_llamacpp_args(parser)
    add_common_args(parser, repeats=5, default_model="smollm2")
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    num_threads = torch.get_num_threads()

    from backend_engine import LLM

    model = checkpoint(args.model, args.size)
    llm = LLM(model=model, dtype="float32", enable_prefix_caching=False, num_threads=num_threads)
    config = llm.engine.model_config
    prompt = [10 + (i * 7919) % (config.vocab_size - 20) for i in range(args.prompt_len)]
    our_decode_rate(llm, prompt, 8)  # warm-up
    per_token = bytes_per_token(config, args.prompt_len + args.output_len / 2)

    binary, gguf, fa_run = llamacpp_arm(args, model, shipped_gguf())
    servers = {
        fa: LlamaServer(binary, gguf, 1, args.prompt_len + args.output_len + 16, fa, num_threads)
        for fa in fa_run
        if binary is not None and gguf is not None
    }
    for server in servers.values():
        server.__enter__()

    bandwidths: list[float] = []
    ours: list[float] = []
    theirs: dict[bool, list[float]] = {fa: [] for fa in servers}
    try:
        for server in servers.values():
            server.complete(prompt, 8)  # warm-up
        for _ in range(args.repeats):
            bandwidths.append(copy_bandwidth())
            ours.append(our_decode_rate(llm, prompt, args.output_len))
            for fa, server in servers.items():
                theirs[fa].append(server.complete(prompt, args.output_len).decode_tokens_per_s)
    finally:
        for server in servers.values():
            server.__exit__(None, None, None)

    fractions = [rate * per_token / bw for rate, bw in zip(ours, bandwidths, strict=True)]
    roofline = statistics.median(bandwidths) / per_token
    print(f"command: {command_line()}")
    print(
        f"model: {model}; torch threads: {num_threads}; prompt {args.prompt_len} tokens, "
        f"{args.output_len} decoded, repeats: {args.repeats}"
    )
    print(
        "memory bandwidth (torch copy, read + write): "
        f"{statistics.median(bandwidths) / 1e9:6.2f} GB/s  (runs: "
        + ", ".join(f"{b / 1e9:.2f}" for b in bandwidths)
        + ")"
    )
    print(
        f"bytes read per token (float32 weights + KV): {per_token / 1e6:.1f} MB -> "
        f"roofline {roofline:.1f} tokens/s"
    )
    print(
        f"tollway engine decode:   {statistics.median(ours):7.1f} tokens/s  (runs: "
        + ", ".join(f"{x:.1f}" for x in ours)
        + ")"
    )
    fraction = statistics.median(fractions)
    met = "met" if fraction >= 0.8 else "NOT met"
    print(
        f"fraction of the roofline: {fraction:.0%}  (per run: "
        + ", ".join(f"{f:.0%}" for f in fractions)
        + f"; target >= 80%: {met})"
    )
    if not servers:
        print(missing_binary_note() if binary is None else "llama.cpp arm skipped")
        return
    print("llama.cpp flags: " + "; ".join(server.settings for server in servers.values()))
    for fa, rates in theirs.items():
        print(
            f"llama.cpp -np 1 -fa {'on ' if fa else 'off'}:  {statistics.median(rates):7.1f} "
            "tokens/s  (runs: " + ", ".join(f"{x:.1f}" for x in rates) + f"; reads {gguf})"
        )
    best = max(statistics.median(r) for r in theirs.values())
    print(f"ratio (ours / llama.cpp's best): {statistics.median(ours) / best:.2f}x")


if __name__ == "__main__":
    main()
