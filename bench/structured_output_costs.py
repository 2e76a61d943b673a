"""What a structured output costs outside the forward pass, measured on the engine's own code:
compiling a constraint (``GrammarCompiler.compile``) and masking and advancing per token
(``logits_mask.mask_logits`` and ``accept_tokens``), over real generated answers.

``bench.structured_output`` runs these beside its throughput arms and prints them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import ParamSpec, TypeVar

import torch

from backend_engine.config import EngineConfig
from backend_engine.structured_output.constraint import OutputConstraint
from backend_engine.structured_output.grammar_compiler import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarCompilerSettings,
)
from backend_engine.worker import model_runner
from backend_engine.worker.logits_mask import accept_tokens, mask_logits
from model_files.tokenizer import Tokenizer

_DEFAULTS = EngineConfig(model="unused")  # the engine's own grammar settings
_ENGINE_SETTINGS = GrammarCompilerSettings(
    cache_size=_DEFAULTS.grammar_cache_size,
    compile_timeout_s=_DEFAULTS.grammar_compile_timeout_s,
)

# A constraint unlike any schema's, compiled first on a fresh compiler: its time is mostly
# building llguidance's tokenizer (once per compiler), so the schema's compile after it is cold
# for the grammar alone.
_TOKENIZER_PRIMER = OutputConstraint.regex("[0-9]", "bench")

P = ParamSpec("P")
R = TypeVar("R")


class RunnerGrammarTime:
    """Seconds the model runner spends in ``mask_logits`` and ``accept_tokens`` inside real
    engine steps while this context is open: the names ``model_runner`` calls are wrapped
    with a timer and put back on exit. ``seconds`` holds the last span's total."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> RunnerGrammarTime:
        self.seconds = 0.0
        self._saved = (model_runner.mask_logits, model_runner.accept_tokens)
        model_runner.mask_logits = self._timed(model_runner.mask_logits)
        model_runner.accept_tokens = self._timed(model_runner.accept_tokens)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        model_runner.mask_logits, model_runner.accept_tokens = self._saved

    def _timed(self, fn: Callable[P, R]) -> Callable[P, R]:
        def timed(*args: P.args, **kwargs: P.kwargs) -> R:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


@dataclass(frozen=True)
class CompileTimes:
    """Seconds, one entry per (schema, repeat)."""

    first_compile: list[float]  # a fresh compiler's first (tiny) grammar: tokenizer build
    cold: list[float]  # the schema on that compiler: a cache miss
    cache_hit: list[float]  # the same schema again
    new_matcher: list[float]  # a request's matcher from the compiled grammar
    cold_by_schema: dict[str, list[float]]


def compile_times(
    tokenizer: Tokenizer,
    vocab_size: int,
    constraints: dict[str, OutputConstraint],
    repeats: int,
) -> CompileTimes:
    """Each schema compiled ``repeats`` times, each time on a fresh `GrammarCompiler` (so
    nothing is cached, llguidance's tokenizer included)."""
    times = CompileTimes([], [], [], [], {name: [] for name in constraints})
    for _ in range(repeats):
        for name, constraint in constraints.items():
            compiler = GrammarCompiler(tokenizer, vocab_size, _ENGINE_SETTINGS)
            try:
                times.first_compile.append(_timed(lambda c=compiler: c.compile(_TOKENIZER_PRIMER)))
                cold = _timed(lambda c=compiler, k=constraint: c.compile(k))
                times.cold.append(cold)
                times.cold_by_schema[name].append(cold)
                times.cache_hit.append(_timed(lambda c=compiler, k=constraint: c.compile(k)))
                compiled = compiler.compile(constraint)
                times.new_matcher.append(_timed(compiled.new_matcher))
            finally:
                compiler.close()
    return times


@dataclass(frozen=True)
class MaskCost:
    """Seconds spent outside the forward pass for constrained rows."""

    per_token_mask: list[float]  # mask_logits on one row, per token of every answer
    per_token_accept: list[float]  # accept_tokens on one row
    batched_total: float  # every answer at once, step by step (rows leave as answers end)
    num_batched_steps: int
    max_batch_rows: int


def mask_cost(
    grammars: Sequence[CompiledGrammar], answers: Sequence[Sequence[int]], vocab_size: int
) -> MaskCost:
    """Replays each answer's tokens through a fresh matcher of its grammar, timing the two
    calls the model runner makes per constrained token: first one row at a time, then all
    answers as the rows of one batch per step (as ``ModelRunner._sample`` calls them)."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn((len(answers), vocab_size), generator=generator)  # [rows, vocab]
    per_mask: list[float] = []
    per_accept: list[float] = []
    for grammar, tokens in zip(grammars, answers, strict=True):
        matcher = grammar.new_matcher()
        for token_id in tokens:
            row = logits[:1].clone()
            start = time.perf_counter()
            failed = mask_logits(row, {0: matcher})
            middle = time.perf_counter()
            failed |= accept_tokens({0: matcher}, {0: token_id})
            end = time.perf_counter()
            if failed:
                raise RuntimeError(f"replaying a generated answer failed: {failed}")
            per_mask.append(middle - start)
            per_accept.append(end - middle)
    matchers = [grammar.new_matcher() for grammar in grammars]
    total = 0.0
    num_steps = max(len(tokens) for tokens in answers)
    for step in range(num_steps):
        live = [i for i, tokens in enumerate(answers) if step < len(tokens)]
        rows = logits[: len(live)].clone()
        start = time.perf_counter()
        failed = mask_logits(rows, {r: matchers[i] for r, i in enumerate(live)})
        failed |= accept_tokens(
            {r: matchers[i] for r, i in enumerate(live)},
            {r: answers[i][step] for r, i in enumerate(live)},
        )
        total += time.perf_counter() - start
        if failed:
            raise RuntimeError(f"replaying generated answers failed: {failed}")
    return MaskCost(per_mask, per_accept, total, num_steps, len(answers))


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), nearest rank."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


def p50_p99(values: Sequence[float], scale: float, unit: str) -> str:
    return (
        f"p50 {statistics.median(values) * scale:.3g} {unit}, "
        f"p99 {percentile(values, 99) * scale:.3g} {unit}"
    )


def _timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start
