import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.model_routing import (
    ROUTING_WINDOW_CHARS,
    ModelPair,
    PoolLoad,
    RequestFeatures,
    RoutingPolicy,
    detect_code_or_math,
    route,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

POLICY = RoutingPolicy(
    aliases={"auto": ModelPair("small-1b", "large-8b"), "fast": ModelPair("tiny", "small-1b")},
    long_prompt_tokens=4000,
    long_output_tokens=2000,
    many_turns=10,
    large_tiers=frozenset({"enterprise"}),
    max_queue_depth=32,
    max_kv_usage=0.9,
)
PLAIN = RequestFeatures(
    prompt_tokens=100,
    max_tokens=256,
    num_turns=1,
    has_code=False,
    has_math=False,
    tenant_tier="standard",
)
IDLE = PoolLoad(num_waiting=0, kv_usage=0.1)


def decide(features=PLAIN, policy=POLICY, load=IDLE, allow_fallback=False, alias="auto"):
    d = route(alias, features, policy, load, allow_fallback)
    return d.model, d.size, d.reason


def test_default_small():
    assert decide() == ("small-1b", "small", "default_small")


def test_alias_picks_its_pair():
    assert decide(replace(PLAIN, has_code=True), alias="fast") == ("small-1b", "large", "code")


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"prompt_tokens": 4000}, "long_prompt"),
        ({"max_tokens": 2000}, "long_output"),
        ({"num_turns": 10}, "many_turns"),
        ({"has_code": True}, "code"),
        ({"has_math": True}, "math"),
        ({"tenant_tier": "enterprise"}, "tier"),
    ],
)
def test_each_feature_at_its_threshold_goes_large(change, reason):
    assert decide(replace(PLAIN, **change)) == ("large-8b", "large", reason)


@pytest.mark.parametrize(
    "change", [{"prompt_tokens": 3999}, {"max_tokens": 1999}, {"num_turns": 9}]
)
def test_one_below_threshold_stays_small(change):
    assert decide(replace(PLAIN, **change))[2] == "default_small"


def test_first_matching_rule_names_the_reason():
    both = replace(PLAIN, prompt_tokens=5000, has_code=True, has_math=True)
    assert decide(both)[2] == "long_prompt"
    assert decide(replace(PLAIN, has_code=True, has_math=True))[2] == "code"


def test_hint_wins_both_ways():
    small_hint = replace(PLAIN, prompt_tokens=9000, hint="small")
    assert decide(small_hint) == ("small-1b", "small", "hint")
    assert decide(replace(PLAIN, hint="large")) == ("large-8b", "large", "hint")


def test_hint_ignored_when_policy_says_so():
    policy = replace(POLICY, honor_hint=False)
    assert decide(replace(PLAIN, hint="large"), policy=policy)[2] == "default_small"


def test_disabled_rules():
    policy = replace(POLICY, long_prompt_tokens=None, code_to_large=False, math_to_large=False)
    f = replace(PLAIN, prompt_tokens=10**6, has_code=True, has_math=True)
    assert decide(f, policy=policy)[2] == "default_small"


SATURATED_QUEUE = PoolLoad(num_waiting=33, kv_usage=0.1)
SATURATED_KV = PoolLoad(num_waiting=0, kv_usage=0.91)


@pytest.mark.parametrize("load", [SATURATED_QUEUE, SATURATED_KV])
def test_fallback_when_saturated_and_allowed(load):
    f = replace(PLAIN, has_code=True)
    assert decide(f, load=load, allow_fallback=True) == (
        "small-1b",
        "small",
        "large_saturated_fallback",
    )


def test_no_fallback_when_not_allowed():
    f = replace(PLAIN, has_code=True)
    assert decide(f, load=SATURATED_QUEUE, allow_fallback=False) == ("large-8b", "large", "code")


def test_no_fallback_at_exactly_the_thresholds():
    f = replace(PLAIN, has_code=True)
    at_limit = PoolLoad(num_waiting=32, kv_usage=0.9)
    assert decide(f, load=at_limit, allow_fallback=True)[2] == "code"


def test_no_fallback_for_unknown_load_or_small_choice():
    f = replace(PLAIN, has_code=True)
    assert decide(f, load=None, allow_fallback=True)[2] == "code"
    assert decide(load=SATURATED_QUEUE, allow_fallback=True)[2] == "default_small"


