"""Tenant fairness against long prompts (issue #27's probe): tenant B's time to first token
alone and while tenant A floods the engine with long prompts, and A's throughput, for the
engine before the change and after it, side by side in one run.

    python -m bench.tenant_fairness --before 6d3574d          # each engine at its own default
    python -m bench.tenant_fairness --before 6d3574d --max-num-batched-tokens 2048   # both at

``--before REV`` is checked out with ``git worktree add`` into a temporary directory; each
arm (before, after: this checkout) runs in a fresh process whose ``backend_engine`` is that
arm's own (the process checks which file it imported), with the same settings and the same
demo checkpoint (``--size``, written once). In each arm an ``AsyncEngine`` is started; then
1. B alone: B sends ``--b-requests`` prompts of ``--b-prompt-len`` tokens one after another
   (each after a random pause of up to ``--b-gap-ms``, so they land anywhere in a step) and
   times each one's first token from the moment it is submitted;
2. A's flood: A keeps ``--a-streams`` requests of ``--a-prompt-len`` tokens in flight (each
   stream sends its next one when the last ends); once every stream has had a first token,
   B sends its requests again, for at least ``--min-window-s``. A's throughput is A's
   tokens over B's window: the prompt of each A request whose first token came in it, and
   each A output token that did.
Prompts are random token ids, a fresh one per request (no prefix-cache hits).

The defaults are the probe's (48 streams of 2,000 tokens, B's short prompts, 64 sequences)
with the probe's KV capacity in tokens (728 blocks of 16: SmolLM2-135M's default 512 MiB in
float32), on the small demo model. The step budget is each engine's own default unless
``--max-num-batched-tokens`` sets one for both: the engine before issue #27 stepped 2,048
tokens everywhere; since, a CPU engine steps 256 (`EngineConfig.DEFAULT_STEP_TOKENS`), as on
2 cores a 2,048-token step of even the small model takes 150 ms and up, 60 times B's 32-token
prefill, and B's first token waits at least for the step in flight plus its own step,
whatever the order of the work. docs/benchmarks.md has both.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workloads import command_line, demo_model

REPO = Path(__file__).resolve().parents[1]
B_TTFT_TARGET = 3.0  # B's p50 TTFT under A's flood, at most this many times B's alone
A_THROUGHPUT_TARGET = 0.9  # A's throughput after, at least this share of before's
RESULT_PREFIX = "RESULT "


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0-1) by linear interpolation, as numpy's default."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


async def measure_arm(args: argparse.Namespace) -> dict[str, Any]:
    """One arm, in this process: B alone, then B under A's flood (see the module docstring)."""
    import backend_engine
    from backend_engine import EngineConfig, SamplingParams
    from backend_engine.async_engine import AsyncEngine

    step_budget = {}  # unset: the arm's engine's own default
    if args.max_num_batched_tokens is not None:
        step_budget["max_num_batched_tokens"] = args.max_num_batched_tokens
    config = EngineConfig(
        model=args.model,
        dtype="float32",
        **step_budget,
        max_num_seqs=args.max_num_seqs,
        num_kv_blocks=args.num_kv_blocks or None,
        num_threads=args.num_threads or None,
        show_progress=False,
    )
    engine = AsyncEngine(config)
    # When each engine step started and ended (appended on the engine's thread), to count
    # the steps each B request waited through.
    steps: list[tuple[float, float]] = []
    step = engine.engine.step

    def timed_step() -> list[Any]:
        start = time.perf_counter()
        deltas = step()
        steps.append((start, time.perf_counter()))
        return deltas

    engine.engine.step = timed_step  # type: ignore[method-assign]
    await engine.start()
    vocab = engine.engine.model_config.vocab_size
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab - 16) for _ in range(n)]

    gaps = random.Random(args.seed + 1)  # B's pauses, the same in both arms
    b_params = SamplingParams(temperature=0, max_tokens=args.b_max_tokens, ignore_eos=True)
    a_params = SamplingParams(temperature=0, max_tokens=args.a_max_tokens, ignore_eos=True)
    ids = iter(range(1 << 62))

    b_spans: list[tuple[float, float]] = []  # each B request's submission and first token

    async def first_token_s(prompt: list[int], tenant: str, params: SamplingParams) -> float:
        start = time.perf_counter()
        first: float | None = None
        async for delta in engine.generate(
            f"{tenant}{next(ids)}", prompt, params, tenant_id=tenant
        ):
            if first is None and delta.new_token_ids:
                first = time.perf_counter()
        assert first is not None
        if tenant == "b":
            b_spans.append((start, first))
        return first - start

    async def b_series(min_seconds: float) -> list[float]:
        ttfts: list[float] = []
        start = time.perf_counter()
        while len(ttfts) < args.b_requests or time.perf_counter() - start < min_seconds:
            await asyncio.sleep(gaps.uniform(0, args.b_gap_ms / 1e3))
            ttfts.append(await first_token_s(tokens(args.b_prompt_len), "b", b_params))
        return ttfts

    await first_token_s(tokens(args.a_prompt_len), "warm", a_params)  # first-call costs
    await first_token_s(tokens(args.b_prompt_len), "warm", b_params)
    b_alone = await b_series(0.0)

    window: list[float] = []  # when B's series under the flood started, and ended
    a_tokens = 0
    started_streams: set[int] = set()
    all_started = asyncio.Event()

    def in_window(now: float) -> bool:
        return len(window) == 1 or (len(window) == 2 and window[0] <= now <= window[1])

    async def a_stream(stream: int) -> None:
        nonlocal a_tokens
        while True:
            prompt = tokens(args.a_prompt_len)
            is_first = True
            async for delta in engine.generate(f"a{next(ids)}", prompt, a_params, tenant_id="a"):
                if not delta.new_token_ids:
                    continue
                now = time.perf_counter()
                if is_first:
                    is_first = False
                    started_streams.add(stream)
                    if len(started_streams) == args.a_streams:
                        all_started.set()
                    if in_window(now):
                        a_tokens += len(prompt)
                if in_window(now):
                    a_tokens += len(delta.new_token_ids)

    flood = [asyncio.create_task(a_stream(i)) for i in range(args.a_streams)]
    await all_started.wait()
    window.append(time.perf_counter())
    num_alone = len(b_spans)
    b_flood = await b_series(args.min_window_s)
    window.append(time.perf_counter())
    # Steps that started after a B request was submitted, up to the one that gave its first
    # token: 1 is the next step.
    b_steps = [
        sum(1 for begin, _ in steps if submitted < begin < first)
        for submitted, first in b_spans[num_alone:]
    ]
    flood_steps = [end - begin for begin, end in steps if window[0] <= begin <= window[1]]
    for task in flood:
        task.cancel()
    for task in flood:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await engine.shutdown()
    seconds = window[1] - window[0]
    return {
        "backend_engine": backend_engine.__file__,
        "b_alone_ms": [x * 1e3 for x in b_alone],
        "b_flood_ms": [x * 1e3 for x in b_flood],
        "a_tokens_per_s": a_tokens / seconds,
        "window_s": seconds,
        "b_flood_steps": b_steps,
        "flood_step_ms": [x * 1e3 for x in flood_steps],
    }


