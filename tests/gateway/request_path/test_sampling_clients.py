"""Real clients, unmodified, with issue #26's fields through the gateway: the openai SDK with
``n``, penalties and ``logit_bias``, prompt lists and ``echo``, ``models.retrieve``; LiteLLM as
a client with ``presence_penalty`` and ``drop_params=True`` (which keeps the penalty: LiteLLM
takes an OpenAI-compatible server to support it).

Two backends: the stand-in engine (`tests.support.stand_in_engine`, which records what
reached it: the fields go through untouched and the answers' shapes are OpenAI's), and the
tiny engines (the engine's own server and loop: what it does with them). Every answer is
also checked against the SDK's types by the ``gateway`` fixture.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.launcher.engine_install import is_engine_installed
from model_files.checkpoint import load_tokenizer
from tests.gateway.request_path.conftest import SMALL, Engines, settings_for
from tests.gateway.request_path.test_openai_sdk import usage_records
from tests.support.stand_in_engine import MODEL, SYSTEM_FINGERPRINT
from tests.support.stand_in_stack import (
    TappedEngine,
    stand_in_engine,
    stand_in_settings,
    tenant_key,
)

NUM_CHUNKS = 3
HAS_MODEL = is_engine_installed()  # else the engines run a stand-in for the model
MESSAGES: list[Any] = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture
def stand_in(
    gateway: Callable[..., str], db_url: str, tmp_path: Path
) -> Iterator[tuple[TappedEngine, openai.OpenAI, str]]:
    """``(engine, client, tenant_id)``: the SDK in front of a gateway and the stand-in."""
    with stand_in_engine(num_chunks=NUM_CHUNKS) as engine:
        base = gateway(stand_in_settings(engine, tmp_path / "gw", db_url))
        tenant_id, key = tenant_key(db_url, budget_tokens=100_000, budget_period="day")
        yield engine, openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0), tenant_id


def test_the_sdk_sends_n_penalties_and_logit_bias_untouched(
    stand_in: tuple[TappedEngine, openai.OpenAI, str], db_url: str
) -> None:
    engine, client, tenant_id = stand_in
    chat = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        n=3,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"50256": -100, "11": 2.5},
        seed=7,
        max_tokens=NUM_CHUNKS,
        extra_body={"repetition_penalty": 1.2},
    )
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert all(c.message.refusal is None for c in chat.choices)
    assert chat.system_fingerprint == SYSTEM_FINGERPRINT
    assert chat.usage is not None
    assert chat.usage.completion_tokens == 3 * NUM_CHUNKS  # every choice's
    path, forwarded = engine.requests[-1]
    assert path == "/v1/chat/completions"
    sent = {k: forwarded[k] for k in ("n", "presence_penalty", "frequency_penalty", "seed")}
    assert sent == {"n": 3, "presence_penalty": 0.5, "frequency_penalty": -0.5, "seed": 7}
    assert forwarded["logit_bias"] == {"50256": -100, "11": 2.5}
    assert forwarded["repetition_penalty"] == 1.2
    (record,) = usage_records(db_url, tenant_id, 1)
    assert (record.prompt_tokens, record.completion_tokens) == (
        chat.usage.prompt_tokens,
        3 * NUM_CHUNKS,
    )


def test_the_sdk_streams_n_choices_by_index(
    stand_in: tuple[TappedEngine, openai.OpenAI, str], db_url: str
) -> None:
    _, client, tenant_id = stand_in
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        n=2,
        max_tokens=NUM_CHUNKS,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert texts == {0: "word " * NUM_CHUNKS, 1: "word " * NUM_CHUNKS}
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 2 * NUM_CHUNKS
    (record,) = usage_records(db_url, tenant_id, 1)
    assert record.completion_tokens == 2 * NUM_CHUNKS


def test_the_sdk_sends_prompt_lists_and_echo(
    stand_in: tuple[TappedEngine, openai.OpenAI, str],
) -> None:
    engine, client, _ = stand_in
    prompts = ["Once upon", "a time"]
    text = client.completions.create(
        model=MODEL, prompt=prompts, n=2, echo=True, max_tokens=NUM_CHUNKS
    )
    assert [c.index for c in text.choices] == [0, 1, 2, 3]
    for choice in text.choices:  # choice i * n + j is prompt i's j-th
        assert choice.text.startswith(prompts[choice.index // 2])
    assert text.usage is not None
    assert text.usage.completion_tokens == 4 * NUM_CHUNKS
    forwarded = engine.requests[-1][1]
    assert (forwarded["prompt"], forwarded["n"], forwarded["echo"]) == (prompts, 2, True)
    ids = client.completions.create(model=MODEL, prompt=[[1, 2], [3]], max_tokens=NUM_CHUNKS)
    assert [c.index for c in ids.choices] == [0, 1]


def test_the_sdk_retrieves_a_model_and_hears_model_not_found(
    stand_in: tuple[TappedEngine, openai.OpenAI, str],
) -> None:
    _, client, _ = stand_in
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object) == (MODEL, "model")
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-9")
    assert caught.value.code == "model_not_found"
    assert caught.value.type == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-9", messages=MESSAGES)
    assert unknown.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, n=129)
    assert refused.value.param == "n"


def litellm_module() -> Any:
    """LiteLLM, offline: its model-price map from its own package, not fetched at import."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    return pytest.importorskip("litellm")


