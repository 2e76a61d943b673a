"""The gateway's tiktoken counts equal the engine tokenizer's, token for token."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from backend_engine.demo.corpus import iter_demo_corpus
from gateway.admission.token_counter import (
    CheckpointTokenCounter,
    PromptTokens,
    TokenizerCounter,
    UnsupportedTokenizer,
    exact_counter,
    for_openai_model,
    from_checkpoint,
    load_openai_encoding,
    openai_encoding_name,
)
from gateway.app import token_counters
from gateway.settings import ModelSettings
from model_files.checkpoint import load_tokenizer
from model_files.tokenizer import Tokenizer
from openai_protocol.request_models import ChatCompletionRequest
from tests.model_files.gguf_tokenizer_files import (
    AWKWARD_TEXTS,
    write_sentencepiece_gguf,
    write_tokenizer_gguf,
)
from tests.model_files.gguf_tokenizer_files import CONVERSATIONS as GGUF_CONVERSATIONS

REPO_ROOT = Path(__file__).resolve().parents[3]
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
TEXTS = [
    "",
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "It's, they're, we'VE, I'M, you'll, he'd, 'S 'ſ 'LL",
    "1 12 123 1234 12345 3.14159 -42 1e10 0x1F 2024-06-01 1,000,000",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    'for (let i = 0; i < n; i++) { console.log(`${i}`); }  /* done */ {"a": [1, 2]}',
    "emoji 😀🚀🎉 family 👨\u200d👩\u200d👧 flags 🇫🇷🇯🇵 skin 👍🏽",
    "中文分词测试，日本語のテキスト、한국어 문장입니다。",
    "café naïve façade Ærøskøbing Ångström crème brûlée ñandú",
    "decomposed: cafe\u0301 nai\u0308ve A\u030angstro\u0308m",
    "whitespace   runs\t\t\tand\n\n\n\nnewlines \r\n\r\n   trailing   ",
    "odd spaces\u00a0nbsp\u3000ideographic\u2003em\u2009thin\u0085nel\x0bvt\x0cff",
    "<|eot_id|>",
    "user text with <|begin_of_text|> and <|start_header_id|>system<|end_header_id|> inside",
    "partial <|eot_id <|eot_id|>|> <<|eot_id|>> <|reserved_special_token_0|>x",
    "combining after a special <|eot_id|>\u0338 and ≯ ≮ ≠ =\u0338",
    "a" * 300 + " " + "ab" * 150,
    "Mixed: ÀÉÎÕÜ ß ẞ ſt ﬁ ﬂ Ω Ω K K Å Å",
]
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hello"}],
    [
        {"role": "system", "content": "You are terse.  "},
        {"role": "user", "content": "  What is 2+2?\n"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 12345 * 6789? 😀 中文"},
    ],
    [
        {"role": "user", "content": "Ignore <|eot_id|><|start_header_id|>system<|end_header_id|>"},
        {"role": "assistant", "content": "café\u0301 <|begin_of_text|>"},
        {"role": "tool", "content": '{"result": [1, 2, 3]}'},
        {"role": "user", "content": ""},
    ],
]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {
                    "type": "string",
                    "description": "The city and state, e.g. San Francisco, CA",
                },
                "unit": {
                    "type": "string",
                    "description": "The unit of temperature to return",
                    "enum": ["celsius", "fahrenheit"],
                },
            },
            "required": ["location"],
        },
    },
}
# Keys in another order than the engine's request model dumps them, a null and a key it does
# not know: the engine renders what its model keeps, and so must the counter.
UNTIDY_TOOL = {
    "function": {
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        "x-vendor": {"ignored": True},
        "description": None,
        "name": "search",
    },
    "type": "function",
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"q": 1}'}}
# (messages, tools) with tool turns, the developer role, text parts and calls with null content.
TOOL_CONVERSATIONS: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    ([{"role": "user", "content": "Weather in Paris?"}], [WEATHER_TOOL]),
    (
        [
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Find "}, {"type": "text", "text": "cats"}],
            },
            {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"hits": 3}'},
            {
                "role": "tool",
                "tool_call_id": "call_2",
                "content": [{"type": "text", "text": "none"}],
            },
            {"role": "assistant", "content": "Three <|eot_id|> hits."},
        ],
        [UNTIDY_TOOL, WEATHER_TOOL],
    ),
    ([{"role": "developer", "content": "No tools here."}, {"role": "user", "content": "hi"}], None),
]


def engine_prompt(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[int]:
    """The ids the engine's server makes of a chat (``routes.py``): through its request model."""
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": messages, **({"tools": tools} if tools else {})}
    )
    return tokenizer.encode_chat(request.chat_messages(), tools=request.tool_dicts())


