"""The CPU kernels against their plain-PyTorch references, side by side in one run:
``kernels.cpu_attention`` (the native decode kernel, per-prompt fused prefill) against
``kernels.reference``; ``kernels.rms_norm`` (fused residual add + RMSNorm) and
``kernels.rotary`` (rotary embedding in place) against the PyTorch ops they replace.

    python -m bench.cpu_kernels                 # kernel cases, then the engine
    python -m bench.cpu_kernels --no-engine

Kernel cases: one layer's attention (8 query and 2 KV heads, head_dim 64, float32, blocks
of 16 in a shuffled cache) over contexts already stored in the paged cache; decode: one
query token per sequence; prefill: whole prompts. Each case's time is the median of
``--calls`` calls, ours and the reference's alternating.

Engine cases, the large demo model, each arm's runs alternating with the other's:
- decode attention: the median decode step of 16 sequences at 1,500 tokens of context,
  with the native decode kernel and with the reference's;
- elementwise kernels: the median decode step at 1, 16 and 64 sequences with each of them
  and with PyTorch's ops instead;
- burst: ``--burst`` prompts of random length (``--burst-lens``; ``max_tokens=1``, so the
  run is all prefill), with the per-prompt prefill path and with every prompt sent to the
  reference (``cpu_attention.MIN_OWN_PROMPT_TOKENS`` raised past every prompt).
Runs repeat ``--repeats`` times per arm.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workloads import add_common_args, command_line, demo_model

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 2, 64, 16
DECODE_CASES = {  # name: (sequences, context tokens)
    "16 sequences x 175 tokens": (16, 175),
    "64 sequences x 300 tokens": (64, 300),
    "16 sequences x 1,500 tokens": (16, 1500),
    "64 sequences x 2,000 tokens": (64, 2000),
}
PREFILL_CASES = {
    "16 prompts of 32-128 tokens": (16, 32, 128),
    "16 prompts of 64 tokens": (16, 64, 64),
    "1 prompt of 84 tokens": (1, 84, 84),
    "4 prompts of 256-512 tokens": (4, 256, 512),
    "1 prompt of 1,200 tokens": (1, 1200, 1200),
}


def paired_medians_ms(
    ours: Callable[[], object], reference: Callable[[], object], num_calls: int
) -> tuple[float, float]:
    """Median ms of each, their calls alternating (a noisy neighbour hits both alike)."""
    for _ in range(3):
        ours()
        reference()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(num_calls):
        for call, sink in ((ours, times[0]), (reference, times[1])):
            start = time.perf_counter()
            call()
            sink.append(time.perf_counter() - start)
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3


@contextmanager
def restored(module: ModuleType, name: str) -> Iterator[Any]:
    """``module.name`` as it is now; put back on exit, whatever the arms set it to."""
    saved = getattr(module, name)
    try:
        yield saved
    finally:
        setattr(module, name, saved)


def setter(module: ModuleType, name: str, value: object) -> Callable[[], None]:
    """An arm's setup step: set ``module.name`` to ``value``."""
    return lambda: setattr(module, name, value)


def decode_case(num_seqs: int, context: int, num_calls: int) -> tuple[float, float]:
    """(ours ms, reference ms) for one layer's decode attention of ``num_seqs`` sequences."""
    import torch

    from kernels import cpu_attention, reference

    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    shape = (num_seqs * blocks_per_seq, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, generator=gen)
    value_cache = torch.randn(shape, generator=gen)
    tables = torch.randperm(shape[0], generator=gen).view(num_seqs, -1).to(torch.int32)
    q = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, generator=gen)
    lens = torch.full((num_seqs,), context, dtype=torch.int32)
    args = (q, key_cache, value_cache, tables.contiguous(), lens)
    scale = HEAD_DIM**-0.5
    return paired_medians_ms(
        lambda: cpu_attention.paged_decode_attention(*args, scale),
        lambda: reference.paged_decode_attention(*args, scale),
        num_calls,
    )


def prefill_case(count: int, low: int, high: int, num_calls: int) -> tuple[float, float]:
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
    return paired_medians_ms(
        lambda: cpu_attention.paged_prefill_attention(*args, scale),
        lambda: reference.paged_prefill_attention(*args, scale),
        num_calls,
    )


def engine_burst(model: str, num_prompts: int, lens: tuple[int, int], repeats: int) -> None:
    from backend_engine import EngineConfig, SamplingParams
    from backend_engine.llm_engine import LLMEngine
    from kernels import cpu_attention
    from model_files.model_config import ModelConfig

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
    times: dict[str, list[float]] = {"per-prompt": [], "reference": []}
    with restored(cpu_attention, "MIN_OWN_PROMPT_TOKENS") as own_threshold:
        thresholds = {"per-prompt": own_threshold, "reference": lens[1] + 1}
        for repeat in range(repeats):
            for arm, threshold in thresholds.items():
                cpu_attention.MIN_OWN_PROMPT_TOKENS = threshold
                times[arm].append(burst(f"{arm}-{repeat}", num_prompts))
    arms = list(times)
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