# LiteLLM's pydantic models warn about their own typing as they are built: not ours.
@pytest.mark.filterwarnings("ignore:Items? .* (is|are) using the `ReadOnly` qualifier:UserWarning")
def test_litellm_keeps_presence_penalty_with_drop_params(
    stand_in: tuple[TappedEngine, openai.OpenAI, str],
) -> None:
    engine, client, _ = stand_in
    litellm = litellm_module()
    response = litellm.completion(
        model=f"openai/{MODEL}",
        api_base=str(client.base_url),
        api_key=client.api_key,
        messages=MESSAGES,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        n=2,
        max_tokens=NUM_CHUNKS,
        drop_params=True,
        num_retries=0,
    )
    assert [c.index for c in response.choices] == [0, 1]
    assert response.choices[0].message.content == " ".join(["word"] * NUM_CHUNKS)
    forwarded = engine.requests[-1][1]
    assert (forwarded["presence_penalty"], forwarded["frequency_penalty"]) == (0.5, 0.25)
    assert forwarded["n"] == 2


@pytest.fixture
def tiny(
    engines: Engines, gateway: Callable[..., str], db_url: str, tmp_path: Path
) -> openai.OpenAI:
    """The SDK in front of a gateway and the tiny engines."""
    base = gateway(settings_for(engines, tmp_path / "gw", db_url))
    _, key = tenant_key(db_url)
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)


def test_engine_greedy_choices_agree_and_seeded_ones_repeat(tiny: openai.OpenAI) -> None:
    greedy = tiny.chat.completions.create(
        model=SMALL, messages=MESSAGES, n=4, temperature=0, max_tokens=6
    )
    assert len({c.message.content for c in greedy.choices}) == 1
    assert [c.index for c in greedy.choices] == [0, 1, 2, 3]

    def seeded() -> list[str | None]:
        answer = tiny.chat.completions.create(
            model=SMALL, messages=MESSAGES, n=4, temperature=1, seed=11, max_tokens=8
        )
        return [c.message.content for c in answer.choices]

    first = seeded()
    assert seeded() == first
    if HAS_MODEL:  # the stand-in for the model (no torch) ignores sampling parameters
        assert len(set(first)) > 1  # each choice draws from its own (seed, i) generator


def test_engine_applies_logit_bias_to_every_choice_from_the_sdk(
    tiny: openai.OpenAI, engines: Engines
) -> None:
    tokenizer = load_tokenizer(engines.checkpoint)
    (token_id,) = tokenizer.encode("a", add_special_tokens=False)
    forced = tiny.completions.create(
        model=SMALL,
        prompt="Once upon a time",
        n=2,
        temperature=0,
        max_tokens=5,
        logit_bias={str(token_id): 100},
        presence_penalty=1.0,  # no match for +100: the bias wins every step
        frequency_penalty=1.0,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.5},
    )
    if HAS_MODEL:  # the stand-in for the model (no torch) ignores sampling parameters
        assert [c.text for c in forced.choices] == [tokenizer.decode([token_id] * 5)] * 2
    assert [c.index for c in forced.choices] == [0, 1]
    out_of_vocabulary = str(len(tokenizer.backend.get_vocab()) + 1000)
    with pytest.raises(openai.BadRequestError) as refused:
        tiny.completions.create(
            model=SMALL, prompt="hi", max_tokens=2, logit_bias={out_of_vocabulary: 5}
        )
    assert refused.value.param is not None
    assert refused.value.param.startswith("logit_bias")


def test_engine_echoes_each_prompt_of_a_list(tiny: openai.OpenAI) -> None:
    prompts = ["Once upon a time", "The sea"]
    text = tiny.completions.create(model=SMALL, prompt=prompts, n=2, echo=True, max_tokens=3)
    assert [c.index for c in text.choices] == [0, 1, 2, 3]
    for choice in text.choices:
        assert choice.text.startswith(prompts[choice.index // 2])
    card = tiny.models.retrieve(SMALL)
    assert card.id == SMALL
