"""Offline throughput: our engine against transformers ``generate`` (static, padded
batches) on the same checkpoint and requests, side by side in one run.

    python -m bench.offline_throughput                 # large demo model, 64 requests
    python -m bench.offline_throughput --model DIR --num-requests 48

Useful tokens are each request's own output tokens (padding and tokens generated
past a request's length in a static batch do not count).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workloads import BenchRequest, add_common_args, command_line, demo_model, mixed_requests


def run_ours(model: str, requests: list[BenchRequest], max_num_seqs: int) -> float:
    from backend_engine import LLM, SamplingParams

    llm = LLM(
        model=model, dtype="float32", max_num_seqs=max_num_seqs, kv_cache_memory_bytes=1 << 30
    )
    params = [
        SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests
    ]
    llm.generate([requests[0].prompt_token_ids], params[0])  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in requests], params)
    elapsed = time.perf_counter() - start
    assert [len(o.token_ids) for o in outputs] == [r.max_tokens for r in requests]
    return elapsed


def run_transformers(model: str, requests: list[BenchRequest], batch_size: int) -> float:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(requests), batch_size):
            batch = requests[i : i + batch_size]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, r in enumerate(batch):  # left padding
                ids[row, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
                mask[row, width - len(r.prompt_token_ids) :] = 1
            hf.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                pad_token_id=0,
                max_new_tokens=max(r.max_tokens for r in batch),
            )
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-lens", type=int, nargs=2, default=(32, 512))
    parser.add_argument("--output-lens", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    add_common_args(parser)
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)

    from backend_engine.model_config import ModelConfig

    model = demo_model(args.size, args.model)
    vocab = ModelConfig.from_pretrained(model).vocab_size
    requests = mixed_requests(args.num_requests, vocab, args.prompt_lens, args.output_lens)
    useful = sum(r.max_tokens for r in requests)
    ours, theirs = [], []
    for _ in range(args.repeats):
        ours.append(useful / run_ours(model, requests, args.max_num_seqs))
        theirs.append(useful / run_transformers(model, requests, args.hf_batch_size))
    ours_med, theirs_med = statistics.median(ours), statistics.median(theirs)
    print(f"command: {command_line()}")
    print(
        f"requests: {len(requests)}, useful output tokens: {useful}, "
        f"prompt tokens: {sum(len(r.prompt_token_ids) for r in requests)}"
    )
    print(
        f"tollway engine:           {ours_med:8.1f} output tokens/s  (runs: "
        + ", ".join(f"{x:.0f}" for x in ours)
        + ")"
    )
    print(
        f"transformers generate:    {theirs_med:8.1f} output tokens/s  (runs: "
        + ", ".join(f"{x:.0f}" for x in theirs)
        + ")"
    )
    print(f"ratio (ours / transformers): {ours_med / theirs_med:.2f}x  (target >= 3x)")


if __name__ == "__main__":
    main()
