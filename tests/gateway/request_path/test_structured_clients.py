"""Real clients, unmodified, get structured outputs and tool calls through the gateway from a
SmolLM2 engine (as ``make serve`` runs them): the openai SDK's ``parse`` and its tool calls,
plain and streamed, and LangChain's ``with_structured_output`` and ``bind_tools``.

SmolLM2 needs the engine (torch): in a gateway-only install these tests skip.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
import uvicorn
from pydantic import BaseModel, Field

from backend_engine.async_engine import AsyncEngine
from backend_engine.config import EngineConfig
from backend_engine.server.app import build_app
from gateway.settings import GatewaySettings
from tests.gateway.request_path.test_openai_sdk import usage_records
from tests.support.stand_in_stack import tenant_key
from tests.support.uvicorn_thread import start_in_thread, stop_thread

pytest.importorskip("torch", reason="SmolLM2's engine needs torch")
langchain_openai = pytest.importorskip("langchain_openai")
langchain_messages = pytest.importorskip("langchain_core.messages")

MODEL = "smollm2"
CONTEXT_WINDOW = 2048
MAX_TOKENS = 150


# Plain models, as users write them: their schemas leave the object open (no
# "additionalProperties"), as LangChain's function_calling and bind_tools send them. The engine
# generates only the listed properties (docs/structured_outputs.md), so the answers parse.
class City(BaseModel):
    """A city and the country it is in."""

    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=40)


class GetWeather(BaseModel):
    """The weather forecast for a city."""

    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=7)


WEATHER = "What is the weather in Paris, in celsius, for the next 3 days?"
DESCRIBE = "Describe Paris as JSON."


@pytest.fixture(scope="module")
def smollm2_upstream(smollm2_gguf: Path) -> Iterator[str]:
    """``unix:PATH`` of an engine serving SmolLM2 (model name ``smollm2``) on a Unix socket."""
    config = EngineConfig(
        model=str(smollm2_gguf),
        max_model_len=CONTEXT_WINDOW,
        num_kv_blocks=512,
        show_progress=False,
    )
    tmp = tempfile.mkdtemp(prefix="tw-smol-")  # short: a socket path must stay under 108 bytes
    path = f"{tmp}/engine.sock"
    app = build_app(AsyncEngine(config, model_name=MODEL))
    server = uvicorn.Server(
        uvicorn.Config(
            app, uds=path, loop="asyncio", http="h11", lifespan="on", log_level="warning"
        )
    )
    thread = start_in_thread(server)
    try:
        yield f"unix:{path}"
    finally:
        stop_thread(server, thread)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def served(
    smollm2_upstream: str,
    smollm2_gguf: Path,
    gateway: Callable[..., str],
    db_url: str,
    tmp_path: Path,
) -> tuple[str, str, str]:
    """``(base_url, tenant_id, key)`` of a gateway in front of SmolLM2, with one tenant whose
    budget no test here reaches."""
    tenant_id, key = tenant_key(db_url, budget_tokens=10_000_000, budget_period="day")
    model = {
        "upstreams": [smollm2_upstream],
        "context_window": CONTEXT_WINDOW,
        "checkpoint": str(smollm2_gguf),
        "prices": {"input": 1_000_000, "cached_input": 500_000, "output": 2_000_000},
    }
    settings = GatewaySettings.from_dict(
        {"data_dir": str(tmp_path / "gw"), "database_url": db_url, "models": {MODEL: model}}
    )
    return gateway(settings), tenant_id, key


def sdk_client(served: tuple[str, str, str]) -> openai.OpenAI:
    base, _, key = served
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=300)


def chat_model(served: tuple[str, str, str]) -> Any:
    base, _, key = served
    return langchain_openai.ChatOpenAI(
        base_url=base + "/v1",
        api_key=key,
        model=MODEL,
        temperature=0,
        max_tokens=MAX_TOKENS,
        max_retries=0,
        timeout=300,
    )


def test_the_sdk_parses_a_pydantic_response_format(served: tuple[str, str, str]) -> None:
    completion = sdk_client(served).chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": DESCRIBE}],
        response_format=City,
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    (choice,) = completion.choices
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, City), choice
    assert City.model_validate_json(choice.message.content or "") == choice.message.parsed


def test_an_sdk_tool_round_trip(served: tuple[str, str, str], db_url: str) -> None:
    """A call, the assistant turn appended as the SDK returned it (as OpenAI's docs do), the
    tool's result, then the model's answer."""
    client = sdk_client(served)
    tools = [openai.pydantic_function_tool(GetWeather)]
    messages: list[Any] = [{"role": "user", "content": WEATHER}]
    first = client.chat.completions.parse(
        model=MODEL,
        messages=messages,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    (choice,) = first.choices
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.id.startswith("call_")
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather), call

    messages += [
        choice.message,  # the SDK sends its fields: parsed, parsed_arguments, refusal...
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, temperature=0, max_tokens=60
    )
    (answer,) = second.choices
    assert answer.finish_reason in ("stop", "length", "tool_calls"), answer
    assert answer.message.content or answer.message.tool_calls, answer
    assert first.usage is not None
    assert second.usage is not None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the tool turns count

    _, tenant_id, _ = served
    records = usage_records(db_url, tenant_id, 2)
    assert [r.status.value for r in records] == ["completed", "completed"]
    assert [r.finish_reason for r in records] == ["tool_calls", answer.finish_reason]
    assert [r.prompt_tokens for r in records] == [
        first.usage.prompt_tokens,
        second.usage.prompt_tokens,
    ]


def test_the_sdk_stream_helper_rebuilds_the_calls(
    served: tuple[str, str, str], db_url: str
) -> None:
    """The SDK's stream helper assembles the same calls from the deltas as the plain answer
    holds; both usage records keep the finish reason ``tool_calls``."""
    client = sdk_client(served)
    request: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": WEATHER}],
        "tools": [openai.pydantic_function_tool(GetWeather)],
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
    }
    plain = client.chat.completions.parse(**request)
    with client.chat.completions.stream(**request) as stream:
        streamed = stream.get_final_completion()
    calls = plain.choices[0].message.tool_calls or []
    streamed_calls = streamed.choices[0].message.tool_calls or []
    assert calls
    assert [(c.id[:5], c.function.name, c.function.arguments) for c in streamed_calls] == [
        ("call_", c.function.name, c.function.arguments) for c in calls
    ]
    assert all(isinstance(c.function.parsed_arguments, GetWeather) for c in streamed_calls)
    assert streamed.choices[0].finish_reason == plain.choices[0].finish_reason == "tool_calls"

    _, tenant_id, _ = served
    records = usage_records(db_url, tenant_id, 2)
    assert [(r.streamed, r.finish_reason) for r in records] == [
        (False, "tool_calls"),
        (True, "tool_calls"),
    ]
    assert plain.usage is not None
    assert all(r.completion_tokens == plain.usage.completion_tokens for r in records)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(served: tuple[str, str, str], method: str) -> None:
    structured = chat_model(served).with_structured_output(City, method=method)
    city = structured.invoke(DESCRIBE)
    assert isinstance(city, City), city


def test_langchain_bind_tools_calls_the_tool(served: tuple[str, str, str]) -> None:
    bound = chat_model(served).bind_tools([GetWeather], tool_choice="required")
    message = bound.invoke(WEATHER)
    assert isinstance(message, langchain_messages.AIMessage), message
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call["name"] == "GetWeather"
        assert call["id"].startswith("call_")
        GetWeather.model_validate(call["args"])
    assert message.response_metadata["finish_reason"] == "tool_calls"
