"""Offline throughput: our engine (GGUF blocks as stored, and --dequantize to float32)
against transformers ``generate`` (static, padded batches) and llama.cpp's ``llama-server``
(one slot per request) on the same checkpoint and requests, side by side in one run.

    python -m bench.offline_throughput                    # SmolLM2-135M GGUF, 48 requests
    python -m bench.offline_throughput --model DIR --gguf FILE.gguf --repeats 3
    python -m bench.offline_throughput --model demo --num-requests 64   # the demo model

Useful tokens are each request's own output tokens (padding and tokens generated
past a request's length in a static batch do not count). The llama.cpp arm runs the GGUF
file (``--model`` when it is one, else ``--gguf``, else the shipped SmolLM2 GGUF) on its
quantized weights, as our as-stored arm does; our --dequantize arm and transformers read
them widened to float32 (for a float checkpoint both our arms are the same float path).
llama.cpp is tried with flash attention off and on and its best setting is compared
(target: ours >= 3x); without the binary (``bench/llamacpp_server.py``) it is skipped with
a note.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.llamacpp_server import (
    LlamaServer,
    add_llamacpp_args,
    llamacpp_arm,
    missing_binary_note,
)
from bench.workloads import (
    BenchRequest,
    add_common_args,
    checkpoint,
    command_line,
    load_transformers_model,
    mixed_requests,
    shipped_gguf,
)

if TYPE_CHECKING:
    from backend_engine import LLM


# Our arms: label -> --dequantize.
ARMS = {"tollway (GGUF blocks as stored)": False, "tollway --dequantize (float32)": True}


def build_ours(model: str, max_num_seqs: int, num_threads: int, dequantize: bool) -> LLM:
    from backend_engine import LLM

    return LLM(
        model=model,
        dtype="float32",
        dequantize=dequantize,
        max_num_seqs=max_num_seqs,
        kv_cache_memory_bytes=1 << 30,
        num_threads=num_threads or None,
    )


def run_ours(llm: LLM, requests: list[BenchRequest]) -> float:
    from backend_engine import SamplingParams

    params = [
        SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests
    ]
    start = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in requests], params)
    elapsed = time.perf_counter() - start
    assert [len(o.token_ids) for o in outputs] == [r.max_tokens for r in requests]
    return elapsed


def run_transformers(hf: torch.nn.Module, requests: list[BenchRequest], batch_size: int) -> float:
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
            hf.generate(  # type: ignore[operator]
                ids,
                attention_mask=mask,
                do_sample=False,
                pad_token_id=0,
                max_new_tokens=max(r.max_tokens for r in batch),
            )
    return time.perf_counter() - start


def run_llamacpp(server: LlamaServer, requests: list[BenchRequest]) -> float:
    """All requests at once, one slot each; seconds until the last one finishes."""
    server.complete(requests[0].prompt_token_ids[:8], max_tokens=2)  # warm-up
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        replies = list(
            pool.map(lambda r: server.complete(r.prompt_token_ids, r.max_tokens), requests)
        )
    elapsed = time.perf_counter() - start
    assert [len(c.token_ids) for c in replies] == [r.max_tokens for r in requests]
    return elapsed


def _runs(values: list[float]) -> str:
    return f"{statistics.median(values):8.1f} output tokens/s  (runs: " + (
        ", ".join(f"{x:.0f}" for x in values) + ")"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--prompt-lens", type=int, nargs=2, default=(32, 512))
    parser.add_argument("--output-lens", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    add_llamacpp_args(parser)
    parser.add_argument(
        "--skip-transformers",
        action="store_true",
        help="no transformers arm (it is the slowest: minutes on 2 cores)",
    )
    add_common_args(parser, default_model="smollm2")
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    num_threads = torch.get_num_threads()

    model = checkpoint(args.model, args.size)
    llms = {
        label: build_ours(model, args.max_num_seqs, args.num_threads, dequantize)
        for label, dequantize in ARMS.items()
    }
    vocab = next(iter(llms.values())).engine.model_config.vocab_size
    requests = mixed_requests(args.num_requests, vocab, args.prompt_lens, args.output_lens)
    useful = sum(r.max_tokens for r in requests)
    for llm in llms.values():
        run_ours(llm, requests[:1])  # warm-up
    hf = None if args.skip_transformers else load_transformers_model(model)

    binary, gguf, fa_settings_run = llamacpp_arm(args, model, shipped_gguf())
    context_per_slot = args.prompt_lens[1] + args.output_lens[1] + 16

    ours: dict[str, list[float]] = {label: [] for label in llms}
    theirs: list[float] = []
    llamacpp: dict[bool, list[float]] = {fa: [] for fa in fa_settings_run}
    flags: dict[bool, str] = {}
    for _ in range(args.repeats):
        for label, llm in llms.items():
            ours[label].append(useful / run_ours(llm, requests))
        if hf is not None:
            theirs.append(useful / run_transformers(hf, requests, args.hf_batch_size))
        for fa in fa_settings_run:
            assert binary is not None
            assert gguf is not None
            with LlamaServer(
                binary, gguf, len(requests), context_per_slot, fa, num_threads
            ) as server:
                llamacpp[fa].append(useful / run_llamacpp(server, requests))
                flags[fa] = server.settings

    print(f"command: {command_line()}")
    print(f"model: {model}; torch threads: {num_threads}")
    print(
        f"requests: {len(requests)}, useful output tokens: {useful}, "
        f"prompt tokens: {sum(len(r.prompt_token_ids) for r in requests)}"
    )
    for label, values in ours.items():
        print(f"{label + ':':34}{_runs(values)}")
    if theirs:
        print(f"{'transformers generate (float32):':34}{_runs(theirs)}")
        for label, values in ours.items():
            ratio = statistics.median(values) / statistics.median(theirs)
            print(f"ratio ({label} / transformers): {ratio:.2f}x")
    if not llamacpp:
        print(missing_binary_note() if binary is None else "llama.cpp arm skipped")
        return
    for fa, values in llamacpp.items():
        print(f"llama.cpp {flags[fa] + ':':30}{_runs(values)}")
    best = max(statistics.median(v) for v in llamacpp.values())
    for label, values in ours.items():
        ratio = statistics.median(values) / best
        met = "met" if ratio >= 3 else "NOT met"
        print(f"ratio ({label} / llama.cpp's best): {ratio:.2f}x  (target >= 3x: {met})")
    print(f"(llama.cpp reads {gguf})")


if __name__ == "__main__":
    main()
