"""A small, deterministic text corpus for training the demo BPE tokenizer offline.

Nothing is stored or downloaded: a few embedded snippets (English prose, code, math, a little
non-ASCII text) are recombined with a fixed-seed ``random.Random`` so every call yields the
same documents, on every platform and Python version.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

_PROSE = (
    "The quick brown fox jumps over the lazy dog.",
    "A language model predicts the next token given the tokens before it.",
    "The scheduler decides which requests run in each step of the engine.",
    "Every request carries a prompt, sampling parameters and a budget.",
    "When the cache is full, the engine preempts the youngest request.",
    "She said that the weather would be better tomorrow, but it rained again.",
    "Hello, world! How are you today? I am fine, thank you.",
    "The gateway checks the API key, applies rate limits and forwards the call.",
    "In the morning we walked to the market and bought bread, cheese and apples.",
    "Tokens are streamed back to the client as soon as they are generated.",
    "The user asked a question and the assistant answered politely.",
    "It was the best of times, it was the worst of times.",
    "Please summarize the following document in three sentences.",
    "What is the capital of France? The capital of France is Paris.",
    "They're sure it'll work; we've tested it and I'm confident you'd agree.",
    "Memory is divided into fixed-size blocks that hold keys and values.",
    "The café on the corner serves crème brûlée and a naïve little rosé.",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein, sagte Jürgen.",
    "El niño comió una manzana y después jugó en el jardín.",
    "我们今天学习中文。这是一个简单的句子。你好，世界！",
    "日本語のテキストも少し含まれています。",
    "Emoji test: 🙂 😀 🚀 🎉 ❤️ 👍🏽 — done.",
    "Привет, как дела? Всё хорошо.",
)

_CODE = (
    "def add(a: int, b: int) -> int:\n    return a + b\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "class Request:\n    def __init__(self, prompt: str) -> None:\n        self.prompt = prompt\n",
    'if x is None:\n    raise ValueError("x must not be None")\n',
    "import torch\n\nx = torch.zeros(4, 8)\ny = x @ x.T\n",
    'fn main() {\n    let v: Vec<u32> = (0..10).collect();\n    println!("{:?}", v);\n}\n',
    "const sum = (xs) => xs.reduce((a, b) => a + b, 0);\n",
    "SELECT id, name FROM users WHERE age > 30 ORDER BY name;\n",
    '{"model": "demo", "messages": [{"role": "user", "content": "hi"}]}\n',
    '#include <stdio.h>\nint main(void) { printf("hello\\n"); return 0; }\n',
    "while (left < right) {\n\tmid = (left + right) / 2;\n}\n",
    "    # TODO: handle the empty case\n    return []\n",
)

_MATH = (
    "2 + 2 = 4",
    "3 * 7 = 21",
    "The area of a circle is pi * r^2.",
    "Let x = 12 and y = 345; then x + y = 357.",
    "1/2 + 1/3 = 5/6",
    "e^(i*pi) + 1 = 0",
    "∑ from k=1 to n of k = n(n+1)/2",
    "√2 ≈ 1.41421356",
    "The derivative of x^3 is 3x^2.",
    "If a < b and b < c, then a < c.",
)

_ROLES = ("system", "user", "assistant")
_WORDS = tuple(" ".join(_PROSE[:16]).replace(".", " ").replace(",", " ").split())
_ONSETS = ("", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w")
_ONSETS_2 = ("br", "ch", "cl", "dr", "gr", "pl", "sh", "st", "th", "tr", "str", "sp")
_VOWELS = ("a", "e", "i", "o", "u", "ea", "ou", "io", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "st", "ck", "rt")
_SUFFIXES = ("", "", "", "ing", "ed", "er", "s", "ly", "tion", "ment", "able")


def _pseudo_word(rng: random.Random) -> str:
    syllables = []
    for _ in range(rng.choice((1, 1, 2, 2, 3))):
        onset = rng.choice(_ONSETS_2) if rng.random() < 0.2 else rng.choice(_ONSETS)
        syllables.append(onset + rng.choice(_VOWELS) + rng.choice(_CODAS))
    return "".join(syllables) + rng.choice(_SUFFIXES)


def _identifier(rng: random.Random) -> str:
    parts = [_pseudo_word(rng) for _ in range(rng.randrange(1, 4))]
    if rng.random() < 0.5:
        return "_".join(parts)
    return parts[0] + "".join(p.capitalize() for p in parts[1:])


def _number_line(rng: random.Random) -> str:
    a, b = rng.randrange(10_000), rng.randrange(1_000)
    op = rng.choice("+-*/")
    return f"{a} {op} {b} = ?"


def _word_salad(rng: random.Random) -> str:
    words = [
        rng.choice(_WORDS) if rng.random() < 0.5 else _pseudo_word(rng)
        for _ in range(rng.randrange(4, 16))
    ]
    text = " ".join(words)
    return text[:1].upper() + text[1:] + rng.choice(".!?")


def _document(rng: random.Random) -> str:
    parts: list[str] = []
    for _ in range(rng.randrange(3, 9)):
        kind = rng.randrange(8)
        if kind == 0:
            parts.append(rng.choice(_PROSE))
        elif kind == 1:
            parts.append(rng.choice(_CODE))
        elif kind == 2:
            parts.append(rng.choice(_MATH))
        elif kind == 3:
            parts.append(_number_line(rng))
        elif kind == 4:
            parts.append(_word_salad(rng))
        elif kind in (5, 6):
            name, arg = _identifier(rng), _identifier(rng)
            parts.append(f"def {name}({arg}):\n    return {arg} + {rng.randrange(100)}\n")
        else:
            role = rng.choice(_ROLES)
            parts.append(f"{role}: {rng.choice(_PROSE)}")
    return rng.choice(("\n", " ", "\n\n")).join(parts)


def iter_demo_corpus(num_chars: int = 200_000, seed: int = 0) -> Iterator[str]:
    """Yield documents until about ``num_chars`` characters were produced."""
    rng = random.Random(seed)
    produced = 0
    for text in (*_PROSE, *_CODE, *_MATH):
        produced += len(text)
        yield text
    while produced < num_chars:
        doc = _document(rng)
        produced += len(doc)
        yield doc
