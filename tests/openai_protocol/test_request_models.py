"""The request models read what the field rules let through: each prompt of a list, and
``logit_bias`` keyed by token id."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from openai_protocol.request_models import CompletionRequest


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        ("hi", ["hi"]),
        ("", [""]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),  # a token-id list is one prompt
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_each_prompt_of_a_request(prompt: Any, prompts: list[Any]) -> None:
    request = CompletionRequest.model_validate({"model": "m", "prompt": prompt})
    assert request.prompts() == prompts


@pytest.mark.parametrize("prompt", [[], [[]], [[1], []], 5, [1.5]])
def test_empty_or_mistyped_prompts_are_refused(prompt: Any) -> None:
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": prompt})


def test_logit_bias_by_token_id_and_new_fields_default_to_off() -> None:
    request = CompletionRequest.model_validate(
        {"model": "m", "prompt": "p", "logit_bias": {"50256": -100, "7": 2.5}, "echo": True}
    )
    assert request.logit_bias_ids() == {50256: -100.0, 7: 2.5}
    assert request.echo
    plain = CompletionRequest.model_validate({"model": "m", "prompt": "p"})
    assert plain.logit_bias_ids() == {}
    assert (plain.n, plain.presence_penalty, plain.frequency_penalty) == (1, 0.0, 0.0)
    assert plain.repetition_penalty == 1.0
    assert not plain.echo
