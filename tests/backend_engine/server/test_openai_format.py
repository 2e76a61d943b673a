from __future__ import annotations

from backend_engine.outputs import RequestOutputDelta
from backend_engine.server.openai_format import usage


def last_delta(num_cached_tokens: int | None) -> RequestOutputDelta:
    return RequestOutputDelta("r", [], "", 7, 3, num_cached_tokens, finished=True)


def test_usage_reports_the_cached_tokens() -> None:
    assert usage(last_delta(4)) == {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_usage_says_zero_cached_tokens_while_they_are_unknown() -> None:
    """A request that never reached the prefix cache: the wire format keeps its 0."""
    assert usage(last_delta(None))["prompt_tokens_details"] == {"cached_tokens": 0}
