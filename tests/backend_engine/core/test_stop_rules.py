from __future__ import annotations

import pytest

from backend_engine.core.request import Request
from backend_engine.core.stop_rules import TokenStop, token_stop
from backend_engine.sampling_params import SamplingParams

EOS = 2
STOP = 9


def request_after(token_id: int, *, max_tokens: int = 4, num_output: int = 1, **params) -> Request:
    request = Request(
        "r", [10, 11, 12], SamplingParams(**params), max_tokens=max_tokens, arrival_seq=0
    )
    request.all_token_ids += [5] * (num_output - 1) + [token_id]
    return request


@pytest.mark.parametrize(
    ("token_id", "kwargs", "expected"),
    [
        (5, {}, None),
        (EOS, {}, TokenStop("stop", on_stop_token=True)),
        (EOS, {"ignore_eos": True}, None),
        (STOP, {"stop_token_ids": [STOP]}, TokenStop("stop", on_stop_token=True)),
        (STOP, {"stop_token_ids": [STOP], "ignore_eos": True}, TokenStop("stop", True)),
        (5, {"num_output": 4}, TokenStop("length", on_stop_token=False)),
        # a stop token that is also the last allowed one stops as "stop", unshown
        (EOS, {"num_output": 4}, TokenStop("stop", on_stop_token=True)),
        (EOS, {"num_output": 4, "ignore_eos": True}, TokenStop("length", on_stop_token=False)),
    ],
)
def test_token_stops(token_id: int, kwargs: dict, expected: TokenStop | None) -> None:
    num_output = kwargs.pop("num_output", 1)
    request = request_after(token_id, num_output=num_output, **kwargs)
    assert token_stop(request, token_id, frozenset({EOS}), max_model_len=100) == expected


def test_the_model_length_ends_a_request_before_max_tokens() -> None:
    request = request_after(5, max_tokens=50, num_output=2)  # 5 tokens in all
    assert token_stop(request, 5, frozenset({EOS}), max_model_len=5) == TokenStop("length", False)
    assert token_stop(request, 5, frozenset({EOS}), max_model_len=6) is None
