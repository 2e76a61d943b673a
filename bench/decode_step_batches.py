"""Decode step time by batch size: the native decoder against the same engine layer by layer.

    python -m bench.decode_step_batches                    # SmolLM2-135M GGUF
    python -m bench.decode_step_batches --batches 1 4 16 --repeats 3

A decode-only step of at most ``kernels.cpu_decoder.MAX_TOKENS`` sequences runs every layer
in one native call (``kernels/cpu_decoder.py``); this bench runs the same engine with that
path switched off (``CausalLM.native_decoder = None``, so each layer runs one operation at a
time), in the same process, alternating. For each batch size: that many requests of
``--prompt-len`` tokens are prefilled, then ``--output-len`` decode steps are timed (the
median step, schedule and sampling included); the best of ``--repeats`` alternations is
quoted, with the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workloads import add_common_args, checkpoint, command_line

if TYPE_CHECKING:
    from backend_engine import LLM


def median_decode_step(llm: LLM, batch: int, prompt_len: int, output_len: int) -> float:
    """Seconds of the median decode step of ``batch`` greedy sequences."""
    from backend_engine import SamplingParams

    engine = llm.engine
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=output_len + 1, ignore_eos=True)
    for i in range(batch):
        prompt = [10 + (j * 7919 + i * 104729) % (vocab - 20) for j in range(prompt_len)]
        engine.add_request(f"step-{time.monotonic_ns()}-{i}", prompt, params)
    steps: list[float] = []
    while engine.has_unfinished():
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        # A step in which every sequence got a token after its first is a decode step.
        if len(outputs) == batch and all(len(o.new_token_ids) == 1 for o in outputs):
            steps.append(elapsed)
    steps = steps[1:]  # the first step after the prefills samples their first tokens
    return statistics.median(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=32)
    add_common_args(parser, repeats=2, default_model="smollm2")
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)

    from backend_engine import LLM

    model_path = checkpoint(args.model, args.size)
    llm = LLM(model=model_path, dtype="float32", enable_prefix_caching=False)
    model = llm.engine.runner.model
    native = model.native_decoder
    if native is None:
        raise SystemExit("the native decoder is not available here (see kernels/cpu_decoder.py)")
    median_decode_step(llm, 1, args.prompt_len, 4)  # warm-up
    print(f"command: {command_line()}")
    print(
        f"model: {model_path}; torch threads: {torch.get_num_threads()}; prompts "
        f"{args.prompt_len} tokens, {args.output_len} decode steps, repeats: {args.repeats}"
    )
    print("sequences | native decoder, ms | layer by layer, ms | ratio")
    for batch in args.batches:
        ours, layered = [], []
        for _ in range(args.repeats):
            model.native_decoder = native
            ours.append(median_decode_step(llm, batch, args.prompt_len, args.output_len))
            model.native_decoder = None
            layered.append(median_decode_step(llm, batch, args.prompt_len, args.output_len))
        model.native_decoder = native
        print(
            f"{batch:9d} | {min(ours) * 1e3:18.1f} | {min(layered) * 1e3:18.1f} | "
            f"{min(layered) / min(ours):.2f}x"
        )


if __name__ == "__main__":
    main()
