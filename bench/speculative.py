"""Speculative decoding on SmolLM2: speculation off against each proposer, side by side in one
run, with llama.cpp's server and its own n-gram speculation on the same GGUF.

    python -m bench.speculative                          # float32 and as-stored targets
    python -m bench.speculative --targets float32 --arms off,ngram,draft --repeats 3
    python -m bench.speculative --crossover              # where speculation stops paying

Targets (the model that answers): ``float32`` (the shipped Q4_1 GGUF widened at load,
``--dequantize``) and ``as-stored`` (its blocks read by the quantized CPU kernels). Arms:

- ``off``: no speculation;
- ``ngram``: prompt lookup (``--speculative-proposer ngram``);
- ``draft``: a draft model (``--speculative-proposer draft``), the shipped Q4_1 file as stored
  drafting for the target (for the float32 target: the same model at 4 bits, the target's
  own bits: an upper bound on acceptance), or ``--draft-model FILE``, e.g. the float32 copy
  quantized again (``tollway convert F32_DIR out.gguf --quantization int4 --group-size 64``:
  GPTQ, other bits than the target's).

Measured, per target and arm (medians over ``--repeats``; the arms' engines are all loaded
and take turns within each repeat, in reverse order on odd repeats, so the machine's drift
falls on every arm alike):

- **single stream**, each workload of bench/speculative_prompts.py (copy-heavy: rewrite,
  fix code, extract fields; open chat), greedy, the answer's natural length up to
  ``--max-tokens``: output tokens after the first over the time after the first step (the
  prefill), summed over the workload's prompts. Every arm must give the same tokens as
  ``off`` (greedy speculation is exact): a mismatch is printed.
- **32 concurrent streams** (``--streams``): the workloads' prompts round-robin, each
  request's output tokens over the wall time of the batch.
- the proposer's acceptance rate and accepted drafts per verifying step, from the engine's
  counters (what ``/metrics`` shows).

Targets from the issue: copy-heavy single stream >= 2x with n-gram; open chat >= 0.95x; 32
streams >= 0.95x. ``--crossover`` instead runs the copy-heavy prompts at batch sizes 1 to 16
with the crossover disabled and prints ngram / off per batch size: the largest batch where
speculation still pays is the default ``speculative_crossover_batch_size``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.llamacpp_server import LlamaServer, find_llama_server, missing_binary_note
from bench.speculative_prompts import COPY_HEAVY, OPEN_CHAT, WORKLOADS
from bench.workloads import command_line, shipped_gguf

if TYPE_CHECKING:
    from backend_engine import LLM
    from backend_engine.outputs import SpeculativeCounts

TARGETS = {"float32": True, "as-stored": False}  # name -> dequantize
ARMS = ("off", "ngram", "draft")
# llama.cpp's n-gram speculation: its defaults, and a shorter lookup closer to ours.
LLAMACPP_NGRAM = {
    "ngram-simple (defaults)": ("--spec-type", "ngram-simple"),
    "ngram-simple n=3 m=8": (
        "--spec-type",
        "ngram-simple",
        "--spec-ngram-simple-size-n",
        "3",
        "--spec-ngram-simple-size-m",
        "8",
    ),
}


@dataclass(frozen=True)
class StreamRun:
    tokens_per_s: float
    token_ids: tuple[tuple[int, ...], ...]


def build(
    gguf: str,
    dequantize: bool,
    arm: str,
    num_threads: int,
    crossover: int | None,
    k: int = 0,
    draft_model: str | None = None,
) -> LLM:
    from backend_engine import LLM

    options: dict[str, Any] = {"num_speculative_tokens": k} if k and arm != "off" else {}
    if arm != "off":
        options["speculative_proposer"] = arm
    if arm == "draft":
        options["speculative_draft_model"] = draft_model or gguf
    if crossover is not None and arm != "off":
        options["speculative_crossover_batch_size"] = crossover
    return LLM(
        model=gguf,
        dequantize=dequantize,
        num_threads=num_threads,
        show_progress=False,
        kv_cache_memory_bytes=256 * 1024 * 1024,
        **options,
    )


def encode(llm: LLM, prompts: tuple[str, ...]) -> list[list[int]]:
    return [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]


def single_stream(llm: LLM, prompts: list[list[int]], max_tokens: int) -> StreamRun:
    """Greedy answers one at a time: tokens after the first over the time after the prefill."""
    from backend_engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    num_tokens, elapsed = 0, 0.0
    answers = []
    for prompt in prompts:
        request = engine.add_request(f"s-{time.monotonic_ns()}", prompt, params)
        engine.step()  # the prefill, which samples the first token
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        elapsed += time.perf_counter() - start
        num_tokens += request.num_output_tokens - 1
        answers.append(tuple(request.output_token_ids))
    return StreamRun(num_tokens / elapsed, tuple(answers))


def concurrent(llm: LLM, prompts: list[list[int]], num_streams: int, max_tokens: int) -> float:
    """Output tokens per second of ``num_streams`` requests run together."""
    from backend_engine import SamplingParams

    batch = [prompts[i % len(prompts)] for i in range(num_streams)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    start = time.perf_counter()
    outputs = llm.generate(batch, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outputs) / elapsed


def counts_delta(llm: LLM, before: SpeculativeCounts | None) -> str:
    from backend_engine.outputs import SpeculativeCounts

    stats = llm.engine.stats().speculative
    if not stats:
        return ""
    [after] = stats.values()
    base = before or SpeculativeCounts()
    chunks = after.num_verified_chunks - base.num_verified_chunks
    drafts = after.num_draft_tokens - base.num_draft_tokens
    kept = after.num_accepted_tokens - base.num_accepted_tokens
    if not drafts:
        return "no drafts"
    return f"acceptance {kept / drafts:.0%}, {kept / chunks:.2f} drafts kept a verifying step"


def current_counts(llm: LLM) -> SpeculativeCounts | None:
    stats = llm.engine.stats().speculative
    return next(iter(stats.values())) if stats else None


def in_turn(llms: dict[str, LLM], repeat: int) -> list[tuple[str, LLM]]:
    """The arms in order on even repeats and in reverse on odd ones, so that a machine
    speeding up or slowing down over a run favours no arm (one arm always first took the
    drift: as stored, 32 streams read 0.80x with no drafts at all)."""
    arms = list(llms.items())
    return arms if repeat % 2 == 0 else arms[::-1]


def run_target(args: argparse.Namespace, gguf: str, target: str) -> None:
    dequantize = TARGETS[target]
    print(f"\n## target: {target}")
    rates: dict[tuple[str, str], list[float]] = {}
    notes: dict[tuple[str, str], str] = {}
    reference: dict[str, tuple[tuple[int, ...], ...]] = {}
    llms: dict[str, LLM] = {}
    for arm in args.arms:
        try:
            llms[arm] = build(
                gguf, dequantize, arm, args.num_threads, None, args.k, args.draft_model
            )
        except Exception as exc:  # an arm that cannot start (no draft proposer) is reported
            print(f"{arm}: cannot start ({type(exc).__name__}: {exc})")
    # The arms take turns within each repeat (`in_turn`): the machine's speed drifts over
    # minutes, and a ratio of arms run one after the other would carry the drift.
    streams = f"{args.streams} streams"
    before = {arm: current_counts(llm) for arm, llm in llms.items()}
    for workload, texts in WORKLOADS.items():
        for arm, llm in llms.items():
            single_stream(llm, encode(llm, texts)[:1], 8)  # warm-up
            before[arm] = current_counts(llm)
        for repeat in range(args.repeats):
            for arm, llm in in_turn(llms, repeat):
                run = single_stream(llm, encode(llm, texts), args.max_tokens)
                rates.setdefault((arm, workload), []).append(run.tokens_per_s)
                if arm == "off":
                    reference[workload] = run.token_ids
                elif run.token_ids != reference.get(workload, run.token_ids):
                    print(f"MISMATCH: {arm} / {workload} differs from off (greedy)")
        for arm, llm in llms.items():
            notes[(arm, workload)] = counts_delta(llm, before[arm])
            before[arm] = current_counts(llm)
    for repeat in range(args.repeats):
        for arm, llm in in_turn(llms, repeat):
            rate = concurrent(
                llm, encode(llm, COPY_HEAVY + OPEN_CHAT), args.streams, args.max_tokens
            )
            rates.setdefault((arm, streams), []).append(rate)
    for arm, llm in llms.items():
        notes[(arm, streams)] = counts_delta(llm, before[arm])
    print("| workload | arm | tokens/s (median; runs) | / off | proposer |")
    print("|---|---|---|---|---|")
    for workload in (*WORKLOADS, streams):
        off = rates.get(("off", workload))
        for arm in args.arms:
            values = rates.get((arm, workload))
            if not values:
                continue
            median = statistics.median(values)
            ratio = f"{median / statistics.median(off):.2f}x" if off else "-"
            runs = ", ".join(f"{v:.1f}" for v in values)
            print(f"| {workload} | {arm} | {median:.1f} ({runs}) | {ratio} | "
                  f"{notes.get((arm, workload), '')} |")  # fmt: skip


def run_crossover(args: argparse.Namespace, gguf: str, target: str) -> None:
    """ngram / off at each batch size, with the crossover disabled."""
    dequantize = TARGETS[target]
    print(f"\n## crossover, target {target}: copy-heavy prompts, batch sizes {args.batches}")
    llms = {
        arm: build(gguf, dequantize, arm, args.num_threads, crossover=10_000, k=args.k)
        for arm in ("off", "ngram")
    }
    prompts = encode(llms["off"], COPY_HEAVY)
    print("| batch | off tokens/s | ngram tokens/s | ngram / off | proposer |")
    print("|---|---|---|---|---|")
    for batch_size in args.batches:
        rates: dict[str, list[float]] = {"off": [], "ngram": []}
        before = current_counts(llms["ngram"])
        for repeat in range(args.repeats):
            for arm, llm in in_turn(llms, repeat):
                rates[arm].append(concurrent(llm, prompts, batch_size, args.max_tokens))
        off, ngram = statistics.median(rates["off"]), statistics.median(rates["ngram"])
        note = counts_delta(llms["ngram"], before)
        print(f"| {batch_size} | {off:.1f} | {ngram:.1f} | {ngram / off:.2f}x | {note} |")


def run_llamacpp(args: argparse.Namespace, gguf: str, prompts_by_workload: dict[str, Any]) -> None:
    binary = find_llama_server()
    if binary is None:
        print(missing_binary_note())
        return
    print(f"\n## llama.cpp llama-server on {Path(gguf).name} (its weights as stored), 1 slot")
    settings: dict[str, tuple[str, ...]] = {"off": (), **LLAMACPP_NGRAM}
    print("| workload | llama.cpp speculation | tokens/s (median; runs) | / off | drafts kept |")
    print("|---|---|---|---|---|")
    results: dict[tuple[str, str], list[float]] = {}
    drafts: dict[tuple[str, str], str] = {}
    for name, extra in settings.items():
        context = 4096
        with LlamaServer(
            binary, gguf, 1, context, num_threads=args.num_threads or 2, extra_args=extra
        ) as server:
            for workload, prompts in prompts_by_workload.items():
                n_draft, n_kept = 0, 0
                for _ in range(args.repeats):
                    tokens, seconds = 0, 0.0
                    for prompt in prompts:
                        reply = server.post_completion(
                            {
                                "prompt": prompt,
                                "n_predict": args.max_tokens,
                                "temperature": 0,
                                "top_k": 1,
                                "cache_prompt": False,
                            }
                        )
                        timings = reply.get("timings", {})
                        tokens += max(int(timings.get("predicted_n", 0)) - 1, 0)
                        seconds += float(timings.get("predicted_ms", 0.0)) / 1000
                        n_draft += int(timings.get("draft_n", 0) or 0)
                        n_kept += int(timings.get("draft_n_accepted", 0) or 0)
                    results.setdefault((name, workload), []).append(tokens / seconds)
                drafts[(name, workload)] = f"{n_kept / n_draft:.0%}" if n_draft else "-"
    for workload in prompts_by_workload:
        off = statistics.median(results[("off", workload)])
        for name in settings:
            values = results[(name, workload)]
            median = statistics.median(values)
            runs = ", ".join(f"{v:.1f}" for v in values)
            print(f"| {workload} | {name} | {median:.1f} ({runs}) | {median / off:.2f}x | "
                  f"{drafts[(name, workload)]} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", help="the GGUF file (default: the shipped SmolLM2 Q4_1)")
    parser.add_argument(
        "--draft-model",
        help="the draft arm's drafter (default: the GGUF as stored; e.g. a `tollway convert "
        "--quantization int4` of its float32 copy, a low-bit drafter that is not the "
        "target's own bits)",
    )
    parser.add_argument("--targets", default="float32,as-stored")
    parser.add_argument("--arms", default="off,ngram,draft")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--k", type=int, default=0, help="num_speculative_tokens (0: default)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=0)
    parser.add_argument("--crossover", action="store_true", help="find the crossover instead")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16])
    parser.add_argument("--skip-llamacpp", action="store_true")
    args = parser.parse_args()
    args.arms = [a for a in args.arms.split(",") if a]
    unknown = set(args.arms) - set(ARMS) or set(args.targets.split(",")) - set(TARGETS)
    if unknown:
        parser.error(f"unknown arms or targets: {sorted(unknown)}")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    args.num_threads = torch.get_num_threads()
    gguf = args.gguf or str(shipped_gguf() or "")
    if not gguf:
        raise SystemExit("the SmolLM2 GGUF is not installed; pass --gguf FILE")
    print(f"# {command_line()}\n# {args.num_threads} threads, {Path(gguf).name}")
    for target in args.targets.split(","):
        if args.crossover:
            run_crossover(args, gguf, target)
        else:
            run_target(args, gguf, target)
    if not args.crossover and not args.skip_llamacpp:
        llm = build(gguf, False, "off", args.num_threads, None)
        prompts = {workload: encode(llm, texts) for workload, texts in WORKLOADS.items()}
        del llm
        run_llamacpp(args, gguf, prompts)


if __name__ == "__main__":
    main()