def _random_texts(num_texts: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = "abcXYZ 019.,;'!?-_()<>|\n\t  éüñ中文😀\u00a0\u3000\u0301ſ"
    corpus = "".join(iter_demo_corpus(60_000))
    texts = [corpus[i : i + rng.randint(1, 3000)] for i in range(0, len(corpus), 2000)]
    texts += ["".join(rng.choices(alphabet, k=rng.randint(1, 80))) for _ in range(num_texts)]
    return texts


@pytest.fixture(scope="module", params=[(a, s) for a in ARCHITECTURES for s in ("tiny", "small")])
def pair(
    request: pytest.FixtureRequest, demo_model_files: Callable[..., Path]
) -> tuple[CheckpointTokenCounter, Tokenizer]:
    architecture, size = request.param
    path = demo_model_files(architecture=architecture, size=size)
    return from_checkpoint(path), Tokenizer.from_pretrained(path)


def _assert_same_text(counter: CheckpointTokenCounter, tokenizer: Tokenizer, text: str) -> None:
    expected = tokenizer.encode(text, add_special_tokens=False)
    assert counter.encode_text(text) == expected, repr(text)
    assert counter.count_text(text) == len(expected)


def test_texts_match_engine_tokenizer(pair: tuple[CheckpointTokenCounter, Tokenizer]) -> None:
    counter, tokenizer = pair
    for text in TEXTS + _random_texts(500, seed=0):
        _assert_same_text(counter, tokenizer, text)


def test_every_vocabulary_token_alone(pair: tuple[CheckpointTokenCounter, Tokenizer]) -> None:
    counter, tokenizer = pair
    for token_id in range(tokenizer.vocab_size):
        _assert_same_text(counter, tokenizer, tokenizer.decode([token_id], False))


def test_prompts_match_engine_encode(pair: tuple[CheckpointTokenCounter, Tokenizer]) -> None:
    """A completions prompt's ids, with what the post-processor adds (the ids the engine's
    server hashes into prefix-cache blocks, so the gateway can route by them)."""
    counter, tokenizer = pair
    for text in TEXTS + _random_texts(100, seed=1):
        assert counter.encode_prompt(text) == tokenizer.encode(text), repr(text)
    if tokenizer.bos_token_id is not None and counter.count_prompt("") == 1:
        assert counter.encode_prompt("hi")[0] == tokenizer.bos_token_id


def test_chat_matches_encode_chat(pair: tuple[CheckpointTokenCounter, Tokenizer]) -> None:
    counter, tokenizer = pair
    conversations = [*CONVERSATIONS, [{"role": "user", "content": t} for t in TEXTS]]
    for messages in conversations:
        expected = tokenizer.encode_chat(messages)
        assert counter.encode_chat(messages) == expected
        assert counter.count_chat(messages) == len(expected)
        assert counter.tokenize_chat(messages, limit=10**9) == PromptTokens(len(expected), expected)


def test_tools_and_tool_turns_count_as_the_engine_renders_them(
    pair: tuple[CheckpointTokenCounter, Tokenizer],
) -> None:
    counter, tokenizer = pair
    for messages, tools in TOOL_CONVERSATIONS:
        expected = engine_prompt(tokenizer, messages, tools)
        assert counter.encode_chat(messages, tools) == expected
        assert counter.count_chat(messages, tools=tools) == len(expected)
        assert counter.tokenize_chat(messages, 10**9, tools) == PromptTokens(
            len(expected), expected
        )
    messages, tools = TOOL_CONVERSATIONS[0]
    assert counter.count_chat(messages, tools=tools) > counter.count_chat(messages)


def test_tokenize_is_the_count_with_the_ids(pair: tuple[CheckpointTokenCounter, Tokenizer]) -> None:
    """What the admitter keeps for the replica router: the count it reserves, and the ids
    wherever it tokenized (none for a prompt refused by its length alone)."""
    counter, tokenizer = pair
    for text in TEXTS + _random_texts(50, seed=3):
        assert counter.tokenize_prompt(text, limit=10**9) == PromptTokens(
            counter.count_prompt(text), tokenizer.encode(text)
        )
        long_text = text + "x" * 100_000
        assert counter.tokenize_prompt(long_text, limit=10) == PromptTokens(
            counter.count_prompt(long_text, limit=10), None
        )
        chat = [{"role": "user", "content": long_text}]
        assert counter.tokenize_chat(chat, limit=10) == PromptTokens(
            counter.count_chat(chat, limit=10), None
        )


def test_qwen2_normalizes_nfc_outside_special_tokens(demo_model_files: Callable[..., Path]) -> None:
    path = demo_model_files(architecture="Qwen2ForCausalLM", size="small")
    counter, tokenizer = from_checkpoint(path), Tokenizer.from_pretrained(path)
    for text in ("cafe\u0301", "<|eot_id|>\u0338", "x<|eot_id|>A\u030a"):
        _assert_same_text(counter, tokenizer, text)
    assert counter.count_text("cafe\u0301") == counter.count_text("café")


# --- tokenizer.json variants the demos do not cover ----------------------------------------------


def _variant(source: Path, target: Path, spec: dict[str, Any]) -> Path:
    target.mkdir()
    for name in ("tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, target / name)
    (target / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    return target


def _spec(path: Path) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    return spec


def _assert_variant_matches(path: Path) -> CheckpointTokenCounter:
    counter, tokenizer = from_checkpoint(path), Tokenizer.from_pretrained(path)
    for text in TEXTS + _random_texts(200, seed=1):
        _assert_same_text(counter, tokenizer, text)
    for messages in CONVERSATIONS:
        assert counter.encode_chat(messages) == tokenizer.encode_chat(messages)
    return counter


def test_ids_out_of_merge_order_use_merge_ranks(
    demo_model_files: Callable[..., Path], tmp_path: Path
) -> None:
    source = demo_model_files(architecture="LlamaForCausalLM", size="small")
    spec = _spec(source)
    vocab = spec["model"]["vocab"]
    merged = [
        "".join(m) if isinstance(m, list) else m.replace(" ", "") for m in spec["model"]["merges"]
    ]
    ids = [vocab[token] for token in merged]
    vocab.update(zip(merged, reversed(ids), strict=True))  # later merges get smaller ids
    counter = _assert_variant_matches(_variant(source, tmp_path / "reversed", spec))
    assert counter.encode_text("the engine") != counter.encoding.encode("the engine")


def test_tokens_no_merge_makes_are_left_out(
    demo_model_files: Callable[..., Path], tmp_path: Path
) -> None:
    """Without ignore_merges HF never produces such a token (llama.cpp's [PAD123] fillers)."""
    source = demo_model_files(architecture="LlamaForCausalLM", size="small")
    spec = _spec(source)
    *spec["model"]["merges"], last = spec["model"]["merges"]
    assert not spec["model"].get("ignore_merges")
    counter = _assert_variant_matches(_variant(source, tmp_path / "unmade", spec))
    unmade = "".join(last) if isinstance(last, list) else last.replace(" ", "")
    tokenizer = Tokenizer.from_pretrained(tmp_path / "unmade")
    assert tokenizer.backend.token_to_id(unmade) is not None
    text = tokenizer.decode([tokenizer.backend.token_to_id(unmade)], False)
    assert counter.encode_text(text) == tokenizer.encode(text, add_special_tokens=False)


def test_byte_level_regex_pre_tokenizer(
    demo_model_files: Callable[..., Path], tmp_path: Path
) -> None:
    source = demo_model_files(architecture="LlamaForCausalLM", size="small")
    spec = _spec(source)
    spec["pre_tokenizer"] = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": True,
    }
    _assert_variant_matches(_variant(source, tmp_path / "gpt2-regex", spec))


def test_added_tokens_match_leftmost_longest(
    demo_model_files: Callable[..., Path], tmp_path: Path
) -> None:
    source = demo_model_files(architecture="LlamaForCausalLM", size="tiny")
    backend = HFTokenizer.from_file(str(source / "tokenizer.json"))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<|x|>", "<|x|>y", "<|x")]
    )
    path = _variant(source, tmp_path / "prefixes", json.loads(backend.to_str()))
    counter, tokenizer = from_checkpoint(path), Tokenizer.from_pretrained(path)
    for text in ("a<|x|>yb<|x|>c<|x", "<|x|>y<|x|>y<|x|", "<|x<|x|>yy"):
        _assert_same_text(counter, tokenizer, text)


def _three_token_bpe(tmp_path: Path, *, ignore_merges: bool) -> Path:
    """``abc`` is a token, but merges (b c) then (a b) then (ab c) split the word into a|bc."""
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(byte_chars))}
    vocab.update({"bc": 256, "ab": 257, "abc": 258})
    merges = [("b", "c"), ("a", "b"), ("ab", "c")]
    backend = HFTokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{L}+|\s+|[^\s\p{L}]+"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    path = tmp_path / f"abc-{ignore_merges}"
    path.mkdir()
    backend.save(str(path / "tokenizer.json"))
    return path


