"""Prefill tokens per second on one long prompt: our engine (GGUF blocks as stored, and
--dequantize to float32; each at the CPU's default step token budget and at one that
takes the whole prompt in one step) against llama.cpp's ``llama-server`` on the same GGUF,
side by side in one run.

    python -m bench.prefill_throughput                 # the shipped SmolLM2 Q4_1, 1,024 tokens
    python -m bench.prefill_throughput --prompt-len 2048 --step-budgets 256 2048

Ours: one request of ``--prompt-len`` random token ids and ``max_tokens=1`` (prefix cache
off, a fresh prompt each repeat), timed from ``add_request`` to the step that samples its
first token; tokens/s = prompt tokens / that time. The CPU's default budget (256,
``EngineConfig.step_token_budget``) prefills a 1,024-token prompt in four steps, each
attending to the KV the ones before wrote; a budget of the prompt's length does it in one.
llama.cpp: its own ``prompt_per_second`` (``prompt_n / prompt_ms`` in the reply's
timings) for the same prompt with ``n_predict: 1``, ``cache_prompt: false``, flash
attention off and on; its best is compared (target: ours >= 1.0x). llama-server batches a
prompt in micro-batches of its ``-ub`` (512 by default).
"""

from __future__ import annotations

import argparse
import random
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

# Our weight arms: label -> --dequantize.
WEIGHTS = {"GGUF blocks as stored": False, "--dequantize (float32)": True}


def our_prefill_seconds(llm: LLM, prompt: list[int]) -> float:
    """Seconds from adding one ``prompt`` to the step that samples its first token."""
    from backend_engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(f"prefill-{time.monotonic_ns()}", list(prompt), params)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def llamacpp_prefill_rate(server: LlamaServer, prompt: list[int]) -> float:
    """llama.cpp's own prompt tokens per second for ``prompt`` (nothing reused)."""
    reply = server.complete(prompt, max_tokens=1, cache_prompt=False)
    if reply.num_prompt_tokens != len(prompt) or reply.prompt_ms <= 0:
        raise RuntimeError(
            f"llama-server evaluated {reply.num_prompt_tokens} of {len(prompt)} prompt tokens"
        )
    return reply.num_prompt_tokens / (reply.prompt_ms / 1e3)


def _runs(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f} tokens/s  (runs: " + (
        ", ".join(f"{x:.1f}" for x in values) + ")"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument(
        "--step-budgets",
        type=int,
        nargs="+",
        default=[0, 1024],
        help="our max_num_batched_tokens per arm; 0 = the device's default (256 on the CPU)",
    )
    add_llamacpp_args(parser)
    add_common_args(parser, default_model="smollm2")
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    num_threads = torch.get_num_threads()

    from backend_engine import LLM

    model = checkpoint(args.model, args.size)
    ours: dict[str, LLM] = {}
    for weights, dequantize in WEIGHTS.items():
        for budget in args.step_budgets:
            llm = LLM(
                model=model,
                dtype="float32",
                dequantize=dequantize,
                enable_prefix_caching=False,
                max_num_batched_tokens=budget or None,
                num_threads=num_threads,
                kv_cache_memory_bytes=128 * 1024 * 1024,
            )
            tokens = llm.engine.config.step_token_budget
            steps = -(-args.prompt_len // tokens)
            plural = "s" if steps > 1 else ""
            label = f"tollway {weights}, --max-num-batched-tokens {tokens} ({steps} step{plural})"
            ours[label] = llm
    vocab = next(iter(ours.values())).engine.model_config.vocab_size
    rng = random.Random(0)

    def fresh_prompt() -> list[int]:
        return [rng.randrange(10, vocab - 16) for _ in range(args.prompt_len)]

    for llm in ours.values():
        our_prefill_seconds(llm, fresh_prompt())  # warm-up

    binary, gguf, fa_run = llamacpp_arm(args, model, shipped_gguf())
    servers = {
        fa: LlamaServer(binary, gguf, 1, args.prompt_len + 16, fa, num_threads)
        for fa in fa_run
        if binary is not None and gguf is not None
    }
    for server in servers.values():
        server.__enter__()
    rates: dict[str, list[float]] = {label: [] for label in ours}
    theirs: dict[bool, list[float]] = {fa: [] for fa in servers}
    try:
        for server in servers.values():
            llamacpp_prefill_rate(server, fresh_prompt())  # warm-up
        for _ in range(args.repeats):
            prompt = fresh_prompt()  # the same prompt for every arm in a repeat
            for label, llm in ours.items():
                rates[label].append(args.prompt_len / our_prefill_seconds(llm, prompt))
            for fa, server in servers.items():
                theirs[fa].append(llamacpp_prefill_rate(server, prompt))
    finally:
        for server in servers.values():
            server.__exit__(None, None, None)

    print(f"command: {command_line()}")
    print(
        f"model: {model}; torch threads: {num_threads}; one prompt of {args.prompt_len} "
        f"random tokens, first token sampled; repeats: {args.repeats}"
    )
    for label, values in rates.items():
        print(f"{label}: {_runs(values)}")
    if not servers:
        print(missing_binary_note() if binary is None else "llama.cpp arm skipped")
        return
    for fa, values in theirs.items():
        print(f"llama.cpp {servers[fa].settings} (prompt_per_second): {_runs(values)}")
    best = max(statistics.median(v) for v in theirs.values())
    for label, values in rates.items():
        ratio = statistics.median(values) / best
        met = "met" if ratio >= 1 else "NOT met"
        print(f"ratio ({label} / llama.cpp's best): {ratio:.2f}x  (target >= 1.0x: {met})")
    print(f"(llama.cpp reads {gguf})")


if __name__ == "__main__":
    main()
