"""Continuous against static batching: request completion times on a workload whose
output lengths vary widely, the same engine with one flag changed, side by side in one run.

    python -m bench.continuous_vs_static                # large demo model, 48 requests
    python -m bench.continuous_vs_static --model DIR --num-long 12 --max-num-seqs 8
    python -m bench.continuous_vs_static --scenarios online --loads 0.25 0.5 0.75

Most outputs are short, a few are long (ignore_eos, so every request produces exactly its
max_tokens). A request's completion time runs from its arrival to its final delta;
throughput is output tokens / time until the last one. Static batching admits a new batch
only when the previous one has drained. Both modes use the same ``max_num_seqs``, so static
batching forms batches of that size. Two scenarios, the same requests:

- burst: every request arrives at t=0 (an offline batch). Static batching's first batch
  waits for nothing, so only the later batches pay for the long requests before them.
- online: requests arrive one by one (Poisson, seeded), as at a server, at a fixed fraction
  (``--loads``) of the request rate static batching sustained in the burst run, so the
  static engine keeps up (no queue that grows without bound) and continuous batching gets
  no more capacity than static batching had. Each arrival waits for the batch in progress
  to drain; under continuous batching it joins at the next step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workloads import BenchRequest, add_common_args, command_line, demo_model

if TYPE_CHECKING:
    from backend_engine.llm_engine import LLMEngine

MODES = ("continuous", "static")


@dataclass(frozen=True)
class RunResult:
    completion_times: list[float]  # seconds, one per request
    completion_steps: list[int]  # engine steps until each request's final delta
    seconds: float  # until the last request finished
    num_output_tokens: int

    @property
    def mean(self) -> float:
        return statistics.fmean(self.completion_times)

    def percentile(self, q: int) -> float:
        return statistics.quantiles(self.completion_times, n=100, method="inclusive")[q - 1]

    @property
    def mean_step(self) -> float:
        return statistics.fmean(self.completion_steps)

    @property
    def throughput(self) -> float:
        return self.num_output_tokens / self.seconds


def poisson_arrivals(num_requests: int, rate: float, seed: int = 1) -> list[float]:
    """Arrival times (seconds from the start) of a Poisson process of ``rate`` per second;
    the first request arrives at t=0."""
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(num_requests):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def long_tail_requests(
    num_requests: int,
    num_long: int,
    vocab_size: int,
    prompt_lens: tuple[int, int],
    short_lens: tuple[int, int],
    long_lens: tuple[int, int],
    seed: int = 0,
) -> list[BenchRequest]:
    """``num_long`` requests (at random positions) get a long output, the rest a short one."""
    rng = random.Random(seed)
    long_ids = set(rng.sample(range(num_requests), num_long))
    return [
        BenchRequest(
            [rng.randrange(10, vocab_size - 16) for _ in range(rng.randint(*prompt_lens))],
            rng.randint(*(long_lens if i in long_ids else short_lens)),
        )
        for i in range(num_requests)
    ]


def make_engine(
    model: str, scheduling: str, max_num_seqs: int, num_threads: int | None
) -> LLMEngine:
    from backend_engine import EngineConfig
    from backend_engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=model,
            dtype="float32",
            max_num_seqs=max_num_seqs,
            scheduling=scheduling,  # type: ignore[arg-type]
            enable_prefix_caching=False,  # repeats reuse the prompts: keep them cold
            show_progress=False,
            num_threads=num_threads,
        )
    )


def run(
    engine: LLMEngine, requests: list[BenchRequest], tag: str, arrivals: list[float] | None = None
) -> RunResult:
    """Serve ``requests`` (all at t=0, or at their ``arrivals``) until every one finishes."""
    from backend_engine import SamplingParams

    arrivals = arrivals or [0.0] * len(requests)
    order = sorted(range(len(requests)), key=arrivals.__getitem__)
    done: dict[str, tuple[float, int]] = {}
    num_tokens = num_steps = num_added = 0
    start = time.perf_counter()
    while num_added < len(order) or engine.has_unfinished():
        now = time.perf_counter() - start
        if num_added < len(order) and not engine.has_unfinished():
            # Idle until the next arrival (never the case in a burst).
            time.sleep(max(0.0, arrivals[order[num_added]] - now))
            now = time.perf_counter() - start
        while num_added < len(order) and arrivals[order[num_added]] <= now:
            i = order[num_added]
            r = requests[i]
            params = SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
            engine.add_request(f"{tag}-{i}", r.prompt_token_ids, params)
            num_added += 1
        deltas = engine.step()
        num_steps += 1
        for delta in deltas:
            num_tokens += len(delta.new_token_ids)
            if delta.finished:
                done[delta.request_id] = (time.perf_counter() - start, num_steps)
    elapsed = time.perf_counter() - start
    if num_tokens != sum(r.max_tokens for r in requests):
        raise RuntimeError(f"{tag}: got {num_tokens} output tokens, expected every max_tokens")
    finished = [done[f"{tag}-{i}"] for i in range(len(requests))]
    return RunResult(
        [t - arrival for (t, _), arrival in zip(finished, arrivals, strict=True)],
        [n for _, n in finished],
        elapsed,
        num_tokens,
    )


def report(title: str, results: dict[str, list[RunResult]], with_steps: bool) -> float:
    """Print one scenario's figures; returns the median of the per-repeat ratios."""

    def med(mode: str, value: str) -> float:
        return statistics.median(
            r.percentile(int(value[1:])) if value.startswith("p") else getattr(r, value)
            for r in results[mode]
        )

    print(f"\n{title}")
    for mode in MODES:
        print(
            f"  {mode:10} batching: mean completion {med(mode, 'mean'):6.2f} s  "
            f"p50 {med(mode, 'p50'):6.2f} s  p90 {med(mode, 'p90'):6.2f} s  "
            f"throughput {med(mode, 'throughput'):7.1f} output tokens/s  (mean runs: "
            + ", ".join(f"{r.mean:.2f}" for r in results[mode])
            + " s)"
        )
    if with_steps:
        steps = {mode: results[mode][0].mean_step for mode in MODES}  # the same every repeat
        print(
            f"  mean completion step (engine steps, independent of step cost): continuous "
            f"{steps['continuous']:.1f}, static {steps['static']:.1f} "
            f"(ratio {steps['static'] / steps['continuous']:.2f}x)"
        )
    # One ratio per repeat (the two modes run back to back, so a drift in the machine's speed
    # hits both), then their median: steadier on a shared machine than a ratio of medians.
    ratios = [
        s.mean / c.mean for s, c in zip(results["static"], results["continuous"], strict=True)
    ]
    ratio = statistics.median(ratios)
    print(
        "  ratio of mean completion time (static / continuous), median of the repeats' "
        f"ratios: {ratio:.2f}x  (target >= 3x; per repeat: "
        + ", ".join(f"{r:.2f}" for r in ratios)
        + ")"
    )
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--num-long", type=int, default=6)
    parser.add_argument("--prompt-lens", type=int, nargs=2, default=(32, 128))
    parser.add_argument("--short-lens", type=int, nargs=2, default=(8, 32))
    parser.add_argument("--long-lens", type=int, nargs=2, default=(256, 512))
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument(
        "--scenarios", nargs="+", choices=("burst", "online"), default=["burst", "online"]
    )
    parser.add_argument(
        "--loads",
        type=float,
        nargs="+",
        default=[0.5],
        help="online arrival rates, as fractions of the request rate static batching "
        "sustained in the burst run",
    )
    add_common_args(parser)
    args = parser.parse_args()

    import torch

    from backend_engine import SamplingParams
    from model_files.model_config import ModelConfig

    model = demo_model(args.size, args.model)
    vocab = ModelConfig.from_pretrained(model).vocab_size
    requests = long_tail_requests(
        args.num_requests,
        args.num_long,
        vocab,
        args.prompt_lens,
        args.short_lens,
        args.long_lens,
    )
    engines = {
        mode: make_engine(model, mode, args.max_num_seqs, args.num_threads or None)
        for mode in MODES
    }
    for mode, engine in engines.items():  # warm-up
        engine.add_request(f"warm-{mode}", requests[0].prompt_token_ids, SamplingParams())
        while engine.has_unfinished():
            engine.step()
    # The online rates are fractions of the request rate static batching sustained in the
    # first burst run (run once, unreported, when the burst scenario is not asked for).
    burst: dict[str, list[RunResult]] = {mode: [] for mode in MODES}
    online: dict[float, dict[str, list[RunResult]]] = {
        load: {mode: [] for mode in MODES} for load in args.loads
    }
    static_rate = 0.0
    for repeat in range(args.repeats):
        for mode, engine in engines.items():
            if "burst" in args.scenarios or (mode == "static" and repeat == 0):
                burst[mode].append(run(engine, requests, f"{mode}-{repeat}"))
        static_rate = static_rate or len(requests) / burst["static"][0].seconds
        for load in args.loads if "online" in args.scenarios else []:
            arrivals = poisson_arrivals(len(requests), load * static_rate)
            for mode, engine in engines.items():
                tag = f"{mode}-{repeat}-{load}"
                online[load][mode].append(run(engine, requests, tag, arrivals))

    print(f"command: {command_line()}")
    lens = sorted(r.max_tokens for r in requests)
    print(
        f"requests: {len(requests)}, prompts {args.prompt_lens[0]}-{args.prompt_lens[1]}, "
        f"outputs: {args.num_requests - args.num_long} short ({args.short_lens[0]}-"
        f"{args.short_lens[1]}), {args.num_long} long ({args.long_lens[0]}-{args.long_lens[1]}), "
        f"{sum(lens)} output tokens in all, ignore_eos; max_num_seqs: {args.max_num_seqs}; "
        f"repeats: {args.repeats}; torch threads: {torch.get_num_threads()}"
    )
    if "burst" in args.scenarios:
        report("burst: every request at t=0", burst, with_steps=True)
    for load in args.loads if "online" in args.scenarios else []:
        report(
            f"online: Poisson arrivals at {load * static_rate:.2f} requests/s = {load:g} x the "
            f"{static_rate:.2f} requests/s static batching sustained in the burst",
            online[load],
            with_steps=False,
        )


if __name__ == "__main__":
    main()
