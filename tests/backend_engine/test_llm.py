"""The offline API end to end on a tiny demo checkpoint."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from backend_engine import LLM, SamplingParams
from backend_engine.config import EngineConfig
from backend_engine.llm import EngineOptions


@pytest.fixture(scope="module")
def llm(demo_checkpoint):
    return LLM(model=str(demo_checkpoint(size="tiny")), dtype="float32")


def test_outputs_come_back_in_prompt_order_with_text(llm):
    prompts = ["Hello there", "The quick brown fox", "1 + 1 ="]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(outputs) == 3
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.prompt_token_ids == llm.tokenizer.encode(prompt)
        assert len(out.token_ids) == 8
        assert out.text == llm.tokenizer.decode(out.token_ids)
        assert out.finish_reason == "length"


def test_token_id_prompts_and_per_prompt_params(llm):
    ids = llm.tokenizer.encode("Hello there")
    outputs = llm.generate(
        [ids, ids],
        [
            SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        ],
    )
    assert [len(o.token_ids) for o in outputs] == [3, 5]
    assert outputs[1].token_ids[:3] == outputs[0].token_ids


def test_same_seed_same_output_and_different_seed_differs(llm):
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=1234, ignore_eos=True)
    a = llm.generate(["Once upon a time"], params)[0]
    b = llm.generate(["Once upon a time", "Other prompt in the batch"], params)[0]
    assert a.token_ids == b.token_ids
    others = {
        tuple(
            llm.generate(
                ["Once upon a time"],
                SamplingParams(temperature=1.0, max_tokens=16, seed=s, ignore_eos=True),
            )[0].token_ids
        )
        for s in range(4)
    }
    assert len(others) > 1


def test_stop_string_is_left_out_of_the_text(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = llm.generate(["Tell me a story"], greedy)[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    assert stop.strip(), "pick a visible stop string"
    out = llm.generate(
        ["Tell me a story"],
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    assert stop not in out.text


def test_stop_token_ids_and_eos(llm):
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    full = llm.generate(["Stop here"], greedy)[0]
    target = full.token_ids[4]
    out = llm.generate(
        ["Stop here"],
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, stop_token_ids=[target]),
    )[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: full.token_ids.index(target) + 1]


def test_logprobs_have_the_requested_alternatives(llm):
    out = llm.generate(
        ["Hi"], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    )[0]
    assert out.logprobs is not None
    assert len(out.logprobs) == 4
    for token_id, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token_id
        assert len(lp.top) == 3
        assert lp.top[0][0] == token_id  # greedy picks the most likely
        assert lp.logprob <= 0


def test_too_long_request_is_a_clear_error(llm):
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate(["hi"], SamplingParams(max_tokens=10**6))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams())
    # A bad prompt in a batch queues nothing: the engine is left clean.
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", []], SamplingParams())
    assert not llm.engine.has_unfinished()


def test_prefix_cache_reports_cached_tokens(llm):
    prefix = "A shared system prompt that is long enough to fill a few blocks. " * 4
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first = llm.generate([prefix + "Question one?"], greedy)[0]
    second = llm.generate([prefix + "Question two?"], greedy)[0]
    assert second.num_cached_tokens >= 16
    assert second.num_cached_tokens <= len(second.prompt_token_ids) - 1
    assert first.num_cached_tokens < second.num_cached_tokens
    assert llm.engine.kv_cache.num_used_blocks == 0


def test_static_scheduling_gives_the_same_greedy_tokens(demo_checkpoint):
    path = str(demo_checkpoint(size="tiny"))
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = ["a b c", "d e f g h", "i"]
    continuous = LLM(model=path, dtype="float32").generate(prompts, greedy)
    static = LLM(model=path, dtype="float32", scheduling="static", max_num_seqs=2).generate(
        prompts, greedy
    )
    assert [o.token_ids for o in continuous] == [o.token_ids for o in static]


def test_unknown_or_unavailable_device_is_a_clear_error(demo_checkpoint):
    import torch

    with pytest.raises(ValueError, match="device must be"):
        LLM(model=str(demo_checkpoint(size="tiny")), device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            LLM(model=str(demo_checkpoint(size="tiny")), device="cuda")


def test_a_request_that_fails_in_the_engine_comes_back_as_an_error_the_others_complete(llm):
    good = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    bad = SamplingParams(temperature=1.0, max_tokens=6)
    object.__setattr__(bad, "seed", 2**64)  # past any validation
    alone = llm.generate(["Hello there"], good)[0]
    outputs = llm.generate(["Hello there", "Poison", "Hello there"], [good, bad, good])
    assert [o.finish_reason for o in outputs] == ["length", "error", "length"]
    assert outputs[1].error
    assert "Overflow" in outputs[1].error
    assert outputs[1].token_ids == []
    assert outputs[0].token_ids == outputs[2].token_ids == alone.token_ids
    assert outputs[0].error is None


def test_llm_options_are_the_engine_configs_fields() -> None:
    """LLM's keyword arguments are EngineConfig's fields (names and types; the defaults are
    EngineConfig's own, written once)."""
    fields = {f.name: f.type for f in dataclasses.fields(EngineConfig) if f.name != "model"}
    hints = typing.get_type_hints(EngineOptions)
    assert set(hints) == set(fields)
    config_hints = typing.get_type_hints(EngineConfig)
    assert all(hints[name] == config_hints[name] for name in fields)