def test_hinted_large_also_falls_back():
    f = replace(PLAIN, hint="large")
    assert decide(f, load=SATURATED_KV, allow_fallback=True)[2] == "large_saturated_fallback"


def test_unknown_alias():
    with pytest.raises(ValueError, match="'gpt-4' is not a routing alias"):
        route("gpt-4", PLAIN, POLICY, IDLE, False)


def test_policy_validation():
    with pytest.raises(ValueError, match="at least one alias"):
        RoutingPolicy(aliases={})
    with pytest.raises(ValueError, match="long_prompt_tokens must be at least 1"):
        replace(POLICY, long_prompt_tokens=0)
    with pytest.raises(ValueError, match="max_kv_usage"):
        replace(POLICY, max_kv_usage=1.5)
    with pytest.raises(ValueError, match="kv_usage"):
        PoolLoad(num_waiting=0, kv_usage=-0.1)


@pytest.mark.parametrize(
    "text",
    [
        "Fix this:\n```\nx = 1\n```",
        "def parse(line):\n    return line.split()",
        "import numpy as np",
        "from collections import deque",
        "#include <stdio.h>",
        "function add(a, b) { return a + b }",
        "const total = items.length",
        "SELECT name FROM users WHERE id = 3",
        "console.log(value);",
        "int main(void) {",
    ],
)
def test_detects_code(text):
    assert detect_code_or_math(text)[0] is True


@pytest.mark.parametrize(
    "text",
    [
        r"Compute \frac{1}{2} + \sqrt{2}",
        "What is $x^2 + y^2$?",
        "$$E = mc^2$$",
        "Solve 3x + 2 = 11",
        "2 + 2 = ?",
        "Is x^2 always positive?",
        "∫ sin(x) dx",
        "Find the derivative of sin(x)",
        "Prove that there are infinitely many primes.",
    ],
)
def test_detects_math(text):
    assert detect_code_or_math(text)[1] is True


@pytest.mark.parametrize(
    "text",
    [
        "Tell me about the class system in Victorian England.",
        "What should I import from Italy? It costs $5 or $10.",
        "Write a friendly email to my team about Friday's lunch.",
        "Summarize the plot of Hamlet in three sentences; keep it short.",
        "Return the book to the library by Monday.",
        "My well-being = happiness, they say.",
    ],
)
def test_prose_is_neither(text):
    assert detect_code_or_math(text) == (False, False)


def test_comparison_is_not_an_equation():
    assert detect_code_or_math("if a + b == c: stop")[1] is False


# The heuristics in their plain (backtracking) form, as first written: the linear rewrites in
# policies/model_routing.py must decide every text the same way.
_OPERAND = r"(\d+(\.\d+)?[a-zA-Z]?|[a-zA-Z])"
PLAIN_CODE = [
    r"```",
    r"(?m)^\s*(def|class)\s+\w+\s*[(:].*:\s*$",
    r"(?m)^\s*(from\s+[\w.]+\s+)?import\s+[\w.]+(\s+as\s+\w+)?\s*;?\s*$",
    r"\b(function|func|fn)\s+\w+\s*\(",
    r"(?m)^\s*#include\s*[<\"]",
    r"\b(const|let|var)\s+\w+\s*=[^=]",
    r"\w+\([^()\n]*\)\s*(\{|=>)",
    r"\b(SELECT|UPDATE|DELETE)\b[^\n]*\b(FROM|SET|WHERE)\b",
    r"(?m)\w+(\.\w+)*\([^()\n]*\);\s*$",
]
PLAIN_MATH = [
    r"\\(frac|sqrt|sum|int|prod|lim|infty|cdot|times|leq|geq|neq|alpha|beta|theta|pi"
    r"|partial|mathbb|begin\{(equation|align))",
    r"\$\$[^$]+\$\$|\$[^$\n]*[\\^_=][^$\n]*\$",
    r"[∑∫√∞≤≥≠±∂π]",
    rf"\b{_OPERAND}\s*[-+*/×÷]\s*{_OPERAND}\b\s*=(?!=)",
    r"\b[a-zA-Z0-9]\^\d",
    r"(?i)\b(integral|derivative|equation|theorem|polynomial|solve for|prove that)\b",
]

