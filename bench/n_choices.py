"""``n`` choices against separate requests: one request with ``n=8`` on a ~1,000-token prompt
against 8 requests with that prompt, side by side in one run.

    python -m bench.n_choices                              # SmolLM2-135M GGUF, n=8, 3 repeats
    python -m bench.n_choices --model demo --size tiny --repeats 1 --prompt-len 200  # smoke
    python -m bench.n_choices --prefix-caching on          # one configuration only

Both arms produce the same tokens: choice ``i`` of the ``n`` arm is seeded ``choice_seed(seed,
i)``, and the separate requests get exactly those seeds, ``max_tokens`` each with eos
ignored. What differs is the prompt's prefill: the ``n`` arm computes it once and forks the
choices off its KV blocks; each separate request computes its own, except what the prefix
cache supplies when it is on (requests admitted in the same step find the blocks the first
one registered). So the bench runs with prefix caching off (separate requests cannot share)
and on (they share through the cache), unless ``--prefix-caching`` picks one.

Reported per arm, medians over the repeats: the prompt tokens the engine computed
(``EngineStats.num_computed_prompt_tokens``) and the time from submitting to the last token
of the last choice (one ``LLM.generate`` call). Each repeat draws a fresh prompt, the prefix
cache is emptied before each arm runs, and the arms alternate which runs first. Target: the prompt
prefilled once, and the ``n`` arm >= 2x faster.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.workloads import add_common_args, checkpoint, command_line

if TYPE_CHECKING:
    from backend_engine import LLM, SamplingParams

ARMS = ("n choices", "separate requests")


@dataclass(frozen=True)
class ArmRun:
    seconds: float  # to the last token of the last choice
    computed_prompt_tokens: int
    token_ids: tuple[tuple[int, ...], ...]  # each choice's, in choice order


def run_arm(llm: LLM, arm: str, prompt: list[int], params: SamplingParams) -> ArmRun:
    from backend_engine.sampling_params import choice_seed

    seed = params.seed if params.seed is not None else 0
    if arm == ARMS[0]:
        prompts = [prompt]
        arm_params: list[SamplingParams] = [params]
    else:
        prompts = [prompt] * params.n
        arm_params = [replace(params, n=1, seed=choice_seed(seed, i)) for i in range(params.n)]
    llm.engine.kv_cache.pool.reset_prefix_cache()  # the other arm's run left the prompt there
    before = llm.engine.stats().num_computed_prompt_tokens
    start = time.perf_counter()
    outputs = llm.generate(prompts, arm_params)
    seconds = time.perf_counter() - start
    computed = llm.engine.stats().num_computed_prompt_tokens - before
    assert all(len(o.token_ids) == params.max_tokens for o in outputs), "a choice stopped early"
    return ArmRun(seconds, computed, tuple(tuple(o.token_ids) for o in outputs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--prefix-caching", choices=("off", "on", "both"), default="both")
    add_common_args(parser, default_model="smollm2")
    args = parser.parse_args()

    import torch

    from backend_engine import LLM, SamplingParams

    model = checkpoint(args.model, args.size)
    settings = {"off": [False], "on": [True], "both": [False, True]}[args.prefix_caching]
    engines = {
        caching: LLM(
            model=model,
            dtype="float32",
            enable_prefix_caching=caching,
            max_num_seqs=max(args.n, 8),
            num_threads=args.num_threads or None,
        )
        for caching in settings
    }
    vocab = next(iter(engines.values())).engine.model_config.vocab_size
    rng = random.Random(0)

    def fresh_prompt() -> list[int]:
        return [rng.randrange(10, vocab - 16) for _ in range(args.prompt_len)]

    params = SamplingParams(
        n=args.n, temperature=1.0, seed=args.seed, max_tokens=args.max_tokens, ignore_eos=True
    )
    # Each arm once, untimed, at the timed shapes (oneDNN builds its kernels per batch size).
    warm_up = replace(params, max_tokens=2)
    for llm in engines.values():
        for arm in ARMS:
            run_arm(llm, arm, fresh_prompt(), warm_up)

    runs: dict[tuple[bool, str], list[ArmRun]] = {(c, a): [] for c in settings for a in ARMS}
    for repeat in range(args.repeats):
        for caching, llm in engines.items():
            prompt = fresh_prompt()
            for arm in ARMS if repeat % 2 == 0 else ARMS[::-1]:
                runs[caching, arm].append(run_arm(llm, arm, prompt, params))

    print(f"command: {command_line()}")
    print(
        f"model: {model}; prompt: {args.prompt_len} tokens, n={args.n}, max_tokens="
        f"{args.max_tokens} (eos ignored), seed {args.seed}; repeats: {args.repeats}, "
        f"torch threads: {torch.get_num_threads()}"
    )
    for caching in settings:
        print(f"prefix caching {'on' if caching else 'off'}:")
        medians = {}
        for arm in ARMS:
            arm_runs = runs[caching, arm]
            medians[arm] = statistics.median(r.seconds for r in arm_runs)
            computed = statistics.median(r.computed_prompt_tokens for r in arm_runs)
            print(
                f"  {arm:<18} last token {medians[arm]:7.2f} s  prompt tokens computed "
                f"{computed:7.0f}  (runs: "
                + ", ".join(f"{r.seconds:.2f}" for r in arm_runs)
                + " s)"
            )
        same = all(
            a.token_ids == b.token_ids
            for a, b in zip(runs[caching, ARMS[0]], runs[caching, ARMS[1]], strict=True)
        )
        ratio = medians[ARMS[1]] / medians[ARMS[0]]
        print(
            f"  ratio (separate / n): {ratio:.2f}x (target >= 2x); "
            f"same tokens in both arms: {'yes' if same else 'no'}"
        )


if __name__ == "__main__":
    main()
