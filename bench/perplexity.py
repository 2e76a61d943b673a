"""Perplexity of a checkpoint on real English text, through the engine's own prompt logprobs.

    python -m bench.perplexity                                 # the shipped SmolLM2 GGUF
    python -m bench.perplexity --model DIR --num-tokens 40000 --window 2048
    python -m bench.perplexity --arms float32,as-stored,kv-int8   # side by side, one run

Each arm is a way of serving the same checkpoint (`ARMS`: widened to float32, a GGUF file's
blocks as stored, int8/int4 weights quantized at load, an int8 KV cache); the first arm is the
baseline the others' ratios are against.

The text is the Python Language Reference and library topics that ship with every CPython
(``pydoc_data.topics``, the help() pages: some 90,000 SmolLM2 tokens): human-written English
prose with code snippets, on every machine and never downloaded. It is fair for what this
measures, a *relative* perplexity (a quantized model's against the same checkpoint in
float32, an int8 KV cache's against a float32 one): every arm reads the same tokens in the same
windows, so what the text favours or not cancels out. Its absolute perplexity is not
comparable with published figures on WikiText (another text, another tokenization).

The first ``--num-tokens`` tokens of the text (topics in sorted order) are cut into windows of
``--window`` tokens, each scored as its own prompt with ``prompt_logprobs``: every token but a
window's first is predicted from the window's tokens before it, and perplexity is
``exp(-mean log p)`` over those predictions. Windows that do not overlap keep the run short and
equal across arms; a token's context is therefore between 0 and ``--window`` - 1 tokens.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workloads import checkpoint, command_line

# An arm: engine options on the same checkpoint, every one in float32 activations.
ARMS: dict[str, dict[str, object]] = {
    "float32": {"dequantize": True},  # a GGUF file's blocks widened to float32 at load
    "as-stored": {},  # a GGUF file's blocks as stored (a float checkpoint: the same as float32)
    # ...with steps of 9 tokens, so every linear runs the split int8 kernel that decode steps
    # run (steps of `cpu_quant_linear.WIDEN_MIN_ROWS` = 10 rows or more widen the blocks for a
    # float32 matmul)
    "as-stored-9": {"max_num_batched_tokens": 9},
    "int8": {"quantization": "int8"},  # a float checkpoint's linears, int8 per channel
    "int4": {"quantization": "int4"},  # int4 in groups of 32
    "int4-g64": {"quantization": "int4", "quantization_group_size": 64},
    "kv-int8": {"dequantize": True, "kv_cache_dtype": "int8"},  # float32 weights, int8 KV
}


def reference_text() -> str:
    """The Python help() topics, in sorted order: the same text on every machine."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def windows(token_ids: list[int], size: int) -> list[list[int]]:
    """``token_ids`` cut into consecutive windows of ``size`` (the last may be shorter; one of
    a single token predicts nothing and is dropped)."""
    if size < 2:
        raise ValueError(f"a window needs at least 2 tokens, got {size}")
    cut = [token_ids[start : start + size] for start in range(0, len(token_ids), size)]
    return [window for window in cut if len(window) >= 2]


def perplexity(logprobs: list[float]) -> float:
    """``exp`` of the mean negative log-likelihood of the predicted tokens."""
    if not logprobs:
        raise ValueError("no predicted tokens to score")
    return math.exp(-math.fsum(logprobs) / len(logprobs))


def score(model: str, prompts: list[list[int]], **engine_options: object) -> list[float]:
    """Each prompt token's log-probability given the tokens before it in its window (a
    window's first token, predicted from nothing, is left out)."""
    from backend_engine.llm import LLM
    from backend_engine.sampling_params import SamplingParams

    llm = LLM(model, dtype="float32", show_progress=False, **engine_options)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    outputs = llm.generate(prompts, params)
    logprobs: list[float] = []
    for prompt, output in zip(prompts, outputs, strict=True):
        entries = output.prompt_logprobs
        if entries is None or len(entries) != len(prompt):
            raise RuntimeError(f"the engine gave no logprob for every prompt token of {prompt[:4]}")
        logprobs.extend(entry.logprob for entry in entries[1:] if entry is not None)
    return logprobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="a checkpoint, or 'smollm2' (default)")
    parser.add_argument("--num-tokens", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument(
        "--arms",
        default="float32",
        help=f"comma-separated, the first the baseline; of {', '.join(ARMS)}",
    )
    args = parser.parse_args()
    arms = args.arms.split(",")
    unknown = [arm for arm in arms if arm not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; choose from {list(ARMS)}")
    model = checkpoint(args.model, "small")

    from model_files.checkpoint import Checkpoint

    tokenizer = Checkpoint(model).tokenizer()
    token_ids = tokenizer.encode(reference_text(), add_special_tokens=False)
    if len(token_ids) < args.num_tokens:
        raise SystemExit(f"the text has {len(token_ids)} tokens, fewer than --num-tokens")
    prompts = windows(token_ids[: args.num_tokens], args.window)
    print(f"command: {command_line()}")
    print(
        f"model: {model}; text: pydoc_data.topics (Python {sys.version.split()[0]}), first "
        f"{args.num_tokens} tokens in {len(prompts)} windows of {args.window}"
    )
    baseline: float | None = None
    for arm in arms:
        started = time.perf_counter()
        logprobs = score(model, prompts, **ARMS[arm])
        seconds = time.perf_counter() - started
        value = perplexity(logprobs)
        baseline = value if baseline is None else baseline
        print(
            f"{arm:>10}: perplexity {value:.4f}  ({value / baseline - 1:+.2%} against "
            f"{arms[0]}; {len(logprobs)} predicted tokens, {seconds:.1f} s)"
        )


if __name__ == "__main__":
    main()
