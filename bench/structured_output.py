"""Structured outputs (issue #25): what a JSON Schema constraint costs our engine, and llama.cpp's
``json_schema`` on the same GGUF, side by side in one run.

    python -m bench.structured_output                     # SmolLM2 GGUF, 1 and 32 streams
    python -m bench.structured_output --streams 1 32 --repeats 5 --llamacpp-fa off

The workload is ``bench.structured_output_schemas``: eight schemas, four inputs each, as chat
prompts (1 stream: one prompt per schema, one request at a time; 32 streams: all 32 prompts
at once). Greedy throughout. It measures:

1. Output tokens/s with each request's ``json_schema`` constraint against none, the two arms
   alternating within the run (constrained first on even repeats). Lengths are matched: the
   unconstrained arm runs the same prompts with ``ignore_eos`` and ``max_tokens`` equal to
   that prompt's constrained answer's length (its end-of-sequence token included), taken
   from a constrained warm-up run; so both arms run the same steps over the same batch
   sizes, and the difference is the constraint's cost. Tokens/s is output tokens over the
   time from queueing the requests to the last one finishing (prefills included), with the
   grammars already compiled (a cache hit; compiling is item 3). Targets (issue #25): at
   most 10% slower at 1 stream and at most 5% at 32.
2. The mask's cost per token: ``mask_logits`` and ``accept_tokens`` timed directly, on fresh
   matchers replaying the answers the warm-up generated, one row at a time (p50/p99 per
   token) and as one batch per step, against the run's time; and the model runner's own
   calls of the two inside the constrained runs' real steps (the names it calls wrapped with
   a timer), as a share of each run: what computing the next masks during the forward pass
   could at most hide.
3. Compile time over the schemas, each on a fresh ``GrammarCompiler``: its first compile
   builds llguidance's tokenizer (reported apart), the schema's compile after it is cold,
   and the same schema again is a cache hit.
4. llama.cpp's ``llama-server`` (``bench/llamacpp_server.py``; one slot per stream) on the
   same prompt token ids with ``json_schema`` on its native ``/completion``, greedy, and
   unconstrained with its own answers' lengths. Its answers differ from ours (its grammar
   lets whitespace vary), so tokens/s is compared, and each side's answers are checked
   against their schemas. It serves over HTTP, one response per request; ours runs in
   process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jsonschema
import torch

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend_engine.structured_output.constraint import OutputConstraint
from bench.llamacpp_server import (
    LlamaServer,
    add_llamacpp_args,
    llamacpp_arm,
    missing_binary_note,
)
from bench.structured_output_costs import RunnerGrammarTime, compile_times, mask_cost, p50_p99
from bench.structured_output_schemas import TASKS, SchemaPrompt, schema_prompts
from bench.workloads import add_common_args, checkpoint, command_line, shipped_gguf

if TYPE_CHECKING:
    from backend_engine import LLM, SamplingParams
    from backend_engine.llm_engine import LLMEngine
    from model_files.tokenizer import Tokenizer

TARGET_SLOWDOWN = {1: 0.10, 32: 0.05}  # issue #25: the most a constraint may cost


@dataclass(frozen=True)
class Run:
    """One arm's run over a set of prompts, in waves of ``streams`` requests."""

    answers: list[list[int]]  # output token ids, per prompt
    finish_reasons: list[str]
    elapsed_s: float  # summed over the waves
    runner_grammar_s: float = 0.0  # of which in the model runner's mask_logits + accept_tokens

    @property
    def num_tokens(self) -> int:
        return sum(len(a) for a in self.answers)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s


def run_ours(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    streams: int,
    grammar_time: RunnerGrammarTime | None = None,
) -> Run:
    """The prompts through the engine, ``streams`` at a time (``grammar_time``: also time the
    runner's grammar calls)."""
    if grammar_time is not None:
        with grammar_time:
            run = run_ours(engine, prompts, params, streams)
        return dataclasses.replace(run, runner_grammar_s=grammar_time.seconds)
    answers: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    order: list[str] = []
    elapsed = 0.0
    for first in range(0, len(prompts), streams):
        start = time.perf_counter()
        for prompt, sampling in zip(
            prompts[first : first + streams], params[first : first + streams], strict=True
        ):
            request_id = f"so-{time.monotonic_ns()}-{len(order)}"
            engine.add_request(request_id, prompt, sampling)
            order.append(request_id)
            answers[request_id] = []
        while engine.has_unfinished():
            for delta in engine.step():
                answers[delta.request_id].extend(delta.new_token_ids)
                if delta.finished:
                    if delta.error:
                        raise RuntimeError(f"{delta.request_id} failed: {delta.error}")
                    reasons[delta.request_id] = str(delta.finish_reason)
        elapsed += time.perf_counter() - start
    return Run([answers[r] for r in order], [reasons[r] for r in order], elapsed)