def test_merges_that_split_a_whole_token_are_refused(tmp_path: Path) -> None:
    path = _three_token_bpe(tmp_path, ignore_merges=False)
    tokenizer = Tokenizer.from_pretrained(path)
    assert tokenizer.encode("abc", add_special_tokens=False) == [
        tokenizer.backend.token_to_id("a"),
        256,
    ]
    with pytest.raises(
        UnsupportedTokenizer, match=r"the merges split the token 'abc' into \['a', 'bc'\]"
    ):
        from_checkpoint(path)


def test_unnamed_pairs_are_refused_with_ignore_merges(tmp_path: Path) -> None:
    """tiktoken would merge a|bc in "abcabc" (abc is a token); HF's merges never do."""
    path = _three_token_bpe(tmp_path, ignore_merges=True)
    tokenizer = Tokenizer.from_pretrained(path)
    a, bc = tokenizer.backend.token_to_id("a"), 256
    assert tokenizer.encode("abc", add_special_tokens=False) == [258]
    assert tokenizer.encode("abcabc", add_special_tokens=False) == [a, bc, a, bc]
    with pytest.raises(UnsupportedTokenizer, match="the merges split the token 'abc'"):
        from_checkpoint(path)


# --- OpenAI encodings ----------------------------------------------------------------------------


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(blobpath: str) -> bytes:
        raise AssertionError(f"tried to read {blobpath}")

    monkeypatch.setattr("tiktoken.load.read_file", refuse)


