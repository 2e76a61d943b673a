from __future__ import annotations

import pytest

from backend_engine.structured_output.regex_size import MAX_EXPANDED_SIZE, check_regex_size


@pytest.mark.parametrize(
    "pattern",
    [r"[0-9]{3}-[a-z]+", "(a|b)*a(a|b){1000}", "[a-z]{1,100000}", "(x{1000}){100}", r"\p{L}+"],
)
def test_patterns_llguidance_serves_pass(pattern: str) -> None:
    check_regex_size(pattern)


@pytest.mark.parametrize(
    ("pattern", "size"),
    [
        ("((a{100}){100}){100}", "1,000,000"),
        ("(x{1000}){1000}", "1,000,000"),
        ("(a|(b{400}){400})", "160,000"),
    ],
)
def test_nested_counted_repetition_past_the_bound_is_refused(pattern: str, size: str) -> None:
    with pytest.raises(ValueError, match=f"expand to {size} copies") as caught:
        check_regex_size(pattern)
    assert f"{MAX_EXPANDED_SIZE:,}" in str(caught.value)
