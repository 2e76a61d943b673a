"""CPU prefill attention: the per-prompt fused path (``kernels.cpu_attention``) against the
padded buckets of ``kernels.reference``, side by side in one run.

    python -m bench.cpu_prefill_attention                 # kernel cases + an engine burst
    python -m bench.cpu_prefill_attention --no-engine

Kernel cases: one layer's prefill attention (8 query and 2 KV heads, head_dim 64, blocks of
16) over prompts already stored in a paged cache; the two implementations alternate, and
each case's time is the median of ``--calls`` calls. Engine burst: the large demo model
prefills ``--burst`` prompts of random length (``--burst-lens``; ``max_tokens=1``, so the
run is all prefill), once with the per-prompt path and once with every prompt sent to the
reference (``cpu_attention.MIN_OWN_PROMPT_TOKENS`` raised past every prompt), alternating,
``--repeats`` times each.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workloads import add_common_args, command_line, demo_model

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 2, 64, 16
KERNEL_CASES = {
    "16 prompts of 32-128 tokens": (16, 32, 128),
    "16 prompts of 64 tokens": (16, 64, 64),
    "1 prompt of 84 tokens": (1, 84, 84),
    "4 prompts of 256-512 tokens": (4, 256, 512),
    "1 prompt of 1,200 tokens": (1, 1200, 1200),
}


def median_ms(call: Callable[[], object], num_calls: int) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(num_calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def kernel_case(count: int, low: int, high: int, num_calls: int) -> tuple[float, float]:
    """(per-prompt ms, reference ms) for one layer's prefill of ``count`` whole prompts."""
    import torch

    from kernels import cpu_attention, reference

    rng = random.Random(0)
    lens = [rng.randint(low, high) for _ in range(count)]
    blocks = [-(-n // BLOCK_SIZE) for n in lens]
    shape = (sum(blocks), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache, value_cache = torch.randn(shape), torch.randn(shape)
    first = [sum(blocks[:i]) for i in range(count)]
    width = max(blocks)
    tables = torch.tensor(
        [list(range(f, f + b)) + [0] * (width - b) for f, b in zip(first, blocks, strict=True)],
        dtype=torch.int32,
    )
    q = torch.randn(sum(lens), NUM_HEADS, HEAD_DIM)
    cu = torch.tensor([0, *(sum(lens[: i + 1]) for i in range(count))], dtype=torch.int32)
    args = (q, key_cache, value_cache, tables, cu, torch.tensor(lens, dtype=torch.int32))
    scale = HEAD_DIM**-0.5
    ours = median_ms(lambda: cpu_attention.paged_prefill_attention(*args, scale), num_calls)
    ref = median_ms(lambda: reference.paged_prefill_attention(*args, scale), num_calls)
    return ours, ref


def engine_burst(model: str, num_prompts: int, lens: tuple[int, int], repeats: int) -> None:
    from backend_engine import EngineConfig, SamplingParams
    from backend_engine.llm_engine import LLMEngine
    from backend_engine.model_config import ModelConfig
    from kernels import cpu_attention

    engine = LLMEngine(
        EngineConfig(
            model=model,
            dtype="float32",
            max_num_seqs=num_prompts,
            enable_prefix_caching=False,  # fresh prompts every run anyway
            show_progress=False,
        )
    )
    vocab = ModelConfig.from_pretrained(model).vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def burst(tag: str, count: int) -> float:
        for i in range(count):
            prompt = [rng.randrange(10, vocab - 16) for _ in range(rng.randint(*lens))]
            engine.add_request(f"{tag}-{i}", prompt, params)
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - start

    burst("warm-up", 4)
    own_threshold = cpu_attention.MIN_OWN_PROMPT_TOKENS
    arms = {"per-prompt": own_threshold, "reference": lens[1] + 1}
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    try:
        for repeat in range(repeats):
            for arm, threshold in arms.items():
                cpu_attention.MIN_OWN_PROMPT_TOKENS = threshold
                times[arm].append(burst(f"{arm}-{repeat}", num_prompts))
    finally:
        cpu_attention.MIN_OWN_PROMPT_TOKENS = own_threshold
    ours, ref = (statistics.median(times[arm]) for arm in arms)
    print(
        f"\nengine burst: {num_prompts} prompts of {lens[0]}-{lens[1]} tokens, max_tokens=1, "
        f"median of {repeats}"
    )
    for arm in arms:
        print(
            f"  {arm:10}  {statistics.median(times[arm]):7.3f} s  (runs: "
            + ", ".join(f"{t:.3f}" for t in times[arm])
            + ")"
        )
    print(f"  ratio (reference / per-prompt): {ref / ours:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=30, help="kernel calls per case")
    parser.add_argument("--no-engine", action="store_true", help="kernel cases only")
    parser.add_argument("--burst", type=int, default=64, help="prompts in the engine burst")
    parser.add_argument("--burst-lens", type=int, nargs=2, default=(32, 512))
    add_common_args(parser, repeats=5)
    args = parser.parse_args()

    import torch

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    print(f"command: {command_line()}")
    print(
        f"torch threads: {torch.get_num_threads()}; one layer, {NUM_HEADS} query and "
        f"{NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, float32"
    )
    for name, (count, low, high) in KERNEL_CASES.items():
        ours, ref = kernel_case(count, low, high, args.calls)
        print(
            f"  {name:28}  per-prompt {ours:7.2f} ms  reference {ref:7.2f} ms  "
            f"ratio {ref / ours:5.2f}x"
        )
    if not args.no_engine:
        model = demo_model(args.size, args.model)
        engine_burst(model, args.burst, tuple(args.burst_lens), args.repeats)


if __name__ == "__main__":
    main()
