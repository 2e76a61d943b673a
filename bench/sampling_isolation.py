"""What failure isolation costs a step's sampling when nothing fails.

    python -m bench.sampling_isolation                 # vocab 8192, 1 and 16 rows
    python -m bench.sampling_isolation --vocab 32000 --rounds 100

Times, in one process and interleaved (so a busy machine slows both alike), the sampling
path as ``ModelRunner.execute`` ran it before isolation (``sample()``, then a dict of
``SampledToken``) against ``ModelRunner._sample`` (token choice and logprobs each run
through ``isolate_failures``). Each figure is the best of ``--rounds`` batches of 20 calls.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from backend_engine.core.scheduler import ScheduledRequest
from backend_engine.core.step_runner import SampledToken
from backend_engine.sampling_params import SamplingParams
from backend_engine.worker.model_runner import ModelRunner
from backend_engine.worker.sampler import sample

CASES: dict[str, Callable[[int], SamplingParams]] = {
    "greedy": lambda i: SamplingParams(temperature=0),
    "seeded top-k": lambda i: SamplingParams(temperature=0.8, top_k=50, seed=i),
    "greedy + logprobs": lambda i: SamplingParams(temperature=0, logprobs=2),
}


def bare_runner() -> ModelRunner:
    """A runner with its sampling state only (no model, no KV cache)."""
    runner = object.__new__(ModelRunner)
    runner.device = torch.device("cpu")
    runner._generators = {}
    runner.default_generator = torch.Generator().manual_seed(0)
    return runner


def time_per_call(fn: Callable[[], object], num_calls: int = 20) -> float:
    start = time.perf_counter()
    for _ in range(num_calls):
        fn()
    return (time.perf_counter() - start) / num_calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--num-rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runner = bare_runner()
    for label, make in CASES.items():
        for num_rows in args.num_rows:
            batch = [
                ScheduledRequest(f"{label}-{i}", [1], 5, [0], make(i), True, is_decode=True)
                for i in range(num_rows)
            ]
            logits = torch.randn(num_rows, args.vocab)

            def before(
                batch: list[ScheduledRequest] = batch, logits: torch.Tensor = logits
            ) -> dict:
                token_ids, logprobs = sample(
                    logits,
                    [s.sampling_params for s in batch],
                    [runner._generator(s) for s in batch],
                    runner.default_generator,
                )
                return {
                    s.request_id: SampledToken(t, lp)
                    for s, t, lp in zip(batch, token_ids, logprobs, strict=True)
                }

            def after(batch: list[ScheduledRequest] = batch, logits: torch.Tensor = logits) -> list:
                return runner._sample(logits, batch)

            old: list[float] = []
            new: list[float] = []
            for _ in range(args.rounds):
                old.append(time_per_call(before))
                new.append(time_per_call(after))
            print(
                f"{label:18s} rows={num_rows:3d}: before {min(old) * 1e6:9.1f} us   "
                f"isolated {min(new) * 1e6:9.1f} us   ({(min(new) - min(old)) * 1e6:+.1f} us)"
            )


if __name__ == "__main__":
    main()
