"""KV memory waste: the fraction of allocated KV slots that hold no token, for our paged
cache against an allocator that reserves each request's maximum length, over the same
engine steps, side by side in one run.

    python bench/kv_memory.py                          # large demo model, 64 mixed requests
    python bench/kv_memory.py --model DIR --block-size 32 --min-running 16

The engine is driven step by step. After every step:
- paged slots = distinct KV blocks in the block tables of running requests x block_size;
- tokens held = sum of the running requests' ``num_computed_tokens`` (tokens whose KV is
  written). Prompts are random token ids, so no two requests share a prefix block and
  the sum counts every held token once;
- reserve-max slots = sum over running requests of prompt + max_tokens (an allocator that
  reserves each request's full length), and of the model's max length (one that reserves
  a whole context per request); both are computed for the same running requests, though
  such allocators would fit fewer of them.
Waste = 1 - tokens held / slots. Steps with fewer than ``--min-running`` running requests
(ramp-up and drain) are left out. Each repeat uses a different workload seed (the figure
does not depend on timing); medians are over repeats.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workloads import BenchRequest, add_common_args, command_line, demo_model, mixed_requests


@dataclass(frozen=True)
class StepUsage:
    num_running: int
    num_tokens_held: int
    num_paged_slots: int
    num_reserved_slots: int  # prompt + max_tokens per request
    num_model_len_slots: int  # max_model_len per request

    def waste(self, slots: int) -> float:
        return 1 - self.num_tokens_held / slots


@dataclass(frozen=True)
class WasteSummary:
    num_steps: int
    num_steps_counted: int
    num_preemptions: int
    peak: tuple[float, float, float]  # paged, reserve prompt+max_tokens, reserve max_model_len
    mean: tuple[float, float, float]


def run_workload(
    model: str,
    requests: list[BenchRequest],
    block_size: int,
    max_num_seqs: int,
    kv_cache_memory_bytes: int,
    min_running: int,
    num_threads: int | None,
) -> tuple[WasteSummary, int]:
    from backend_engine import EngineConfig, SamplingParams
    from backend_engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(
            model=model,
            dtype="float32",
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            show_progress=False,
            num_threads=num_threads,
        )
    )
    for i, r in enumerate(requests):
        params = SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
        engine.add_request(f"kv-{i}", r.prompt_token_ids, params)
    scheduler, kv_cache = engine.scheduler, engine.kv_cache
    usage: list[StepUsage] = []
    while engine.has_unfinished():
        engine.step()
        running = scheduler.running
        blocks = {b for r in running for b in kv_cache.block_table(r.request_id)}
        usage.append(
            StepUsage(
                num_running=len(running),
                num_tokens_held=sum(r.num_computed_tokens for r in running),
                num_paged_slots=len(blocks) * block_size,
                num_reserved_slots=sum(r.num_prompt_tokens + r.max_tokens for r in running),
                num_model_len_slots=len(running) * engine.max_model_len,
            )
        )
    counted = [u for u in usage if u.num_running >= min_running]
    if not counted:
        raise ValueError(f"no step had {min_running} running requests; lower --min-running")
    per_allocator = [
        [u.waste(u.num_paged_slots) for u in counted],
        [u.waste(u.num_reserved_slots) for u in counted],
        [u.waste(u.num_model_len_slots) for u in counted],
    ]
    summary = WasteSummary(
        num_steps=len(usage),
        num_steps_counted=len(counted),
        num_preemptions=engine.scheduler.num_preemptions,
        peak=tuple(max(w) for w in per_allocator),  # type: ignore[arg-type]
        mean=tuple(statistics.fmean(w) for w in per_allocator),  # type: ignore[arg-type]
    )
    return summary, engine.max_model_len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-lens", type=int, nargs=2, default=(32, 512))
    parser.add_argument("--output-lens", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=256 * 1024 * 1024)
    parser.add_argument("--min-running", type=int, default=8)
    add_common_args(parser)
    args = parser.parse_args()

    import torch

    from model_files.model_config import ModelConfig

    model = demo_model(args.size, args.model)
    vocab = ModelConfig.from_pretrained(model).vocab_size
    runs: list[WasteSummary] = []
    for seed in range(args.repeats):
        requests = mixed_requests(
            args.num_requests, vocab, args.prompt_lens, args.output_lens, seed=seed
        )
        summary, max_model_len = run_workload(
            model,
            requests,
            args.block_size,
            args.max_num_seqs,
            args.kv_cache_memory_bytes,
            args.min_running,
            args.num_threads or None,
        )
        runs.append(summary)

    def med(pick: str, i: int) -> float:
        return statistics.median(getattr(s, pick)[i] for s in runs)

    def runs_of(pick: str, i: int) -> str:
        return ", ".join(f"{getattr(s, pick)[i]:.1%}" for s in runs)

    print(f"command: {command_line()}")
    print(
        f"requests: {args.num_requests} (random prompts, no shared prefixes), prompts "
        f"{args.prompt_lens[0]}-{args.prompt_lens[1]}, outputs {args.output_lens[0]}-"
        f"{args.output_lens[1]}, ignore_eos; block_size: {args.block_size}, max_num_seqs: "
        f"{args.max_num_seqs}, max_model_len: {max_model_len}; "
        f"workload seeds 0-{args.repeats - 1}; "
        f"torch threads: {torch.get_num_threads()}"
    )
    print(
        "steps counted (>= {} running): {}; preemptions: {}".format(
            args.min_running,
            ", ".join(f"{s.num_steps_counted}/{s.num_steps}" for s in runs),
            ", ".join(str(s.num_preemptions) for s in runs),
        )
    )
    labels = (
        "paged (ours):                ",
        "reserve prompt + max_tokens: ",
        f"reserve max_model_len={max_model_len}:",
    )
    for i, label in enumerate(labels):
        print(
            f"{label} peak waste {med('peak', i):6.1%}  mean {med('mean', i):6.1%}  "
            f"(runs: peak {runs_of('peak', i)}; mean {runs_of('mean', i)})"
        )
    print(
        f"ratio of peak waste (reserve prompt + max_tokens / paged): "
        f"{med('peak', 1) / med('peak', 0):.1f}x"
    )
    print(f"target: paged peak waste < 4% (block_size {args.block_size})")


if __name__ == "__main__":
    main()
