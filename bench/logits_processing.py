"""The logits stage (issue #26): what presence/frequency penalties and a logit_bias on every
request cost throughput, and that a request using none of them costs nothing, in one run.

    python -m bench.logits_processing                    # SmolLM2 GGUF, 32 streams
    python -m bench.logits_processing --streams 1 32 --repeats 5 --repetition-penalty 1.1

The workload: ``streams`` prompts of random tokens (``--prompt-tokens``), greedy, each run to
exactly ``--max-tokens`` (``ignore_eos``), so every arm runs the same steps over the same batch
sizes. Three arms, interleaved within the run (the order rotates each repeat, so a busy
machine slows them alike), tokens/s = output tokens over the time from queueing the requests
to the last one finishing:

1. ``stage``: every request with ``presence_penalty``, ``frequency_penalty`` and a
   ``logit_bias`` of ``--bias-tokens`` ids (and ``--repetition-penalty`` if given). Target
   (issue #26): at most 5% slower than ``none``.
2. ``none``: no such option; the runner still calls the stage, which returns after one check
   of each row (``SamplingParams.processes_logits``).
3. ``before``: no such option, and the runner's call of the stage replaced by nothing: the
   code path before the stage existed. ``none`` against ``before`` is what a request that uses
   none of the options pays: nothing beyond noise.

Also: the stage's own time inside the ``stage`` runs' real steps (the name the runner calls
wrapped with a timer), as a share of each run, and the early check alone on a batch of
``streams`` rows that use nothing (p50 per step).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend_engine.sampling_params import SamplingParams
from backend_engine.worker import model_runner
from backend_engine.worker.logits_processing import LogitsRow, apply_logits_stage
from bench.workloads import add_common_args, checkpoint, command_line

if TYPE_CHECKING:
    from backend_engine.llm_engine import LLMEngine

TARGET_SLOWDOWN = 0.05  # issue #26: the most the stage may cost at 32 streams
ARMS = ("stage", "none", "before")


@dataclass(frozen=True)
class Run:
    num_tokens: int
    elapsed_s: float
    stage_s: float  # of which inside the runner's apply_logits_stage

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s


@contextmanager
def runner_stage(arm: str) -> Iterator[list[float]]:
    """The stage as the runner calls it during one arm: timed, or (``before``) not called at
    all. Yields a one-item list that collects the seconds spent in it."""
    seconds = [0.0]
    saved = model_runner.apply_logits_stage

    def timed(logits: torch.Tensor, rows: Sequence[LogitsRow]) -> None:
        start = time.perf_counter()
        try:
            saved(logits, rows)
        finally:
            seconds[0] += time.perf_counter() - start

    def skipped(logits: torch.Tensor, rows: Sequence[LogitsRow]) -> None:
        return None

    model_runner.apply_logits_stage = skipped if arm == "before" else timed
    try:
        yield seconds
    finally:
        model_runner.apply_logits_stage = saved


def run_arm(
    engine: LLMEngine, arm: str, prompts: list[list[int]], params: list[SamplingParams]
) -> Run:
    """Every prompt through the engine at once; all output tokens over the wall time."""
    num_tokens = 0
    with runner_stage(arm) as stage_s:
        start = time.perf_counter()
        for i, (prompt, sampling) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"{arm}-{time.monotonic_ns()}-{i}", prompt, sampling)
        while engine.has_unfinished():
            for delta in engine.step():
                if delta.error:
                    raise RuntimeError(f"{delta.request_id} failed: {delta.error}")
                num_tokens += len(delta.new_token_ids)
        elapsed = time.perf_counter() - start
    return Run(num_tokens, elapsed, stage_s[0])


def workload(
    vocab_size: int, args: argparse.Namespace, streams: int
) -> tuple[list[list[int]], dict[str, list[SamplingParams]]]:
    rng = random.Random(0)
    prompts = [
        [rng.randrange(10, vocab_size - 16) for _ in range(args.prompt_tokens)]
        for _ in range(streams)
    ]
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    stage = [
        SamplingParams(
            temperature=0,
            max_tokens=args.max_tokens,
            ignore_eos=True,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            repetition_penalty=args.repetition_penalty,
            logit_bias={
                rng.randrange(vocab_size): rng.uniform(-5.0, 5.0) for _ in range(args.bias_tokens)
            },
        )
        for _ in range(streams)
    ]
    return prompts, {"stage": stage, "none": [plain] * streams, "before": [plain] * streams}


def early_check_cost(streams: int, vocab_size: int, rounds: int = 2000) -> list[float]:
    """Seconds per call of the stage on ``streams`` rows that use none of it."""

    @dataclass(frozen=True)
    class Row:
        sampling_params: SamplingParams
        all_token_ids: list[int]
        num_prompt_tokens: int

    rows = [Row(SamplingParams(temperature=0), [1] * 64, 32) for _ in range(streams)]
    logits = torch.zeros(streams, vocab_size)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        apply_logits_stage(logits, rows)
        times.append(time.perf_counter() - start)
    return times


def _runs(values: list[float], fmt: str = ".1f") -> str:
    return (
        f"{statistics.median(values):{fmt}} (runs: " + ", ".join(f"{v:{fmt}}" for v in values) + ")"
    )


def _load() -> str:
    return "load average (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _ratio_line(label: str, ratios: list[float], target: float | None) -> str:
    median = statistics.median(ratios)
    slowdown = 1 - median
    verdict = ""
    if target is not None:
        verdict = f"; target <= {target:.0%}: {'met' if slowdown <= target else 'NOT met'}"
    return (
        f"  {label}: {median:.3f} (per repeat "
        + ", ".join(f"{x:.3f}" for x in ratios)
        + f"): {abs(slowdown):.1%} {'slower' if slowdown >= 0 else 'faster'}{verdict}"
    )


def measure(engine: LLMEngine, args: argparse.Namespace, streams: int) -> None:
    vocab_size = engine.model_config.vocab_size
    prompts, params = workload(vocab_size, args, streams)
    for arm in ARMS:  # warm-up, one each
        run_arm(engine, arm, prompts, params[arm])
    runs: dict[str, list[Run]] = {arm: [] for arm in ARMS}
    for repeat in range(args.repeats):
        order = ARMS[repeat % len(ARMS) :] + ARMS[: repeat % len(ARMS)]
        for arm in order:
            runs[arm].append(run_arm(engine, arm, prompts, params[arm]))
    tokens = runs["none"][0].num_tokens
    print(
        f"\n== {streams} stream(s): {streams} prompts of {args.prompt_tokens} random tokens, "
        f"{args.max_tokens} output tokens each ({tokens} a run), greedy, ignore_eos"
    )
    print(
        f"  stage: presence {args.presence_penalty}, frequency {args.frequency_penalty}, "
        f"repetition {args.repetition_penalty}, logit_bias of {args.bias_tokens} ids per request"
    )
    rates = {arm: [r.tokens_per_s for r in runs[arm]] for arm in ARMS}
    for arm in ARMS:
        print(f"  {arm:<7} {_runs(rates[arm])} output tokens/s")
    ratio = [a / b for a, b in zip(rates["stage"], rates["none"], strict=True)]
    target = TARGET_SLOWDOWN if streams == 32 else None
    print(_ratio_line("stage / none", ratio, target))
    free = [a / b for a, b in zip(rates["none"], rates["before"], strict=True)]
    print(_ratio_line("none / before (a request using none of it)", free, None))
    shares = [100 * r.stage_s / r.elapsed_s for r in runs["stage"]]
    steps = max(1, args.max_tokens)
    per_step = statistics.median(r.stage_s for r in runs["stage"]) / steps * 1e6
    print(
        f"  inside the stage runs' steps, apply_logits_stage: {_runs(shares, '.2f')} % of the "
        f"run (~{per_step:.0f} us a decode step)"
    )
    check = early_check_cost(streams, vocab_size)
    print(
        f"  the early check alone ({streams} rows using none): p50 "
        f"{statistics.median(check) * 1e6:.1f} us a step; in the none runs "
        f"{statistics.median(r.stage_s for r in runs['none']) * 1e3:.2f} ms in all"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[32])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--presence-penalty", type=float, default=0.5)
    parser.add_argument("--frequency-penalty", type=float, default=0.5)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--bias-tokens", type=int, default=20)
    add_common_args(parser, repeats=3, default_model="smollm2")
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    num_threads = torch.get_num_threads()
    print(f"command: {command_line()}")
    print(f"start: {_load()}")

    from backend_engine import LLM

    model = checkpoint(args.model, args.size)
    llm = LLM(
        model=model,
        dtype="float32",
        max_num_seqs=max(args.streams),
        kv_cache_memory_bytes=1 << 30,
        enable_prefix_caching=False,
        num_threads=num_threads,
    )
    print(
        f"model: {model}; torch threads: {num_threads}; repeats: {args.repeats}; prefix caching off"
    )
    for streams in args.streams:
        measure(llm.engine, args, streams)
    print(f"end: {_load()}")


if __name__ == "__main__":
    main()