def run_arm(repo: Path, args: argparse.Namespace, model: str) -> dict[str, Any]:
    """One arm in a fresh process whose ``backend_engine`` comes from ``repo``."""
    forwarded = [
        f"--{name.replace('_', '-')}={getattr(args, name)}"
        for name in ARM_SETTINGS
        if name != "model" and getattr(args, name) is not None
    ]
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        f"--engine-repo={repo}",
        f"--model={model}",
        *forwarded,
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [x for x in result.stdout.splitlines() if x.startswith(RESULT_PREFIX)]
    if result.returncode != 0 or not lines:
        raise SystemExit(f"the arm in {repo} failed:\n{result.stderr[-4000:]}")
    measured: dict[str, Any] = json.loads(lines[-1][len(RESULT_PREFIX) :])
    if not Path(measured["backend_engine"]).resolve().is_relative_to(repo.resolve()):
        raise SystemExit(f"the arm in {repo} imported {measured['backend_engine']}")
    return measured


ARM_SETTINGS = (
    "model",
    "a_streams",
    "a_prompt_len",
    "a_max_tokens",
    "b_requests",
    "b_prompt_len",
    "b_max_tokens",
    "b_gap_ms",
    "min_window_s",
    "max_num_batched_tokens",
    "max_num_seqs",
    "num_kv_blocks",
    "num_threads",
    "seed",
)