@pytest.mark.usefixtures("no_network")
def test_cl100k_base_loads_offline() -> None:
    encoding = load_openai_encoding("cl100k_base")
    assert encoding.encode("hello world") == [15339, 1917]
    assert encoding.n_vocab == 100277
    assert encoding.encode("<|endoftext|>", allowed_special="all") == [100257]


@pytest.mark.usefixtures("no_network")
def test_o200k_base_loads_offline() -> None:
    encoding = load_openai_encoding("o200k_base")
    assert encoding.encode("hello world") == [24912, 2375]
    assert encoding.n_vocab == 200019


@pytest.mark.parametrize(
    ("model", "encoding"),
    [
        ("gpt-4o", "o200k_base"),
        ("gpt-4o-mini-2024-07-18", "o200k_base"),
        ("o3-mini", "o200k_base"),
        ("gpt-oss-20b", "o200k_base"),
        ("gpt-4", "cl100k_base"),
        ("gpt-3.5-turbo-0125", "cl100k_base"),
        ("text-davinci-003", "cl100k_base"),
        ("llama-3-8b-instruct", "cl100k_base"),
    ],
)
def test_openai_encoding_names(model: str, encoding: str) -> None:
    assert openai_encoding_name(model) == encoding


def test_openai_chat_counts_follow_the_cookbook() -> None:
    counter = for_openai_model("gpt-4")
    encoding = counter.encoding
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "name": "example_user", "content": "New synergies <|endoftext|>"},
    ]
    values = [v for m in messages for v in m.values()]
    expected = sum(len(encoding.encode_ordinary(v)) for v in values) + 3 * 2 + 1 + 3
    assert counter.count_chat(messages) == expected
    assert counter.count_chat([{"role": "user", "content": "hello world"}]) == 3 + 1 + 2 + 3
    assert counter.count_text("<|endoftext|>") > 1  # plain text, not the special token


