"""Time to first token of a ~1,000-token chat prompt, cold and with its system prompt
cached, our engine beside llama.cpp's ``llama-server`` with ``cache_prompt``, in one run.

    python -m bench.chat_ttft                      # SmolLM2-135M GGUF, 1,000-token prompts
    python -m bench.chat_ttft --model DIR --gguf FILE.gguf --prompt-tokens 1000 --repeats 5

Each repeat writes a fresh system prompt (about 90% of the prompt) and two user questions,
renders ``[system, user]`` with the model's chat template and encodes it with our
tokenizer; both engines get the same token ids. Then, on each engine:

- *cold*: the first question: nothing of the system prompt is cached anywhere;
- *cached*: the second question after the same system prompt: our prefix cache (on, as
  served) and llama.cpp's slot cache (``cache_prompt: true``, one slot) hold the system
  prompt's tokens, and only the rest is prefilled.

TTFT is the wall time of a request for one token (ours: ``LLM.generate`` with
``max_tokens=1``; llama.cpp: an HTTP ``/completion`` with ``n_predict: 1`` on localhost,
which adds well under a millisecond). llama.cpp runs with flash attention off and on;
its best setting is compared.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
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
from bench.workloads import add_common_args, checkpoint, command_line, shipped_gguf

if TYPE_CHECKING:
    from backend_engine import LLM
    from model_files.tokenizer import Tokenizer

_WORDS = (
    "the gateway engine request token model cache block answer question user system policy "
    "budget limit tenant stream prompt reply memory schedule batch decode prefill latency "
    "throughput weight layer attention query key value vector matrix kernel thread core "
    "always never carefully briefly politely exactly quickly must should may will can "
    "read write check count send keep drop move split merge route price bill log"
)
_SYSTEM_SHARE = 0.9  # of the prompt's tokens


def _sentences(rng: random.Random) -> str:
    vocabulary = _WORDS.split()
    words = [rng.choice(vocabulary) for _ in range(rng.randint(8, 16))]
    return " ".join(words).capitalize() + ". "


def _text_of(tokenizer: Tokenizer, rng: random.Random, num_tokens: int, head: str) -> str:
    text = head
    while len(tokenizer.encode(text, add_special_tokens=False)) < num_tokens:
        text += _sentences(rng)
    return text


def chat_prompts(
    tokenizer: Tokenizer, rng: random.Random, num_tokens: int, session: int
) -> tuple[list[int], list[int], int]:
    """Two prompts (ids) of about ``num_tokens`` sharing a fresh system prompt, and the number
    of tokens they share."""
    system = _text_of(
        tokenizer, rng, int(num_tokens * _SYSTEM_SHARE), f"Session {session}. You are a helper. "
    )
    user_tokens = num_tokens - int(num_tokens * _SYSTEM_SHARE) - 20  # the template's own
    prompts = [
        tokenizer.encode_chat(
            [
                {"role": "system", "content": system},
                {"role": "user", "content": _text_of(tokenizer, rng, user_tokens, f"Q{k}: ")},
            ]
        )
        for k in (1, 2)
    ]
    shared = 0
    while prompts[0][shared] == prompts[1][shared]:
        shared += 1
    return prompts[0], prompts[1], shared


def our_ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token, and how many prompt tokens came from the cache."""
    from backend_engine import SamplingParams

    start = time.perf_counter()
    (output,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    elapsed = time.perf_counter() - start
    assert len(output.token_ids) == 1
    return elapsed, output.num_cached_tokens


def their_ttft(server: LlamaServer, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token, and how many prompt tokens the server reused."""
    start = time.perf_counter()
    reply = server.complete(prompt, 1, cache_prompt=True)
    elapsed = time.perf_counter() - start
    return elapsed, len(prompt) - reply.num_prompt_tokens


def _line(label: str, seconds: list[float], cached: list[int]) -> str:
    return (
        f"{label:28s} TTFT {statistics.median(seconds) * 1e3:8.1f} ms  (runs: "
        + ", ".join(f"{s * 1e3:.0f}" for s in seconds)
        + f" ms; cached tokens: {', '.join(map(str, cached))})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    add_llamacpp_args(parser)
    add_common_args(parser, repeats=5, default_model="smollm2")
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    num_threads = torch.get_num_threads()

    from backend_engine import LLM

    model = checkpoint(args.model, args.size)
    llm = LLM(model=model, dtype="float32", enable_prefix_caching=True, num_threads=num_threads)
    rng = random.Random(0)
    sessions = [
        chat_prompts(llm.tokenizer, rng, args.prompt_tokens, i) for i in range(1 + args.repeats)
    ]

    binary, gguf, fa_run = llamacpp_arm(args, model, shipped_gguf())
    context = max(len(p) for s in sessions for p in s[:2]) + 16
    servers = {
        fa: LlamaServer(binary, gguf, 1, context, fa, num_threads)
        for fa in fa_run
        if binary is not None and gguf is not None
    }
    ttft: dict[str, list[float]] = {}
    cached: dict[str, list[int]] = {}

    def record(label: str, result: tuple[float, int]) -> None:
        ttft.setdefault(label, []).append(result[0])
        cached.setdefault(label, []).append(result[1])

    for server in servers.values():
        server.__enter__()
    try:
        warm_up, *timed = sessions
        for prompt in warm_up[:2]:
            our_ttft(llm, prompt)
            for server in servers.values():
                their_ttft(server, prompt)
        for first, second, _ in timed:
            record("tollway cold", our_ttft(llm, first))
            record("tollway system prompt cached", our_ttft(llm, second))
            for fa, server in servers.items():
                name = f"llama.cpp -fa {'on' if fa else 'off'}"
                record(f"{name} cold", their_ttft(server, first))
                record(f"{name} cached", their_ttft(server, second))
    finally:
        for server in servers.values():
            server.__exit__(None, None, None)

    print(f"command: {command_line()}")
    lengths = [len(p) for s in timed for p in s[:2]]
    print(
        f"model: {model}; torch threads: {num_threads}; prompts {min(lengths)}-{max(lengths)} "
        f"tokens, system prompt {statistics.median(s[2] for s in timed):.0f} of them; "
        f"repeats: {args.repeats}"
    )
    for label in ttft:
        print(_line(label, ttft[label], cached[label]))
    if not servers:
        print(missing_binary_note() if binary is None else "llama.cpp arm skipped")
        return
    print("llama.cpp flags: " + "; ".join(server.settings for server in servers.values()))
    for kind in ("cold", "cached"):
        ours = statistics.median(
            ttft["tollway cold" if kind == "cold" else "tollway system prompt cached"]
        )
        best = min(
            statistics.median(v)
            for k, v in ttft.items()
            if k.startswith("llama.cpp") and k.endswith(kind)
        )
        print(f"{kind}: llama.cpp's best / ours = {best / ours:.2f}x (above 1: we are faster)")


if __name__ == "__main__":
    main()