def run_llamacpp(
    server: LlamaServer,
    prompts: list[list[int]],
    bodies: list[dict[str, Any]],
    streams: int,
) -> Run:
    """Each prompt with its extra ``/completion`` fields, ``streams`` at a time."""
    answers: list[list[int]] = []
    reasons: list[str] = []
    elapsed = 0.0
    with ThreadPoolExecutor(max_workers=streams) as pool:
        for first in range(0, len(prompts), streams):
            wave = list(
                zip(prompts[first : first + streams], bodies[first : first + streams], strict=True)
            )
            start = time.perf_counter()
            replies = list(pool.map(lambda pb: _llamacpp_complete(server, *pb), wave))
            elapsed += time.perf_counter() - start
            for tokens, reason in replies:
                answers.append(tokens)
                reasons.append(reason)
    return Run(answers, reasons, elapsed)


def _llamacpp_complete(
    server: LlamaServer, prompt: list[int], extra: dict[str, Any]
) -> tuple[list[int], str]:
    body = {"prompt": prompt, "temperature": 0, "top_k": 1, "cache_prompt": False}
    reply = server.post_completion(body | extra | {"return_tokens": True})
    return list(reply["tokens"]), str(reply.get("stop_type", "?"))


def valid_answers(texts: list[str], prompts: list[SchemaPrompt]) -> int:
    """How many answers parse as JSON and match their schema."""
    valid = 0
    for text, prompt in zip(texts, prompts, strict=True):
        try:
            jsonschema.validate(json.loads(text), prompt.task.schema)
        except (ValueError, jsonschema.ValidationError):
            continue
        valid += 1
    return valid


def _runs(values: list[float], fmt: str = ".1f") -> str:
    return (
        f"{statistics.median(values):{fmt}} (runs: " + ", ".join(f"{v:{fmt}}" for v in values) + ")"
    )


def _load() -> str:
    return "load average (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def measure_ours(
    llm: LLM, chats: list[SchemaPrompt], streams: int, max_tokens: int, repeats: int
) -> tuple[Run, list[Run], list[Run]]:
    """(the constrained warm-up, constrained runs, unconstrained runs), alternating."""
    from backend_engine import SamplingParams

    prompts = [llm.tokenizer.encode_chat(c.messages) for c in chats]
    constrained = [
        SamplingParams(
            temperature=0,
            max_tokens=max_tokens,
            structured_output=OutputConstraint.json_schema(c.task.schema, "response_format"),
        )
        for c in chats
    ]
    warm = run_ours(llm.engine, prompts, constrained, streams)
    free = [SamplingParams(temperature=0, max_tokens=len(a), ignore_eos=True) for a in warm.answers]
    run_ours(llm.engine, prompts, free, streams)  # its warm-up
    with_schema, without = alternating(
        lambda: run_ours(llm.engine, prompts, constrained, streams, RunnerGrammarTime()),
        lambda: run_ours(llm.engine, prompts, free, streams),
        repeats,
    )
    return warm, with_schema, without


