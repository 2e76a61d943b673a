"""Which thread builds the engine: a decode step's time when the engine is built on the main
thread and stepped on another (as `AsyncEngine` once did) against built and stepped on one
thread (as it does now), side by side in one run.

    python -m bench.engine_thread                  # large demo model, 1 and 16 sequences
    python -m bench.engine_thread --num-seqs 1 64 --repeats 5

Each arm runs in a fresh process (OpenMP's thread teams are per process and never go
away), the arms alternating. Why it matters: every thread that opens an OpenMP parallel
region gets its own team of workers, and once a process has more OpenMP threads than CPUs,
libgomp stops letting idle workers spin between regions, so each of a step's few hundred
regions waits for futex wake-ups instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workloads import add_common_args, command_line, demo_model

ARMS = {
    "built on main, stepped on a thread": "split",
    "built and stepped on one thread": "one",
}


def measure(model: str, arm: str, num_seqs: int, num_threads: int | None) -> float:
    """Median decode-step time (ms) of ``num_seqs`` sequences, in this process."""
    from backend_engine import EngineConfig, SamplingParams
    from backend_engine.llm_engine import LLMEngine

    config = EngineConfig(model=model, show_progress=False, num_threads=num_threads)
    steps: list[float] = []

    def build() -> LLMEngine:
        return LLMEngine(config)

    def run(engine: LLMEngine) -> None:
        params = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
        for i in range(num_seqs):
            engine.add_request(f"r{i}", list(range(10, 42)), params)
        engine.step()  # the prefill
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)

    if arm == "split":
        engine = build()
        thread = threading.Thread(target=run, args=(engine,))
    else:
        thread = threading.Thread(target=lambda: run(build()))
    thread.start()
    thread.join()
    return statistics.median(steps[10:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--arm", choices=list(ARMS.values()), help=argparse.SUPPRESS)
    add_common_args(parser)
    args = parser.parse_args()
    model = demo_model(args.size, args.model)
    if args.arm is not None:  # one measurement, in a child process
        times = {n: measure(model, args.arm, n, args.num_threads or None) for n in args.num_seqs}
        print(json.dumps(times))
        return
    results: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS.values()}
    for _ in range(args.repeats):
        for arm in ARMS.values():
            command = [sys.executable, "-m", "bench.engine_thread", "--arm", arm, "--model", model]
            command += ["--num-seqs", *map(str, args.num_seqs)]
            command += ["--num-threads", str(args.num_threads)]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            results[arm].append(json.loads(out.splitlines()[-1]))
    print(f"command: {command_line()}")
    for n in args.num_seqs:
        medians = {
            arm: statistics.median(run[str(n)] for run in results[arm]) for arm in ARMS.values()
        }
        print(f"decode step, {n} sequence(s), median of {args.repeats} processes per arm:")
        for name, arm in ARMS.items():
            runs = ", ".join(f"{run[str(n)]:.2f}" for run in results[arm])
            print(f"  {name:36} {medians[arm]:6.2f} ms  (runs: {runs})")
        print(f"  ratio: {medians['split'] / medians['one']:.2f}x")


if __name__ == "__main__":
    main()