# Short texts drawn from the characters and words the patterns care about.
_PIECES = st.sampled_from(
    [" ", "\n", "\t", "\r", "\u00a0", "(", ")", ";", ":", "{", "}", "=>", "=", "==", "$", "$$",
     "\\", "^", "_", ".", "+", "-", "*", "/", "×", "<", '"', "#include", "```", "a", "x", "1",
     "2.5", "3x", "def", "class", "import", "from", "as", "fn", "func", "function", "const",
     "let", "var", "SELECT", "FROM", "UPDATE", "SET", "DELETE", "WHERE", "\\frac", "∫",
     "solve for", "Theorem", "é", "中"]
)  # fmt: skip
_TEXTS = st.lists(_PIECES, max_size=24).map("".join) | st.text(max_size=60)


@settings(max_examples=600, deadline=None)
@given(_TEXTS)
def test_linear_patterns_decide_as_the_plain_ones(text):
    expected = (
        any(re.search(p, text) for p in PLAIN_CODE),
        any(re.search(p, text) for p in PLAIN_MATH),
    )
    assert detect_code_or_math(text) == expected


# One long word, long runs of what a pattern loops on, or many starts that each fail late:
# the plain forms take seconds on 16 k characters of these and hours on 1 MiB.
ADVERSARIAL = {
    "word": "a",
    "digits": "1",
    "newlines": "\n",
    "spaces": " ",
    "dotted": "a.",
    "calls": "a(",
    "equals": "=",
    "selects": "SELECT ",
    "keywords": "def fn const ",
    "sums": "1 + ",
    "semicolons": ");\n ",
}
_TIME_ONE_MIB = """
import sys, time
from policies.model_routing import detect_code_or_math
text = ("$" + sys.argv[1] * (1 << 20))[: 1 << 20]  # "$": where the $...$ pattern starts
started = time.perf_counter()
if sys.argv[2] == "default":
    detect_code_or_math(text)
else:
    detect_code_or_math(text, window_chars=None)
print(time.perf_counter() - started)
"""


def _seconds_for_one_mib(unit: str, window: str) -> float:
    """Time one call on 1 MiB in a child process: a quadratic scan could not be stopped here."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _TIME_ONE_MIB, unit, window],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO_ROOT,
            check=True,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"detect_code_or_math ran over 60 s on 1 MiB of {unit!r}")
    return float(done.stdout)


@pytest.mark.parametrize("unit", ADVERSARIAL.values(), ids=ADVERSARIAL.keys())
def test_every_pattern_is_linear_in_the_whole_text(unit):
    # Linear: about a second for all fifteen patterns on a busy machine (quadratic: hours).
    assert _seconds_for_one_mib(unit, "whole") < 10.0


@pytest.mark.parametrize("unit", ["a", "\n", "a."], ids=["word", "newlines", "dotted"])
def test_a_one_mib_prompt_reads_only_its_ends(unit):
    assert _seconds_for_one_mib(unit, "default") < 1.0


def test_the_window_reads_both_ends_of_a_long_prompt():
    prose = "All work and no play makes Jack a dull boy. " * 1000
    assert len(prose) > 2 * ROUTING_WINDOW_CHARS
    assert detect_code_or_math("import numpy as np\n" + prose) == (True, False)
    assert detect_code_or_math(prose + "\nSolve 3x + 2 = 11") == (False, True)
    # the middle of a long prompt is not read (long_prompt usually routes such a prompt)
    half = len(prose) // 2
    assert detect_code_or_math(prose[:half] + "\nimport numpy\n" + prose[half:]) == (False, False)
    assert detect_code_or_math(prose[:half] + "\nimport numpy\n" + prose[half:], None)[0]


def test_fit_context_moves_a_decision_only_to_a_model_that_holds_the_prompt() -> None:
    from policies.model_routing import ModelPair, RoutingDecision, fit_context

    pair = ModelPair("s", "l")
    large = RoutingDecision("l", "large", "long_prompt")
    assert fit_context(large, pair, chosen_fits=True, other_fits=True) == large
    assert fit_context(large, pair, chosen_fits=False, other_fits=False) == large
    assert fit_context(large, pair, chosen_fits=False, other_fits=True) == RoutingDecision(
        "s", "small", "context_fallback"
    )
    small = RoutingDecision("s", "small", "default_small")
    assert fit_context(small, pair, chosen_fits=False, other_fits=True) == RoutingDecision(
        "l", "large", "context_fallback"
    )