class DecodeRuns:
    """An engine with prefix caching and ``num_seqs`` fixed prompts of ``context`` tokens:
    after the first run the prompts' KV is cached, so each run goes almost straight to
    decoding all of them at once."""

    def __init__(self, model: str, num_seqs: int, context: int) -> None:
        from backend_engine import EngineConfig, SamplingParams
        from backend_engine.llm_engine import LLMEngine
        from model_files.model_config import ModelConfig

        self.engine = LLMEngine(
            EngineConfig(
                model=model,
                dtype="float32",
                max_num_seqs=num_seqs,
                enable_prefix_caching=True,
                show_progress=False,
            )
        )
        vocab = ModelConfig.from_pretrained(model).vocab_size
        rng = random.Random(0)
        self.prompts = [
            [rng.randrange(10, vocab - 16) for _ in range(context)] for _ in range(num_seqs)
        ]
        self.params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        self.step_times("warm-up")  # prefills (and caches) the prompts

    def step_times(self, tag: str) -> list[float]:
        """Seconds per decode step while every sequence decodes."""
        for i, prompt in enumerate(self.prompts):
            self.engine.add_request(f"{tag}-{i}", prompt, self.params)
        steps = []
        while self.engine.has_unfinished():
            start = time.perf_counter()
            deltas = self.engine.step()
            elapsed = time.perf_counter() - start
            if len(deltas) == len(self.prompts):  # none finished yet
                steps.append(elapsed)
        return steps[2:]  # the first steps still carry the prompts' last partial blocks

    def alternate(self, arms: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
        """Median ms per decode step under each arm (a setup call), runs alternating."""
        steps: dict[str, list[float]] = {arm: [] for arm in arms}
        for repeat in range(repeats):
            for arm, setup in arms.items():
                setup()
                steps[arm].extend(self.step_times(f"{arm}-{repeat}"))
        return {arm: statistics.median(times) * 1e3 for arm, times in steps.items()}


def engine_decode(model: str, num_seqs: int, context: int, repeats: int) -> None:
    """Median decode step with the native decode kernel and with the reference's."""
    from kernels import cpu_attention, reference

    runs = DecodeRuns(model, num_seqs, context)
    name = "paged_decode_attention"
    with restored(cpu_attention, name) as native:
        arms = {
            "native": setter(cpu_attention, name, native),
            "reference": setter(cpu_attention, name, reference.paged_decode_attention),
        }
        ms = runs.alternate(arms, repeats)
    print(
        f"\nengine decode: {num_seqs} sequences at {context}+ tokens of context, median step "
        f"({repeats} runs per arm, alternating)"
    )
    print(
        f"  native {ms['native']:7.2f} ms  reference {ms['reference']:7.2f} ms  "
        f"ratio {ms['reference'] / ms['native']:.2f}x"
    )


def engine_elementwise(model: str, repeats: int) -> None:
    """Median decode step with each fused elementwise kernel and with PyTorch's ops."""
    from kernels import rms_norm, rotary

    print(
        f"\nengine decode, elementwise kernels: median step ({repeats} runs per arm, alternating)"
    )
    for num_seqs, context in ((1, 100), (16, 100), (64, 300)):
        runs = DecodeRuns(model, num_seqs, context)
        module: ModuleType
        for name, module in (("add + RMSNorm", rms_norm), ("rotary", rotary)):
            with restored(module, "native_library") as native_library:
                arms = {
                    "native": setter(module, "native_library", native_library),
                    "pytorch": setter(module, "native_library", lambda: None),
                }
                ms = runs.alternate(arms, repeats)
            print(
                f"  {num_seqs:2} sequences at {context}+ tokens, {name:13}: native "
                f"{ms['native']:6.2f} ms  pytorch {ms['pytorch']:6.2f} ms  "
                f"ratio {ms['pytorch'] / ms['native']:.3f}x"
            )


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
    print("decode (native kernel against the reference)")
    for name, (num_seqs, context) in DECODE_CASES.items():
        ours, ref = decode_case(num_seqs, context, args.calls)
        print(
            f"  {name:28}  native     {ours:7.2f} ms  reference {ref:7.2f} ms  "
            f"ratio {ref / ours:5.2f}x"
        )
    print("prefill of whole prompts (per-prompt fused SDPA against the reference)")
    for name, (count, low, high) in PREFILL_CASES.items():
        ours, ref = prefill_case(count, low, high, args.calls)
        print(
            f"  {name:28}  per-prompt {ours:7.2f} ms  reference {ref:7.2f} ms  "
            f"ratio {ref / ours:5.2f}x"
        )
    if not args.no_engine:
        model = demo_model(args.size, args.model)
        engine_decode(model, 16, 1500, args.repeats)
        engine_elementwise(model, args.repeats)
        engine_burst(model, args.burst, tuple(args.burst_lens), args.repeats)


if __name__ == "__main__":
    main()
