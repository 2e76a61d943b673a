"""Prefix caching: time to first token of a request that shares a long prefix with an
earlier one, prefix caching on against off, side by side in one run.

    python bench/prefix_cache_ttft.py                  # large demo model, 1,024-token prefix
    python bench/prefix_cache_ttft.py --model DIR --prefix-len 2048 --repeats 5

Each repeat draws a fresh random prefix, then on each engine: generates once with
prefix + suffix A (this fills the cache), then times ``generate`` of prefix + suffix B
(a different suffix) with ``max_tokens=1``: the time for that request to produce its
first token. Both engines see the same calls in the same order.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workloads import add_common_args, command_line, demo_model

if TYPE_CHECKING:
    from backend_engine import LLM


def measure_ttft(
    llm: LLM, prefix: list[int], suffixes: tuple[list[int], list[int]]
) -> tuple[float, int]:
    """Seconds for prefix + suffixes[1] to produce its first token, and its cached tokens."""
    from backend_engine import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([prefix + suffixes[0]], params)  # fills the prefix cache (when enabled)
    start = time.perf_counter()
    (output,) = llm.generate([prefix + suffixes[1]], params)
    elapsed = time.perf_counter() - start
    assert len(output.token_ids) == 1
    return elapsed, output.num_cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=16)
    add_common_args(parser)
    args = parser.parse_args()

    import torch

    from backend_engine import LLM, SamplingParams
    from model_files.model_config import ModelConfig

    model = demo_model(args.size, args.model)
    vocab = ModelConfig.from_pretrained(model).vocab_size
    engines = {
        on: LLM(
            model=model,
            dtype="float32",
            enable_prefix_caching=on,
            num_threads=args.num_threads or None,
        )
        for on in (True, False)
    }
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab - 16) for _ in range(n)]

    warm_up = tokens(args.prefix_len + args.suffix_len)
    for llm in engines.values():
        llm.generate([warm_up], SamplingParams(max_tokens=2, temperature=0))

    ttft: dict[bool, list[float]] = {True: [], False: []}
    cached: dict[bool, list[int]] = {True: [], False: []}
    for _ in range(args.repeats):
        prefix = tokens(args.prefix_len)
        suffixes = (tokens(args.suffix_len), tokens(args.suffix_len))
        for on, llm in engines.items():
            seconds, num_cached = measure_ttft(llm, prefix, suffixes)
            ttft[on].append(seconds)
            cached[on].append(num_cached)
    on_med, off_med = statistics.median(ttft[True]), statistics.median(ttft[False])
    print(f"command: {command_line()}")
    print(
        f"prompt: {args.prefix_len}-token shared prefix + {args.suffix_len}-token suffix, "
        f"max_tokens=1, repeats: {args.repeats}, torch threads: {torch.get_num_threads()}"
    )
    for on, label in ((True, "prefix caching on: "), (False, "prefix caching off:")):
        med = on_med if on else off_med
        print(
            f"{label} TTFT {med * 1e3:8.2f} ms  (runs: "
            + ", ".join(f"{x * 1e3:.1f}" for x in ttft[on])
            + f" ms; num_cached_tokens: {', '.join(map(str, cached[on]))})"
        )
    print(f"ratio (off / on): {off_med / on_med:.2f}x  (target >= 5x)")


if __name__ == "__main__":
    main()