@pytest.mark.parametrize(("model", "expected"), [("gpt-4", 105), ("gpt-4o", 101)])
def test_openai_tools_count_as_the_cookbook_estimates(model: str, expected: int) -> None:
    """The cookbook's example, whose counts it checked against OpenAI's API."""
    messages = [
        {
            "role": "system",
            "content": "You are a helpful assistant that can answer to questions about the "
            "weather.",
        },
        {"role": "user", "content": "What's the weather like in San Francisco?"},
    ]
    counter = for_openai_model(model)
    assert counter.count_chat(messages, tools=[WEATHER_TOOL]) == expected
    assert counter.count_chat(messages, tools=[]) == counter.count_chat(messages)


def test_gateway_module_imports_neither_torch_nor_transformers() -> None:
    code = (
        "import sys, gateway.admission.token_counter; "
        "assert 'torch' not in sys.modules, 'torch'; "
        "assert 'transformers' not in sys.modules, 'transformers'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)


# --- a limit: prompts longer than it by their length alone are not tokenized -------------------

COMPOSING = ["a\u0308\u0304", "\u1100\u1161\u11a8", "\u03b1\u0313\u0300\u0345", "e\u0301"]


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_the_bound_from_length_never_exceeds_the_count(
    demo_model_files: Callable[..., Path], architecture: str
) -> None:
    counter = from_checkpoint(demo_model_files(architecture=architecture, size="tiny"))
    texts = TEXTS + _random_texts(200, seed=1) + [c * 50 for c in COMPOSING]
    texts += ["<|reserved_special_token_0|>" * 40, "a" * 5000]
    openai = for_openai_model("gpt-4")
    for text in texts:
        # limit 0: every non-empty prompt is "too long", so the answer is the bound alone
        assert counter.count_prompt(text, limit=0) <= counter.count_prompt(text), repr(text)
        assert openai.count_prompt(text, limit=0) <= openai.count_prompt(text), repr(text)
        chat = [{"role": "user", "content": text}]
        assert counter.count_chat(chat, limit=0) <= counter.count_chat(chat), repr(text)
        # a limit the prompt fits in changes nothing
        assert counter.count_prompt(text, limit=10**9) == counter.count_prompt(text)


def test_a_prompt_too_long_by_its_length_is_not_tokenized(
    demo_model_files: Callable[..., Path],
) -> None:
    counter = from_checkpoint(demo_model_files(architecture="LlamaForCausalLM", size="tiny"))
    word = "a" * (1 << 20)
    counter.encoding = None  # type: ignore[assignment]  # tokenizing now raises
    assert counter.count_prompt(word, limit=2047) > 2047
    assert counter.count_chat([{"role": "user", "content": word}], limit=2047) > 2047
    with pytest.raises(AttributeError):
        counter.count_prompt(word[:100], limit=2047)


# --- GGUF files: the tokenizer rebuilt from the metadata, counted as the engine counts ---------


def _assert_counts_like_engine(counter: CheckpointTokenCounter, tokenizer: Tokenizer) -> None:
    for text in TEXTS + list(AWKWARD_TEXTS) + _random_texts(200, seed=2):
        _assert_same_text(counter, tokenizer, text)
        assert counter.count_prompt(text) == len(tokenizer.encode(text)), repr(text)
    for messages in [*CONVERSATIONS, *GGUF_CONVERSATIONS]:
        expected = tokenizer.encode_chat(messages)
        assert counter.encode_chat(messages) == expected
        assert counter.count_chat(messages) == len(expected)
        assert counter.tokenize_chat(messages, limit=10**9) == PromptTokens(len(expected), expected)


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "llama-bpe", "qwen2"])
def test_a_gguf_files_prompts_count_as_its_engine_tokenizer(tmp_path: Path, pre: str) -> None:
    """Qwen2's file also carries llama.cpp's [PAD<id>] fillers, which no merge makes."""
    path = write_tokenizer_gguf(
        tmp_path / f"{pre}.gguf",
        pre,
        add_bos_token=pre == "llama-bpe",
        num_unused=3 if pre == "qwen2" else 0,
    )
    counter, tokenizer = from_checkpoint(path), load_tokenizer(path)
    assert counter.count_prompt("hi") == counter.count_text("hi") + (pre == "llama-bpe")  # BOS
    _assert_counts_like_engine(counter, tokenizer)
    for token_id in range(tokenizer.vocab_size):
        _assert_same_text(counter, tokenizer, tokenizer.decode([token_id], False))


_DROPPED = ["!\x04!", "a\x13b\x16c", "\U00050000x\U000b0000", "\x04" * 5000, " \x1d 1"]


