"""Compiling constraints: every form, the cache, and each bad input as a named error."""

from __future__ import annotations

import asyncio
import time

import pytest

from backend_engine.structured_output.constraint import InvalidConstraint, OutputConstraint
from backend_engine.structured_output.grammar_compiler import GrammarCompiler
from model_files.tokenizer import Tokenizer
from tests.backend_engine.structured_output.conftest import engine_settings

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _accepts(compiler: GrammarCompiler, constraint: OutputConstraint, text: str) -> bool:
    matcher = compiler.compile(constraint).new_matcher()
    tokenizer = compiler._tokenizer
    try:
        for token_id in tokenizer.encode(text, add_special_tokens=False):
            matcher.accept(token_id)
        matcher.accept(min(tokenizer.eos_token_ids))
    except RuntimeError:
        return False
    return matcher.is_finished


@pytest.mark.parametrize(
    ("constraint", "good", "bad"),
    [
        (OutputConstraint.json_schema(PERSON, "s"), '{"name": "Ada", "age": 36}', '{"age": 36}'),
        (OutputConstraint.json_object("s"), '{"any": [1, 2]}', "[1, 2]"),
        (OutputConstraint.regex(r"[0-9]{3}-[a-z]+", "s"), "123-abc", "12-abc"),
        (OutputConstraint.choice(["yes", 'no "way"'], "s"), 'no "way"', "maybe"),
        (OutputConstraint.grammar('start: "a"+ "b"', "s"), "aaab", "ba"),
        (OutputConstraint.grammar('root ::= "x" [0-9]+', "s"), "x42", "y42"),  # GBNF
    ],
)
def test_each_form_accepts_what_it_describes_and_nothing_else(
    compiler: GrammarCompiler, constraint: OutputConstraint, good: str, bad: str
) -> None:
    assert _accepts(compiler, constraint, good)
    assert not _accepts(compiler, constraint, bad)


def test_a_schema_is_compiled_once_and_the_cache_is_bounded(smollm2_tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler(
        smollm2_tokenizer, smollm2_tokenizer.vocab_size, engine_settings(cache_size=2)
    )
    first = compiler.compile(OutputConstraint.json_schema(PERSON, "a"))
    again = compiler.compile(OutputConstraint.json_schema(dict(PERSON), "b"))  # equal, elsewhere
    assert again is first
    assert compiler.num_compiled == 1
    compiler.compile(OutputConstraint.regex("a+", "r"))
    compiler.compile(OutputConstraint.regex("b+", "r"))  # evicts the schema (least recent)
    assert compiler.compile(OutputConstraint.json_schema(PERSON, "a")) is not first
    assert compiler.num_compiled == 4


@pytest.mark.parametrize(
    ("constraint", "words"),
    [
        (OutputConstraint.json_schema({"type": "strin"}, "response_format"), "Invalid type"),
        (
            OutputConstraint.json_schema({"type": "array", "uniqueItems": True}, "f"),
            'unsupported JSON Schema keyword(s) ["uniqueItems"]',
        ),
        (
            OutputConstraint.json_schema(
                {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, "f"
            ),
            "admits no output",
        ),
        (OutputConstraint.json_schema({"type": "string", "format": "nope"}, "f"), "format"),
        (OutputConstraint.regex("((", "f"), "regex parse error"),
        (OutputConstraint.regex("((a{100}){100}){100}", "f"), "1,000,000 copies"),
        (
            OutputConstraint.json_schema({"type": "string", "pattern": "(x{1000}){1000}"}, "f"),
            "1,000,000 copies",
        ),
        (OutputConstraint.grammar("start: foo", "f"), 'unknown name: "foo"'),
        (OutputConstraint.grammar("root ::= (", "f"), "GBNF"),
    ],
)
def test_a_bad_constraint_is_refused_naming_the_problem_and_the_field(
    compiler: GrammarCompiler, constraint: OutputConstraint, words: str
) -> None:
    with pytest.raises(InvalidConstraint) as caught:
        compiler.compile(constraint)
    assert words in caught.value.message
    assert caught.value.param == constraint.param
    assert f"'{constraint.param}'" in caught.value.message
    with pytest.raises(InvalidConstraint):  # the failure is cached, and raised again
        compiler.compile(constraint)
    assert compiler.num_compiled == 1


def test_a_large_recursive_schema_and_enum_compile(compiler: GrammarCompiler) -> None:
    tree = {
        "type": "object",
        "properties": {
            "value": {"type": "integer"},
            "children": {"type": "array", "items": {"$ref": "#"}},
        },
        "required": ["value"],
    }
    assert _accepts(
        compiler,
        OutputConstraint.json_schema(tree, "s"),
        '{"value": 1, "children": [{"value": 2}]}',
    )
    numbers = OutputConstraint.json_schema({"enum": list(range(1000))}, "s")
    assert _accepts(compiler, numbers, "999")


def test_compile_async_refuses_a_grammar_past_its_time_bound_and_the_loop_goes_on(
    smollm2_tokenizer: Tokenizer,
) -> None:
    compiler = GrammarCompiler(
        smollm2_tokenizer,
        smollm2_tokenizer.vocab_size,
        engine_settings(compile_timeout_s=0.05),
    )
    compiler.compile(OutputConstraint.regex("a", "warm"))  # the tokenizer is built once, first
    slow = OutputConstraint.regex("(x{1000}){100}", "structured_outputs.regex")  # ~0.7 s

    async def main() -> tuple[InvalidConstraint, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        ticker = asyncio.create_task(tick())
        with pytest.raises(InvalidConstraint) as caught:
            await compiler.compile_async(slow)
        ticker.cancel()
        return caught.value, ticks

    started = time.monotonic()
    error, ticks = asyncio.run(main())
    assert time.monotonic() - started < 0.5  # it did not wait for the compile
    assert error.param == "structured_outputs.regex"
    assert "took longer than 0.05 s" in error.message
    assert ticks > 0  # the event loop kept running meanwhile
    compiler.close()


def test_boolean_schemas(compiler: GrammarCompiler) -> None:
    assert _accepts(compiler, OutputConstraint.json_schema(True, "s"), "[1, 2]")
    with pytest.raises(InvalidConstraint, match="admits no output"):
        compiler.compile(OutputConstraint.json_schema(False, "s"))


def test_an_object_that_lists_properties_generates_only_those(compiler: GrammarCompiler) -> None:
    open_schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    constraint = OutputConstraint.json_schema(open_schema, "s")
    assert _accepts(compiler, constraint, '{"a": 1}')
    assert not _accepts(compiler, constraint, '{"a": 1, "b": 2}')
    free = OutputConstraint.json_schema({"type": "object"}, "s")  # lists none: any keys
    assert _accepts(compiler, free, '{"b": 2}')
    declared = {"type": "object", "properties": {}, "additionalProperties": {"type": "integer"}}
    assert _accepts(compiler, OutputConstraint.json_schema(declared, "s"), '{"b": 2}')
