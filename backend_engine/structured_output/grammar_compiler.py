"""Constraints compiled for one tokenizer: once per canonical key, off the event loop, bounded.

``compile`` turns an `OutputConstraint` into a `CompiledGrammar` (llguidance's grammar with
the lexer for its first token already built, so a regex whose automaton explodes fails here,
as a 400, rather than in a step). Results, failures included, are kept in a bounded LRU cache
keyed by the constraint's canonical hash. ``compile_async`` runs ``compile`` on the compiler's
own threads under a time bound: a slow grammar costs its own request a 400, never the event
loop, and never the engine's step (which only copies the compiled start state).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from backend_engine.structured_output.constraint import InvalidConstraint, OutputConstraint
from backend_engine.structured_output.json_format import JSON_OPTIONS, closed_objects
from backend_engine.structured_output.matcher import GrammarMatcher
from backend_engine.structured_output.regex_size import check_regex_size, check_schema_patterns
from model_files.tokenizer import Tokenizer

# llguidance's stop reasons for a grammar that cannot produce its first byte.
_NOTHING_MATCHES = ("NoExtension", "NoExtensionBias")


@dataclass(frozen=True)
class GrammarCompilerSettings:
    """From the engine's settings (``EngineConfig.grammar_*``, where the defaults live)."""

    cache_size: int  # compiled grammars kept
    compile_timeout_s: float  # past this a request's constraint is refused (400)


COMPILE_THREADS = 2  # compiles that run at once; more wait their turn


class CompiledGrammar:
    """A grammar ready to match: ``new_matcher`` copies its start state (microseconds)."""

    def __init__(self, start: llguidance.LLMatcher, mask_bytes: int) -> None:
        self._start = start
        self._mask_bytes = mask_bytes

    def new_matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._start.deep_copy(), self._mask_bytes)


class GrammarCompiler:
    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        settings: GrammarCompilerSettings,
    ) -> None:
        """``vocab_size``: the model's logits width (at least the tokenizer's vocabulary)."""
        self.settings = settings
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.mask_bytes = (vocab_size + 31) // 32 * 4
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, CompiledGrammar | InvalidConstraint] = OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self._threads = concurrent.futures.ThreadPoolExecutor(
            COMPILE_THREADS, thread_name_prefix="grammar-compile"
        )
        self.num_compiled = 0  # cache misses: grammars compiled since start

    def compile(self, constraint: OutputConstraint) -> CompiledGrammar:
        """The constraint's grammar, from the cache or compiled now (blocking: call it off
        the event loop, or after ``compile_async``). Raises `InvalidConstraint`."""
        key = constraint.key
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
        if cached is None:
            cached = self._build(constraint)
            with self._lock:
                self._cache[key] = cached
                self.num_compiled += 1
                while len(self._cache) > self.settings.cache_size:
                    self._cache.popitem(last=False)
        if isinstance(cached, InvalidConstraint):
            raise InvalidConstraint(cached.message, constraint.param)
        return cached

    async def compile_async(self, constraint: OutputConstraint) -> CompiledGrammar:
        """``compile`` on the compiler's threads, refused after ``compile_timeout_s`` (the
        compile goes on and its result is cached, but this request does not wait for it)."""
        with self._lock:
            cached = self._cache.get(constraint.key)
        if isinstance(cached, CompiledGrammar):
            return cached
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._threads, self.compile, constraint)
        timeout = self.settings.compile_timeout_s
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            raise InvalidConstraint(
                f"the {constraint.kind} in '{constraint.param}' took longer than {timeout:g} s "
                "to compile; simplify it",
                constraint.param,
            ) from None

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _build(self, constraint: OutputConstraint) -> CompiledGrammar | InvalidConstraint:
        try:
            grammar = _grammar_text(constraint)
        except ValueError as exc:
            return InvalidConstraint(f"Invalid '{constraint.param}': {exc}", constraint.param)
        start = llguidance.LLMatcher(self._llguidance_tokenizer(), grammar, log_level=0)
        # Build the lexer for the first token now, so a grammar that breaks a limit fails here.
        first_mask = b"" if start.is_error() else start.compute_bitmask()
        error = _first_line(start.get_error()) if start.is_error() else None
        if error in _NOTHING_MATCHES or (error is None and not any(first_mask)):
            error = (
                f"the {constraint.kind} admits no output at all "
                "(for example, a $ref that refers only to itself)"
            )
        if error is not None:
            return InvalidConstraint(
                f"Invalid '{constraint.param}': {_described(error)}", constraint.param
            )
        return CompiledGrammar(start, self.mask_bytes)

    def _llguidance_tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:  # built once, on first use (~0.25 s for 49k tokens)
            if self._lltokenizer is None:
                self._lltokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(),
                    n_vocab=self.vocab_size,
                    eos_token=sorted(self._tokenizer.eos_token_ids) or None,
                )
            return self._lltokenizer


def _grammar_text(constraint: OutputConstraint) -> str:
    """llguidance's grammar for a constraint. Raises ValueError for a malformed one."""
    kind = constraint.kind
    if kind == "json_schema":
        if constraint.source == "false":
            raise ValueError("the schema false admits no output at all")
        check_schema_patterns(json.loads(constraint.source))
        schema = closed_objects(json.loads(constraint.source))
        return str(llguidance.LLMatcher.grammar_from_json_schema(schema, JSON_OPTIONS))
    if kind == "json_object":
        return str(llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS))
    if kind == "regex":
        check_regex_size(constraint.source)
        return str(llguidance.LLMatcher.grammar_from_regex(constraint.source))
    if kind == "choice":
        choices = json.loads(constraint.source)
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        return str(llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n"))
    try:  # Lark, or GBNF as llama.cpp takes it
        lark = any_to_lark(constraint.source)
    except GbnfToLarkError as exc:
        raise ValueError(f"the GBNF grammar does not parse: {exc}") from None
    return str(llguidance.LLMatcher.grammar_from_lark(lark))


def _described(error: str) -> str:
    """llguidance's words, where they are terse, in a client's."""
    if error.startswith("Unimplemented keys:"):
        keys = error.removeprefix("Unimplemented keys:").strip()
        return f"unsupported JSON Schema keyword(s) {keys}"
    return error


def _first_line(error: str) -> str:
    """llguidance's message without its trailing parser-state dump."""
    return error.strip().splitlines()[0] if error.strip() else "the grammar is invalid"