def test_smollm2_counts_as_its_engine_tokenizer_without_torch(smollm2_gguf: Path) -> None:
    """The gateway loads the GGUF's counter with torch blocked, and counts every text and
    chat as the engine's tokenizer does, also texts with a byte SmolLM2 has no token for
    (HF drops it and merges across the gap: "!\\x04!" is one token)."""
    texts = [*TEXTS, *AWKWARD_TEXTS, *_DROPPED]
    chats = [*CONVERSATIONS, *GGUF_CONVERSATIONS]
    code = (
        "import json, sys; sys.modules['torch'] = None\n"
        "from gateway.admission.token_counter import from_checkpoint\n"
        "texts, chats = json.load(sys.stdin)\n"
        f"counter = from_checkpoint({str(smollm2_gguf)!r})\n"
        "print(json.dumps([[counter.encode_text(t) for t in texts],"
        " [counter.count_prompt(t, limit=10) for t in texts],"
        " [counter.encode_chat(c) for c in chats],"
        " [counter.encode_prompt(t) for t in texts]]))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        input=json.dumps([texts, chats]),
        capture_output=True,
        text=True,
        check=True,
    )
    ids, prompt_counts, chat_ids, prompt_ids = json.loads(result.stdout)
    tokenizer = load_tokenizer(smollm2_gguf)
    assert ids == [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert ids[texts.index("!\x04!")] == tokenizer.encode("!!", add_special_tokens=False)
    assert prompt_counts[: len(TEXTS)] == [len(tokenizer.encode(t)) for t in TEXTS]
    assert prompt_counts[-len(_DROPPED) :] == [len(tokenizer.encode(t)) for t in _DROPPED]
    assert chat_ids == [tokenizer.encode_chat(c) for c in chats]
    assert prompt_ids == [tokenizer.encode(t) for t in texts]


def test_a_tokenizer_tiktoken_cannot_reproduce_is_counted_with_the_engines_own(
    tmp_path: Path,
) -> None:
    """A SentencePiece GGUF (byte fallback): the gateway counts exactly with HF tokenizers."""
    path = write_sentencepiece_gguf(tmp_path / "spm.gguf")
    with pytest.raises(UnsupportedTokenizer, match="byte_fallback"):
        from_checkpoint(path)
    counter, tokenizer = exact_counter(path), load_tokenizer(path)
    assert isinstance(counter, TokenizerCounter)
    for text in [*TEXTS, *AWKWARD_TEXTS]:
        assert counter.count_text(text) == len(tokenizer.encode(text, add_special_tokens=False))
        assert counter.count_prompt(text, limit=1) == len(tokenizer.encode(text))  # with BOS
        assert counter.encode_prompt(text) == tokenizer.encode(text)
    for messages in [*CONVERSATIONS, *GGUF_CONVERSATIONS]:
        assert counter.count_chat(messages) == len(tokenizer.encode_chat(messages))
        assert counter.encode_chat(messages) == tokenizer.encode_chat(messages)
        expected = tokenizer.encode_chat(messages)
        assert counter.tokenize_chat(messages, limit=1) == PromptTokens(len(expected), expected)
    for messages, tools in TOOL_CONVERSATIONS:
        expected = engine_prompt(tokenizer, messages, tools)
        assert counter.count_chat(messages, tools=tools) == len(expected)
        assert counter.tokenize_chat(messages, 1, tools) == PromptTokens(len(expected), expected)


def test_models_on_one_checkpoint_share_one_counter(tmp_path: Path) -> None:
    gguf_path = write_tokenizer_gguf(tmp_path / "m.gguf", "qwen2")
    spm_path = write_sentencepiece_gguf(tmp_path / "spm.gguf")

    def model(name: str, checkpoint: Path | None) -> ModelSettings:
        return ModelSettings(name, ("http://127.0.0.1:1",), 256, checkpoint)

    models = {
        "small": model("small", gguf_path),
        "large": model("large", gguf_path),
        "spm": model("spm", spm_path),
        "gpt-4o": model("gpt-4o", None),
    }
    counters = token_counters(models)
    assert counters["small"] is counters["large"]
    assert isinstance(counters["small"], CheckpointTokenCounter)
    assert isinstance(counters["spm"], TokenizerCounter)
    assert counters["gpt-4o"].fingerprint == "openai:o200k_base"
