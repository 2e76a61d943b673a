"""Routing an alias (``auto``...) to the small or the large model of its pair.

`route` applies the first rule that matches, in this order, and names it in
`RoutingDecision.reason` (the gateway returns it in a header and keeps it in the
usage record):

    hint             the request asked for "small" or "large" (if the policy honours hints)
    long_prompt      prompt_tokens >= long_prompt_tokens            -> large
    long_output      max_tokens >= long_output_tokens               -> large
    many_turns       num_turns >= many_turns                        -> large
    code / math      code or math in the prompt (if enabled)        -> large
    tier             the tenant's tier is in large_tiers            -> large
    default_small    nothing above matched                          -> small

A threshold of None turns its rule off. If the choice is large, the large pool is
saturated (more than ``max_queue_depth`` requests waiting, or KV use above
``max_kv_usage``) and the tenant allows it, the request goes to the small model
instead with reason ``large_saturated_fallback``.

The rules do not know the models' context windows. `fit_context` takes the decision and
whether the prompt fits the chosen model and the other one of the pair: a prompt only the
other model's window holds goes there, with reason ``context_fallback`` (a long prompt's rule
must not send it to a large model with the smaller window, when the small one would take it).
When neither holds it the decision stands, and the prompt-length rule refuses it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

ModelSize = Literal["small", "large"]


@dataclass(frozen=True)
class RequestFeatures:
    prompt_tokens: int
    max_tokens: int
    num_turns: int
    has_code: bool
    has_math: bool
    tenant_tier: str
    hint: ModelSize | None = None


@dataclass(frozen=True)
class ModelPair:
    small: str
    large: str


@dataclass(frozen=True)
class PoolLoad:
    """The large pool's load, read from the engines' ``/metrics``."""

    num_waiting: int
    kv_usage: float  # fraction of KV blocks in use, 0.0 to 1.0

    def __post_init__(self) -> None:
        if self.num_waiting < 0:
            raise ValueError(f"num_waiting must be non-negative, got {self.num_waiting}")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"kv_usage is a fraction between 0 and 1, got {self.kv_usage}")


@dataclass(frozen=True)
class RoutingPolicy:
    aliases: Mapping[str, ModelPair]
    long_prompt_tokens: int | None = 4096
    long_output_tokens: int | None = 2048
    many_turns: int | None = 12
    code_to_large: bool = True
    math_to_large: bool = True
    large_tiers: frozenset[str] = frozenset()
    honor_hint: bool = True
    max_queue_depth: int | None = 32
    max_kv_usage: float | None = 0.95

    def __post_init__(self) -> None:
        if not self.aliases:
            raise ValueError("routing needs at least one alias, e.g. {'auto': ModelPair(...)}")
        for name in ("long_prompt_tokens", "long_output_tokens", "many_turns"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1 or None (rule off), got {value}")
        if self.max_queue_depth is not None and self.max_queue_depth < 0:
            raise ValueError(f"max_queue_depth must be non-negative, got {self.max_queue_depth}")
        if self.max_kv_usage is not None and not 0.0 <= self.max_kv_usage <= 1.0:
            raise ValueError(f"max_kv_usage is a fraction between 0 and 1, got {self.max_kv_usage}")
        object.__setattr__(self, "aliases", MappingProxyType(dict(self.aliases)))

    def is_saturated(self, load: PoolLoad | None) -> bool:
        """True if the load is above either threshold; an unknown load is not saturated."""
        if load is None:
            return False
        return (self.max_queue_depth is not None and load.num_waiting > self.max_queue_depth) or (
            self.max_kv_usage is not None and load.kv_usage > self.max_kv_usage
        )


@dataclass(frozen=True)
class RoutingDecision:
    model: str
    size: ModelSize
    reason: str


def route(
    alias: str,
    features: RequestFeatures,
    policy: RoutingPolicy,
    large_load: PoolLoad | None,
    allow_fallback: bool,
) -> RoutingDecision:
    """Pick the model for ``alias`` (one of ``policy.aliases``)."""
    pair = policy.aliases.get(alias)
    if pair is None:
        raise ValueError(f"{alias!r} is not a routing alias; known: {sorted(policy.aliases)}")
    size, reason = _preferred_size(features, policy)
    if size == "large" and allow_fallback and policy.is_saturated(large_load):
        size, reason = "small", "large_saturated_fallback"
    return RoutingDecision(pair.small if size == "small" else pair.large, size, reason)


def fit_context(
    decision: RoutingDecision, pair: ModelPair, *, chosen_fits: bool, other_fits: bool
) -> RoutingDecision:
    """``decision``, or the pair's other model when only its context window holds the prompt."""
    if chosen_fits or not other_fits:
        return decision
    size: ModelSize = "small" if decision.size == "large" else "large"
    return RoutingDecision(pair.small if size == "small" else pair.large, size, "context_fallback")