def summarize(label: str, runs: list[dict[str, Any]]) -> dict[str, float]:
    alone = [x for run in runs for x in run["b_alone_ms"]]
    flood = [x for run in runs for x in run["b_flood_ms"]]
    figures = {
        "alone_p50": statistics.median(alone),
        "alone_p99": percentile(alone, 0.99),
        "flood_p50": statistics.median(flood),
        "flood_p99": percentile(flood, 0.99),
        "a_tokens_per_s": statistics.median(run["a_tokens_per_s"] for run in runs),
    }
    b_steps = [n for run in runs for n in run["b_flood_steps"]]
    step_ms = [x for run in runs for x in run["flood_step_ms"]]
    print(
        f"{label}: B alone p50 {figures['alone_p50']:8.1f} ms  p99 {figures['alone_p99']:8.1f} ms"
        f" | B under A's flood p50 {figures['flood_p50']:8.1f} ms  p99 "
        f"{figures['flood_p99']:8.1f} ms ({figures['flood_p50'] / figures['alone_p50']:.1f}x alone)"
        f" | A {figures['a_tokens_per_s']:8.0f} tokens/s (runs: B under the flood p50 "
        + ", ".join(f"{statistics.median(run['b_flood_ms']):.1f}" for run in runs)
        + " ms; A "
        + ", ".join(f"{run['a_tokens_per_s']:.0f}" for run in runs)
        + " tokens/s over "
        + ", ".join(f"{run['window_s']:.1f}" for run in runs)
        + " s)"
    )
    print(
        f"{label}: under the flood, B's first token came in step {statistics.median(b_steps):.0f}"
        f" after its arrival at the median, {percentile(b_steps, 0.99):.0f} at p99, "
        f"{max(b_steps)} at most (1: the next step); a step took {statistics.median(step_ms):.1f}"
        f" ms at the median, {percentile(step_ms, 0.99):.1f} ms at p99"
    )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="git revision of the engine before the change")
    parser.add_argument("--model", help="checkpoint; default: the demo model of --size")
    parser.add_argument("--size", default="small", help="demo model size when --model is absent")
    parser.add_argument("--repeats", type=int, default=2, help="arms each, alternating")
    parser.add_argument("--a-streams", type=int, default=48)
    parser.add_argument("--a-prompt-len", type=int, default=2000)
    parser.add_argument("--a-max-tokens", type=int, default=16)
    parser.add_argument("--b-requests", type=int, default=30)
    parser.add_argument("--b-prompt-len", type=int, default=32)
    parser.add_argument("--b-max-tokens", type=int, default=4)
    parser.add_argument("--b-gap-ms", type=float, default=100.0)
    parser.add_argument("--min-window-s", type=float, default=10.0)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, help="both arms' step budget; default: each's own"
    )
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument(
        "--num-kv-blocks", type=int, default=728, help="KV blocks (0: the engine's default budget)"
    )
    parser.add_argument("--num-threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-repo", help=argparse.SUPPRESS)  # an arm's own process
    args = parser.parse_args()

    if args.engine_repo:
        sys.path.insert(0, args.engine_repo)
        result = asyncio.run(measure_arm(args))
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return
    if not args.before:
        parser.error("--before REV is required: the engine to compare against")

    import torch

    model = demo_model(args.size, args.model)
    with tempfile.TemporaryDirectory(prefix="tollway-fairness-") as scratch:
        before_repo = Path(scratch) / "before"
        add = ["worktree", "add", "--detach", "-q", str(before_repo), args.before]
        subprocess.run(["git", "-C", str(REPO), *add], check=True)
        try:
            arms: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
            for _ in range(args.repeats):
                arms["before"].append(run_arm(before_repo, args, model))
                arms["after"].append(run_arm(REPO, args, model))
        finally:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(before_repo)],
                check=False,
            )
    print(f"command: {command_line()}")
    print(
        f"model: {model}; A: {args.a_streams} streams of {args.a_prompt_len}-token prompts, "
        f"max_tokens={args.a_max_tokens}; B: {args.b_requests} requests of "
        f"{args.b_prompt_len} tokens one at a time, max_tokens={args.b_max_tokens}; "
        f"max_num_batched_tokens={args.max_num_batched_tokens or 'each engine default'}, "
        "max_num_seqs="
        f"{args.max_num_seqs}; before: {args.before}; repeats: {args.repeats}; torch threads: "
        f"{args.num_threads or torch.get_num_threads()}"
    )
    before = summarize("before", arms["before"])
    after = summarize("after ", arms["after"])
    for label, figures in (("before", before), ("after", after)):
        ratio = figures["flood_p50"] / figures["alone_p50"]
        print(
            f"{label}: B's p50 TTFT under A's flood / alone: {ratio:.2f}x "
            f"(target <= {B_TTFT_TARGET:.0f}x)"
        )
    print(
        f"B's p50 TTFT under A's flood, before / after: "
        f"{before['flood_p50'] / after['flood_p50']:.2f}x"
    )
    print(
        f"A's throughput, after / before: {after['a_tokens_per_s'] / before['a_tokens_per_s']:.3f}"
        f" (target >= {A_THROUGHPUT_TARGET})"
    )


if __name__ == "__main__":
    main()
