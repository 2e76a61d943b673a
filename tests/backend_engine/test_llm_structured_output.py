"""Structured outputs through the offline engine on SmolLM2: valid by construction, and
everything else the engine does (batching, preemption, chunked prefill, prefix caching,
seeds, logprobs, failure isolation) works with it.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from backend_engine.llm import LLM
from backend_engine.sampling_params import SamplingParams
from backend_engine.structured_output.constraint import OutputConstraint

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "hobbies": {
            "type": "array",
            "items": {"type": "string", "maxLength": 24},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
PERSON_JSON = OutputConstraint.json_schema(PERSON, "response_format")
QUESTION = [{"role": "user", "content": "Describe a fictional person as JSON."}]


@pytest.fixture(scope="module")
def llm(smollm2_gguf: Path) -> LLM:
    return LLM(str(smollm2_gguf))


def _prompt(llm: LLM, text: str = "Describe a fictional person as JSON.") -> list[int]:
    return llm.tokenizer.encode_chat([{"role": "user", "content": text}])


def test_greedy_and_seeded_outputs_validate_and_neighbours_are_untouched(llm: LLM) -> None:
    prompt = _prompt(llm)
    plain = SamplingParams(max_tokens=24, temperature=0)
    alone = llm.generate([prompt, prompt], [plain, SamplingParams(max_tokens=24, seed=7)])
    constrained = [
        SamplingParams(max_tokens=150, temperature=0, structured_output=PERSON_JSON),
        *(
            SamplingParams(max_tokens=150, seed=seed, structured_output=PERSON_JSON)
            for seed in range(3)
        ),
    ]
    batch = llm.generate([prompt] * 6, [plain, *constrained, SamplingParams(max_tokens=24, seed=7)])
    assert batch[0].token_ids == alone[0].token_ids  # unconstrained, greedy
    assert batch[-1].token_ids == alone[1].token_ids  # unconstrained, seeded
    for out in batch[1:-1]:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), PERSON)
    # The same seed gives the same constrained output, batched or alone.
    again = llm.generate([prompt], constrained[2])
    assert again[0].token_ids == batch[3].token_ids


def test_logprobs_are_of_the_masked_choice(llm: LLM) -> None:
    yes_no = OutputConstraint.choice(["yes", "no"], "structured_outputs.choice")
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=5, structured_output=yes_no)
    out = llm.generate([_prompt(llm, "Is the sky blue?")], params)[0]
    assert out.text in ("yes", "no")
    first = out.logprobs[0]  # type: ignore[index]
    allowed = {llm.tokenizer.decode([t]) for t, _ in first.top}
    assert allowed <= {"yes", "no", "y", "n", "ye"}  # only tokens the grammar allows
    assert all(lp > float("-inf") for _, lp in first.top)


def test_a_truncated_answer_ends_with_length(llm: LLM) -> None:
    out = llm.generate([_prompt(llm)], SamplingParams(max_tokens=5, structured_output=PERSON_JSON))
    assert out[0].finish_reason == "length"
    assert out[0].text.startswith("{")


def test_the_grammar_ends_the_output_even_with_ignore_eos(llm: LLM) -> None:
    params = SamplingParams(
        max_tokens=30,
        temperature=0,
        ignore_eos=True,
        structured_output=OutputConstraint.regex("[0-9]{3}", "structured_outputs.regex"),
    )
    out = llm.generate([_prompt(llm, "Pick a number.")], params)[0]
    assert out.finish_reason == "stop"
    assert len(out.text) == 3
    assert out.text.isdigit()


def test_preemption_chunked_prefill_and_prefix_caching_keep_outputs_valid(
    smollm2_gguf: Path,
) -> None:
    # 18 KV blocks of 8 tokens for four requests of 37 + ~35 tokens (9 blocks each, the
    # prompt's 4 shared): they preempt each other; 16-token steps chunk each prompt; the
    # shared prompt is found in the cache.
    small = LLM(
        str(smollm2_gguf),
        num_kv_blocks=18,
        block_size=8,
        watermark=0.0,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    )
    prompt = _prompt(small)
    params = [
        SamplingParams(max_tokens=100, seed=seed, structured_output=PERSON_JSON)
        for seed in range(4)
    ]
    outs = small.generate([prompt] * 4, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.kv_cache.prefix_cache_hits > 0
    for out in outs:
        jsonschema.validate(json.loads(out.text), PERSON)
    roomy = LLM(str(smollm2_gguf)).generate([prompt] * 4, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]


def test_a_failing_matcher_fails_only_its_own_request(llm: LLM) -> None:
    engine = llm.engine
    prompt = _prompt(llm)
    json_params = SamplingParams(max_tokens=40, temperature=0, structured_output=PERSON_JSON)
    engine.add_request("broken", prompt, json_params)
    engine.add_request("fine", prompt, json_params)
    engine.add_request("free", prompt, SamplingParams(max_tokens=8, temperature=0))
    matcher = engine.scheduler.requests["broken"].matcher
    assert matcher is not None
    with pytest.raises(RuntimeError):
        matcher.accept(llm.tokenizer.encode("no", add_special_tokens=False)[0])  # not JSON
    finished = {}
    texts: dict[str, str] = {"free": ""}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.request_id == "free":
                texts["free"] += delta.new_text
            if delta.finished:
                finished[delta.request_id] = delta
    assert finished["broken"].finish_reason == "error"
    assert "grammar" in (finished["broken"].error or "")
    assert finished["fine"].finish_reason in ("stop", "length")
    assert finished["free"].finish_reason == "length"
    alone = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0]
    assert texts["free"] == alone.text


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_chat_calls_a_tool_and_answers_its_result(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=60, temperature=0)
    asked = llm.chat(
        WEATHER_QUESTION,
        greedy,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
    )[0]
    assert asked.finish_reason == "tool_calls"
    assert asked.content is None
    assert len(asked.tool_calls) == 1
    for call in asked.tool_calls:
        assert call.name == "get_weather"
        assert call.id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), WEATHER_TOOL["function"]["parameters"])
    call = asked.tool_calls[0]
    history = [
        *WEATHER_QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'},
    ]
    answered = llm.chat(history, greedy, tools=[WEATHER_TOOL], tool_choice="none")[0]
    assert answered.tool_calls == ()
    assert answered.content
    assert len(answered.output.prompt_token_ids) > len(asked.output.prompt_token_ids)


def test_chat_takes_a_structured_output_or_tools_but_not_both(llm: LLM) -> None:
    person = SamplingParams(max_tokens=150, temperature=0, structured_output=PERSON_JSON)
    out = llm.chat([QUESTION, QUESTION], person)
    assert len(out) == 2
    jsonschema.validate(json.loads(out[0].content or ""), PERSON)
    with pytest.raises(ValueError, match="either tools"):
        llm.chat(QUESTION, person, tools=[WEATHER_TOOL], tool_choice="required")


def test_a_stop_string_stops_a_constrained_answer(llm: LLM) -> None:
    params = SamplingParams(
        max_tokens=150, temperature=0, stop=['"age"'], structured_output=PERSON_JSON
    )
    out = llm.generate([_prompt(llm)], params)[0]
    assert out.finish_reason == "stop"
    assert out.text.startswith('{"name": ')
    assert '"age"' not in out.text