def _preferred_size(features: RequestFeatures, policy: RoutingPolicy) -> tuple[ModelSize, str]:
    if policy.honor_hint and features.hint is not None:
        return features.hint, "hint"
    rules: list[tuple[bool, str]] = [
        (_at_least(features.prompt_tokens, policy.long_prompt_tokens), "long_prompt"),
        (_at_least(features.max_tokens, policy.long_output_tokens), "long_output"),
        (_at_least(features.num_turns, policy.many_turns), "many_turns"),
        (policy.code_to_large and features.has_code, "code"),
        (policy.math_to_large and features.has_math, "math"),
        (features.tenant_tier in policy.large_tiers, "tier"),
    ]
    for matched, reason in rules:
        if matched:
            return "large", reason
    return "small", "default_small"


def _at_least(value: int, threshold: int | None) -> bool:
    return threshold is not None and value >= threshold


# Every pattern runs in time linear in its input: a match can only start where its first
# token starts (a word, a line, a keyword, a "$"), whitespace before a line's end never
# crosses it ([^\S\n] rather than \s), and no quantified part can match the same text two
# ways. Python's re backtracks, so a pattern such as r"\w+\(" would otherwise be tried from
# every letter of a long word (quadratic: 16k characters took seconds). Each rewrite matches
# the same texts as the plain form in its comment.
_CODE_PATTERNS = [
    re.compile(r"```"),
    # Python def / class: ^\s*(def|class)\s+\w+\s*[(:].*:\s*$
    re.compile(r"^[^\S\n]*(def|class)\s+\w+\s*[(:].*:[^\S\n]*$", re.MULTILINE),
    # ^\s*(from\s+[\w.]+\s+)?import\s+[\w.]+(\s+as\s+\w+)?\s*;?\s*$
    re.compile(
        r"^[^\S\n]*(from\s+[\w.]+\s+)?import\s+[\w.]+(\s+as\s+\w+)?[^\S\n]*;?[^\S\n]*$",
        re.MULTILINE,
    ),
    re.compile(r"\b(function|func|fn)\s+\w+\s*\("),  # JS, Go, Rust
    re.compile(r"^[^\S\n]*#include\s*[<\"]", re.MULTILINE),
    re.compile(r"\b(const|let|var)\s+\w+\s*=[^=]"),
    re.compile(r"\b\w+\([^()\n]*\)\s*(\{|=>)"),  # C-like body or arrow function
    # SQL, upper case: \b(SELECT|UPDATE|DELETE)\b[^\n]*\b(FROM|SET|WHERE)\b. The lookahead
    # finds a line's first verb once and is never re-entered (the atomic group of 3.10's re).
    re.compile(
        r"^(?=([^\n]*?\b(SELECT|UPDATE|DELETE)\b))\1[^\n]*\b(FROM|SET|WHERE)\b", re.MULTILINE
    ),
    # A call ending in ';': \w+(\.\w+)*\([^()\n]*\);\s*$ (a match of the dotted name's
    # last part is a match of the whole)
    re.compile(r"\b\w+\([^()\n]*\);[^\S\n]*$", re.MULTILINE),
]
_OPERAND = r"(\d+(\.\d+)?[a-zA-Z]?|[a-zA-Z])"  # 2, 1.5, 3x, x
# Math: LaTeX commands or environments, $...$ holding math symbols, Unicode math,
# arithmetic equations, powers, or words that name math problems.
_MATH_PATTERNS = [
    re.compile(
        r"\\(frac|sqrt|sum|int|prod|lim|infty|cdot|times|leq|geq|neq|alpha|beta|theta|pi"
        r"|partial|mathbb|begin\{(equation|align))"
    ),
    # \$\$[^$]+\$\$|\$[^$\n]*[\\^_=][^$\n]*\$: the span up to the first symbol is taken once
    re.compile(r"\$\$[^$]+\$\$|\$[^$\n\\^_=]*[\\^_=][^$\n]*\$"),
    re.compile(r"[∑∫√∞≤≥≠±∂π]"),
    re.compile(rf"\b{_OPERAND}\s*[-+*/×÷]\s*{_OPERAND}\b\s*=(?!=)"),  # 2 + 2 =, 3x - 1 = y
    re.compile(r"\b[a-zA-Z0-9]\^\d"),  # x^2
    re.compile(
        r"\b(integral|derivative|equation|theorem|polynomial|solve for|prove that)\b",
        re.IGNORECASE,
    ),
]
# The heuristics read at most this many characters at each end of a prompt: work per request
# stays bounded whatever its size (the question, or a pasted snippet, is usually at one end;
# a prompt long enough to hide code in its middle is usually routed by long_prompt first).
ROUTING_WINDOW_CHARS = 8192


def detect_code_or_math(
    text: str, window_chars: int | None = ROUTING_WINDOW_CHARS
) -> tuple[bool, bool]:
    """``(has_code, has_math)`` for a prompt, by the cheap heuristics listed above.

    Tuned to miss rather than to over-trigger on prose: a word like "class" or
    "import" alone is not code, and a price like "$5 or $10" is not math. Reads the first
    and the last ``window_chars`` characters (``None``: all of them), in time linear in what
    it reads.
    """
    if window_chars is not None and len(text) > 2 * window_chars:
        parts = [text[:window_chars], text[-window_chars:]]
    else:
        parts = [text]
    has_code = any(p.search(part) for p in _CODE_PATTERNS for part in parts)
    has_math = any(p.search(part) for p in _MATH_PATTERNS for part in parts)
    return has_code, has_math