def report_ours(
    llm: LLM, chats: list[SchemaPrompt], streams: int, runs: tuple[Run, list[Run], list[Run]]
) -> float:
    """Prints item 1 and 2 for one stream count; returns the constrained median tokens/s."""
    warm, with_schema, without = runs
    texts = [llm.tokenizer.decode(a) for a in warm.answers]
    lengths = [len(a) for a in warm.answers]
    cut = warm.finish_reasons.count("length")
    print(
        f"\n== {streams} stream(s): {len(chats)} prompts ({len(TASKS)} schemas), waves of "
        f"{streams}; {warm.num_tokens} output tokens a run (answers {min(lengths)}-"
        f"{max(lengths)} tokens; {cut} cut at max_tokens; "
        f"{valid_answers(texts, chats)}/{len(chats)} parse and match their schema)"
    )
    drift = sum(r.answers != warm.answers for r in with_schema)
    print(
        "lengths matched: unconstrained = same prompts, ignore_eos, max_tokens = each prompt's "
        f"constrained answer length ({drift} constrained run(s) differed from the warm-up)"
    )
    rate_with = [r.tokens_per_s for r in with_schema]
    rate_without = [r.tokens_per_s for r in without]
    ratios = [a / b for a, b in zip(rate_with, rate_without, strict=True)]
    print(f"  json_schema    {_runs(rate_with)} output tokens/s")
    print(f"  unconstrained  {_runs(rate_without)} output tokens/s")
    slowdown = 1 - statistics.median(ratios)
    target = TARGET_SLOWDOWN.get(streams)
    verdict = (
        f"; target <= {target:.0%}: {'met' if slowdown <= target else 'NOT met'}" if target else ""
    )
    print(
        f"  constrained / unconstrained: {statistics.median(ratios):.3f} (per repeat "
        + ", ".join(f"{x:.3f}" for x in ratios)
        + f"): {abs(slowdown):.1%} {'slower' if slowdown >= 0 else 'faster'}{verdict}"
    )
    grammars = [
        llm.engine.grammars.compile(OutputConstraint.json_schema(c.task.schema, "bench"))
        for c in chats
    ]
    cost = mask_cost(grammars, warm.answers, llm.engine.model_config.vocab_size)
    print(
        f"  mask_logits per token (1 row): {p50_p99(cost.per_token_mask, 1e6, 'us')}; "
        f"accept_tokens: {p50_p99(cost.per_token_accept, 1e6, 'us')}"
    )
    constrained_time = statistics.median(r.elapsed_s for r in with_schema)
    if streams >= len(chats):  # one wave: the replay's batches are the run's
        steps = cost.num_batched_steps
        print(
            f"  mask + accept for all {cost.max_batch_rows} rows, replayed step by step: "
            f"{cost.batched_total * 1e3:.1f} ms over {steps} steps "
            f"({cost.batched_total / steps * 1e3:.2f} ms a step) = "
            f"{cost.batched_total / constrained_time:.2%} of the constrained run's "
            f"{constrained_time:.2f} s"
        )
    else:
        total = sum(cost.per_token_mask) + sum(cost.per_token_accept)
        print(
            f"  mask + accept over the run's {len(cost.per_token_mask)} tokens: "
            f"{total * 1e3:.1f} ms = {total / constrained_time:.2%} of the constrained run's "
            f"{constrained_time:.2f} s ({constrained_time / warm.num_tokens * 1e3:.1f} ms a token)"
        )
    shares = [100 * r.runner_grammar_s / r.elapsed_s for r in with_schema]
    print(
        "  inside the constrained runs' steps, the runner's own mask_logits + accept_tokens: "
        f"{_runs(shares, '.2f')} % of the run"
    )
    return statistics.median(rate_with)


def report_llamacpp(
    server: LlamaServer,
    chats: list[SchemaPrompt],
    prompts: list[list[int]],
    streams: int,
    max_tokens: int,
    repeats: int,
    tokenizer: Tokenizer,
) -> float:
    """Prints item 4 for one server; returns its constrained median tokens/s."""
    constrained = [{"n_predict": max_tokens, "json_schema": c.task.schema} for c in chats]
    warm = run_llamacpp(server, prompts, constrained, streams)
    free = [{"n_predict": len(a), "ignore_eos": True} for a in warm.answers]
    with_schema, without = alternating(
        lambda: run_llamacpp(server, prompts, constrained, streams),
        lambda: run_llamacpp(server, prompts, free, streams),
        repeats,
    )
    texts = [tokenizer.decode(a) for a in warm.answers]
    rate_with = [r.tokens_per_s for r in with_schema]
    rate_without = [r.tokens_per_s for r in without]
    ratios = [a / b for a, b in zip(rate_with, rate_without, strict=True)]
    print(
        f"  llama.cpp {server.settings}: {warm.num_tokens} output tokens a run, "
        f"{warm.finish_reasons.count('limit')} cut at n_predict, "
        f"{valid_answers(texts, chats)}/{len(chats)} parse and match their schema"
    )
    print(f"    json_schema    {_runs(rate_with)} output tokens/s")
    print(f"    unconstrained  {_runs(rate_without)} output tokens/s (its own answers' lengths)")
    print(f"    its constrained / unconstrained: {statistics.median(ratios):.3f}")
    return statistics.median(rate_with)


