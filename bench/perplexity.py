"""Perplexity of a checkpoint on real English text, through the engine's own prompt logprobs.

    python -m bench.perplexity                                 # the shipped SmolLM2 GGUF
    python -m bench.perplexity --model DIR --num-tokens 40000 --window 2048

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

    llm = LLM(model, show_progress=False, **engine_options)  # type: ignore[arg-type]
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
    args = parser.parse_args()
    model = checkpoint(args.model, "small")

    from model_files.checkpoint import Checkpoint

    tokenizer = Checkpoint(model).tokenizer()
    token_ids = tokenizer.encode(reference_text(), add_special_tokens=False)
    if len(token_ids) < args.num_tokens:
        raise SystemExit(f"the text has {len(token_ids)} tokens, fewer than --num-tokens")
    prompts = windows(token_ids[: args.num_tokens], args.window)
    started = time.perf_counter()
    logprobs = score(model, prompts)
    seconds = time.perf_counter() - started
    print(f"command: {command_line()}")
    print(
        f"model: {model}; text: pydoc_data.topics (Python {sys.version.split()[0]}), first "
        f"{args.num_tokens} tokens in {len(prompts)} windows of {args.window}; "
        f"{len(logprobs)} predicted tokens; {seconds:.1f} s"
    )
    print(f"perplexity: {perplexity(logprobs):.4f}")


if __name__ == "__main__":
    main()
