from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import pytest

from model_files.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
TEXTS = (
    "Hello, world!",
    "  leading spaces and trailing   ",
    "It's what they'll say; we'd've known.",
    "Prices: 1234567 + 89 = 1234656, π ≈ 3.14159",
    "def f(x):\n\treturn x ** 2\n\n\n# done",
    "Crème brûlée, naïve Jürgen, 中文字符测试, 日本語, Привет",
    "Emoji 🙂🚀👍🏽❤️ and a family 👨‍👩‍👧 too",
    "",
    "<|eot_id|> looks special <|begin_of_text|>",
    "\r\n\r\n   \n",
)
CONVERSATIONS: tuple[list[dict[str, Any]], ...] = (
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are terse.  "},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Und 中文? 🙂"},
    ],
)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoint(request: pytest.FixtureRequest, demo_checkpoint: Callable[..., Path]) -> Path:
    return demo_checkpoint(architecture=request.param)


@pytest.fixture(scope="module")
def pair(checkpoint: Path) -> tuple[Tokenizer, Any]:
    return Tokenizer.from_pretrained(checkpoint), transformers.AutoTokenizer.from_pretrained(
        checkpoint
    )


def test_encode_matches_transformers(pair: tuple[Tokenizer, Any]) -> None:
    ours, hf = pair
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == hf.encode(
            text, add_special_tokens=False
        ), text


def test_encode_prepends_bos_once(pair: tuple[Tokenizer, Any]) -> None:
    ours, _ = pair
    ids = ours.encode("hello")
    assert ids[0] == ours.bos_token_id
    assert ids.count(ours.bos_token_id) == 1
    assert ours.encode("hello", add_special_tokens=False) == ids[1:]


def test_decode_matches_transformers(pair: tuple[Tokenizer, Any]) -> None:
    ours, hf = pair
    for text in TEXTS:
        ids = hf.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )
        plain = ours.encode(text, add_special_tokens=False)
        assert ours.decode(plain, skip_special_tokens=False) == text


def test_every_id_decodes(pair: tuple[Tokenizer, Any]) -> None:
    ours, hf = pair
    ids = list(range(ours.vocab_size))
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ours.convert_ids_to_tokens([ours.vocab_size])


def test_special_tokens(pair: tuple[Tokenizer, Any], checkpoint: Path) -> None:
    ours, hf = pair
    config = json.loads((checkpoint / "config.json").read_text())
    assert ours.vocab_size == config["vocab_size"] == len(hf)
    assert ours.bos_token_id == hf.bos_token_id == config["bos_token_id"]
    eot, end_of_text = (ours.backend.token_to_id(t) for t in ("<|eot_id|>", "<|end_of_text|>"))
    assert ours.eos_token_ids == frozenset({eot, end_of_text})
    assert ours.is_special(eot)
    assert ours.is_special(ours.bos_token_id or 0)
    assert not ours.is_special(ours.encode("hello", add_special_tokens=False)[0])
    assert {i for i in range(ours.vocab_size) if ours.is_special(i)} == set(hf.all_special_ids) | {
        i for i, t in hf.added_tokens_decoder.items() if t.special
    }


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    pair: tuple[Tokenizer, Any], add_generation_prompt: bool
) -> None:
    ours, hf = pair
    for messages in CONVERSATIONS:
        expected = hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours.apply_chat_template(messages, add_generation_prompt) == expected
        expected_ids = hf.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt
        )
        if isinstance(expected_ids, dict) or hasattr(expected_ids, "input_ids"):
            expected_ids = expected_ids["input_ids"]
        ids = ours.encode_chat(messages, add_generation_prompt)
        assert ids == list(expected_ids)
        assert ids.count(ours.bos_token_id) == 1


def test_chat_template_raise_exception(pair: tuple[Tokenizer, Any]) -> None:
    ours, _ = pair
    with pytest.raises(jinja2.exceptions.TemplateError, match="Unknown role: robot"):
        ours.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_custom_template_features_match_transformers(
    demo_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    directory = tmp_path / "ckpt"
    shutil.copytree(demo_checkpoint(), directory)
    template = (
        "{%- set ns = namespace(n=0) -%}\n"
        "{% for m in messages %}\n"
        "  {% if m.role == 'system' %}{% continue %}{% endif %}\n"
        "  {% set ns.n = ns.n + 1 %}\n"
        "  [{{ ns.n }}] {{ m.role }}: {{ m.content | tojson }}\n"
        "  {% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% endif %}\n"
        "{% endfor %}\n"
        "{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}\n"
        "{{ eos_token }}{% if add_generation_prompt %}>>{% endif %}"
    )
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    ours = Tokenizer.from_pretrained(directory)
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    tools = [{"type": "function", "function": {"name": "f", "description": "é"}}]
    messages = [*CONVERSATIONS[1], {"role": "assistant", "content": 'say "hi"'}]
    assert ours.apply_chat_template(messages, tools=tools) == hf.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )


def test_eos_falls_back_to_tokenizer_config(
    demo_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    directory = tmp_path / "ckpt"
    shutil.copytree(demo_checkpoint(), directory)
    (directory / "generation_config.json").unlink()
    tok = Tokenizer.from_pretrained(directory)
    assert tok.eos_token_ids == frozenset({tok.backend.token_to_id("<|eot_id|>")})


def test_missing_files_are_named(demo_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(
        FileNotFoundError, match=re.escape(f"tokenizer.json not found in {tmp_path}")
    ):
        Tokenizer.from_pretrained(tmp_path)

    directory = tmp_path / "ckpt"
    shutil.copytree(demo_checkpoint(), directory)
    (directory / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json in .*ckpt is not valid JSON"):
        Tokenizer.from_pretrained(directory)
    (directory / "tokenizer_config.json").unlink()
    tok = Tokenizer.from_pretrained(directory)
    with pytest.raises(ValueError, match=r"no chat template.*ckpt"):
        tok.apply_chat_template(CONVERSATIONS[0])
