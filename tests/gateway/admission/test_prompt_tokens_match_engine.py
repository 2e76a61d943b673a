"""The gateway reserves exactly the prompt tokens the engine then reports, on both endpoints.

Random prompts (unicode, whitespace runs, text that looks like special tokens, token-id lists)
and conversations (also with tools, tool calls, tool turns and the developer role) go to a
real engine server (tiny demo weights, or the stand-in runner where the engine is not
installed: the count is the engine's tokenizer's either way) for one token each; the
``usage.prompt_tokens`` it answers must equal what admission counts for the same body
(`gateway.admission.prompt_tokens.count_prompt_tokens`, the number its budget reservation is
made of).
Tokenizers: the Llama and Qwen2 demos (a post-processor BOS, a template that writes its own
BOS; Mistral's demo tokenizer is Llama's), and two variants: no post-processor with a ChatML
template (Qwen-like), and a post-processor adding BOS and EOS.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from backend_engine.async_engine import AsyncEngine
from backend_engine.config import EngineConfig
from backend_engine.server.app import build_app
from gateway.admission.prompt_tokens import count_prompt_tokens
from gateway.admission.token_counter import CheckpointTokenCounter, from_checkpoint
from gateway.api.request_body import parse_body
from tests.support.stand_in_runner import DemoEngineModel

MODEL = "tiny"
CONTEXT_LENGTH = 2048
CONTEXT_EXCEEDED = "context_length_exceeded"
CHATML = (
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '\n' + message['content'] + '<|eot_id|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant\n' }}{% endif %}"
)
LOOKALIKES = [
    "<|begin_of_text|>",
    "<|eot_id|>",
    "<|eot_id",
    "<|start_header_id|>user<|end_header_id|>",
    "<|reserved_special_token_0|>",
    "<s>",
    "</s>",
    "  ",
    "\n\n",
    "\t",
    "\r\n",
    "\u00a0",
    "\u3000",
    "e\u0301",
    "😀",
    "中文",
    "ſ",
    "1234567",
]
TEXTS = st.lists(st.text(max_size=12) | st.sampled_from(LOOKALIKES), max_size=8).map("".join)
PARTS = st.lists(st.builds(lambda t: {"type": "text", "text": t}, TEXTS), min_size=1, max_size=3)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXTS | PARTS}
    ),
    min_size=1,
    max_size=4,
)

# Tool calling: calls (content null or text), tool turns, the developer role, and tools whose
# functions' keys come in any order (the engine renders what its request model dumps).
NAMES = st.from_regex(r"[a-zA-Z0-9_-]{1,12}", fullmatch=True)
ARGUMENTS = st.dictionaries(
    st.text(max_size=6), st.integers() | st.booleans() | TEXTS, max_size=3
).map(json.dumps)
CALL = st.builds(
    lambda n, name, arguments: {
        "id": f"call_{n}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    },
    st.integers(0, 99),
    NAMES,
    ARGUMENTS,
)
TOOL_TURNS = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "developer", "user", "assistant"]),
            "content": TEXTS | PARTS,
        }
    )
    | st.fixed_dictionaries(
        {
            "role": st.just("assistant"),
            "content": st.none() | TEXTS,
            "tool_calls": st.lists(CALL, min_size=1, max_size=2),
        }
    )
    | st.fixed_dictionaries(
        {"role": st.just("tool"), "tool_call_id": st.just("call_1"), "content": TEXTS | PARTS}
    ),
    min_size=1,
    max_size=5,
)
PROPERTY = st.fixed_dictionaries(
    {"type": st.just("string")},
    optional={"description": TEXTS, "enum": st.lists(TEXTS, min_size=1, max_size=3)},
)
FUNCTION = st.fixed_dictionaries(
    {"name": NAMES},
    optional={
        "description": st.none() | TEXTS,
        "parameters": st.builds(
            lambda properties: {"type": "object", "properties": properties},
            st.dictionaries(NAMES, PROPERTY, max_size=3),
        ),
        "strict": st.booleans(),
    },
).flatmap(lambda function: st.permutations(list(function.items())).map(dict))
TOOLS = st.lists(
    st.builds(lambda function: {"type": "function", "function": function}, FUNCTION),
    min_size=1,
    max_size=3,
    unique_by=lambda tool: str(tool["function"]["name"]),
)


def _no_post_processor_chatml(spec: dict[str, Any], config: dict[str, Any]) -> None:
    spec["post_processor"] = None
    config["chat_template"] = CHATML


def _bos_and_eos(spec: dict[str, Any], config: dict[str, Any]) -> None:
    ids = {t["content"]: t["id"] for t in spec["added_tokens"]}
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": eos, "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            bos: {"id": bos, "ids": [ids[bos]], "tokens": [bos]},
            eos: {"id": eos, "ids": [ids[eos]], "tokens": [eos]},
        },
    }


VARIANTS: dict[str, tuple[str, Callable[[dict[str, Any], dict[str, Any]], None] | None]] = {
    "llama": ("LlamaForCausalLM", None),
    "qwen2": ("Qwen2ForCausalLM", None),
    "no-bos-chatml": ("LlamaForCausalLM", _no_post_processor_chatml),
    "bos-and-eos": ("LlamaForCausalLM", _bos_and_eos),
}


@dataclass(frozen=True)
class Served:
    client: TestClient
    counter: CheckpointTokenCounter
    vocab_size: int

    def engine_prompt_tokens(self, path: str, body: dict[str, Any]) -> int:
        """The prompt tokens the engine counts: its usage, or, for a prompt longer than its
        context (a drawn conversation can be, on the tiny byte-level tokenizer), the count
        its ``context_length_exceeded`` refusal states."""
        answer = self.client.post(path, json={**body, "model": MODEL, "max_tokens": 1})
        if answer.status_code == 400 and answer.json()["error"]["code"] == CONTEXT_EXCEEDED:
            stated = re.search(r"\((\d+) in the prompt", answer.json()["error"]["message"])
            assert stated is not None, answer.text
            assert int(stated.group(1)) >= CONTEXT_LENGTH, answer.text
            return int(stated.group(1))
        assert answer.status_code == 200, answer.text
        return int(answer.json()["usage"]["prompt_tokens"])


def _checkpoint(source: Path, target: Path, change: Callable[..., None] | None) -> Path:
    if change is None:
        return source
    shutil.copytree(source, target)
    spec = json.loads((target / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((target / "tokenizer_config.json").read_text(encoding="utf-8"))
    change(spec, config)
    (target / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    (target / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return target


@pytest.fixture(scope="module", params=list(VARIANTS))
def served(
    request: pytest.FixtureRequest,
    demo_engine_model: Callable[..., DemoEngineModel],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Served]:
    architecture, change = VARIANTS[request.param]
    model = demo_engine_model(architecture=architecture, size="tiny")
    path = _checkpoint(model.checkpoint, tmp_path_factory.mktemp("variant") / "ckpt", change)
    config = EngineConfig(
        model=str(path),
        max_model_len=CONTEXT_LENGTH,
        num_kv_blocks=256,
        max_num_seqs=4,
        show_progress=False,
    )
    engine = AsyncEngine(config, model_name=MODEL, plan_runner=model.plan_runner)
    with TestClient(build_app(engine)) as client:
        yield Served(client, from_checkpoint(path), engine.tokenizer.vocab_size)


# Each example is one prefill of one token on the tiny model: a few milliseconds.
_SETTINGS = settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@_SETTINGS
@given(prompt=TEXTS.filter(bool))
def test_completions_text_prompt(served: Served, prompt: str) -> None:
    body = parse_body({"model": MODEL, "prompt": prompt}, "completions")
    reported = served.engine_prompt_tokens("/v1/completions", {"prompt": prompt})
    assert count_prompt_tokens(served.counter, body) == reported


@_SETTINGS
@given(data=st.data())
def test_completions_token_ids(served: Served, data: st.DataObject) -> None:
    ids = data.draw(st.lists(st.integers(0, served.vocab_size - 1), min_size=1, max_size=40))
    body = parse_body({"model": MODEL, "prompt": ids}, "completions")
    reported = served.engine_prompt_tokens("/v1/completions", {"prompt": ids})
    assert count_prompt_tokens(served.counter, body) == reported == len(ids)


@_SETTINGS
@given(data=st.data())
def test_completions_prompt_lists(served: Served, data: st.DataObject) -> None:
    """A list of prompts, text or token ids, with n choices each: every prompt once."""
    token_ids = st.lists(st.integers(0, served.vocab_size - 1), min_size=1, max_size=20)
    prompts = data.draw(
        st.lists(TEXTS.filter(bool), min_size=1, max_size=4)
        | st.lists(token_ids, min_size=1, max_size=4)
    )
    n = data.draw(st.integers(1, 3))
    body = parse_body({"model": MODEL, "prompt": prompts, "n": n}, "completions")
    reported = served.engine_prompt_tokens("/v1/completions", {"prompt": prompts, "n": n})
    assert count_prompt_tokens(served.counter, body) == reported


@_SETTINGS
@given(messages=MESSAGES)
def test_chat(served: Served, messages: list[dict[str, Any]]) -> None:
    body = parse_body({"model": MODEL, "messages": messages}, "chat")
    reported = served.engine_prompt_tokens("/v1/chat/completions", {"messages": messages})
    assert count_prompt_tokens(served.counter, body) == reported


@_SETTINGS
@given(messages=TOOL_TURNS, tools=st.none() | TOOLS)
def test_chat_with_tools_and_tool_turns(
    served: Served, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> None:
    """``tool_choice: none`` keeps the answer free (a constrained one is the structured-output
    tests' business); the tools are in the prompt whatever the choice."""
    fields: dict[str, Any] = {"messages": messages}
    if tools is not None:
        fields.update(tools=tools, tool_choice="none")
    body = parse_body({"model": MODEL, **fields}, "chat")
    reported = served.engine_prompt_tokens("/v1/chat/completions", fields)
    assert count_prompt_tokens(served.counter, body) == reported