def alternating(
    run_with: Callable[[], Run], run_without: Callable[[], Run], repeats: int
) -> tuple[list[Run], list[Run]]:
    """``repeats`` runs of each arm, alternating: constrained first on even repeats."""
    with_schema: list[Run] = []
    without: list[Run] = []
    for repeat in range(repeats):
        if repeat % 2 == 0:
            with_schema.append(run_with())
            without.append(run_without())
        else:
            without.append(run_without())
            with_schema.append(run_with())
    return with_schema, without


def report_compile(llm: LLM, repeats: int) -> None:
    constraints = {t.name: OutputConstraint.json_schema(t.schema, "bench") for t in TASKS}
    times = compile_times(llm.tokenizer, llm.engine.model_config.vocab_size, constraints, repeats)
    print(f"\n== compile, {len(TASKS)} schemas x {repeats}, a fresh GrammarCompiler each")
    print(
        "  first compile on a fresh compiler (a 1-character regex; builds llguidance's "
        f"tokenizer): {p50_p99(times.first_compile, 1e3, 'ms')}"
    )
    print(f"  schema, cold cache: {p50_p99(times.cold, 1e3, 'ms')}")
    print(
        "    per schema, median ms: "
        + ", ".join(
            f"{n} {statistics.median(v) * 1e3:.2f}" for n, v in times.cold_by_schema.items()
        )
    )
    print(f"  schema, cache hit: {p50_p99(times.cache_hit, 1e6, 'us')}")
    matcher = p50_p99(times.new_matcher, 1e6, "us")
    print(f"  new_matcher (a request's copy of the start state): {matcher}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--compile-repeats", type=int, default=5)
    add_llamacpp_args(parser)
    add_common_args(parser, repeats=3, default_model="smollm2")
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    num_threads = torch.get_num_threads()
    print(f"command: {command_line()}")
    print(f"start: {_load()}")

    from backend_engine import LLM

    model = checkpoint(args.model, args.size)
    llm = LLM(
        model=model,
        dtype="float32",
        max_num_seqs=max(args.streams),
        kv_cache_memory_bytes=1 << 30,
        enable_prefix_caching=False,
        num_threads=num_threads,
    )
    print(
        f"model: {model}; torch threads: {num_threads}; repeats: {args.repeats}; greedy; "
        f"max_tokens {args.max_tokens}; prefix caching off"
    )
    binary, gguf, fa_run = llamacpp_arm(args, model, shipped_gguf())
    ours: dict[int, float] = {}
    theirs: dict[tuple[int, bool], float] = {}
    for streams in args.streams:
        chats = schema_prompts(max(streams, len(TASKS)))
        runs = measure_ours(llm, chats, streams, args.max_tokens, args.repeats)
        ours[streams] = report_ours(llm, chats, streams, runs)
        prompts = [llm.tokenizer.encode_chat(c.messages) for c in chats]
        context = max(len(p) for p in prompts) + args.max_tokens + 16
        for fa in fa_run:
            if binary is None or gguf is None:
                break
            with LlamaServer(binary, gguf, streams, context, fa, num_threads) as server:
                theirs[streams, fa] = report_llamacpp(
                    server, chats, prompts, streams, args.max_tokens, args.repeats, llm.tokenizer
                )
        best = [rate for (s, _), rate in theirs.items() if s == streams]
        if best:
            print(
                f"  ours / llama.cpp's best, constrained: {ours[streams] / max(best):.2f}x "
                f"({ours[streams]:.1f} against {max(best):.1f} tokens/s)"
            )
    if not fa_run:
        print(missing_binary_note() if binary is None else "llama.cpp arm skipped")
    report_compile(llm, args.compile_repeats)
    print(f"end: {_load()}")


if __name__ == "__main__":
    main()
