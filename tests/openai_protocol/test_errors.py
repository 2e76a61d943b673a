"""The error vocabulary is consistent in itself: each code's type follows from its status."""

from __future__ import annotations

import pytest

from openai_protocol import errors as vocabulary


@pytest.mark.parametrize("kind", list(vocabulary.VOCABULARY.values()), ids=str)
def test_each_kind_has_the_type_of_its_status(kind: vocabulary.ErrorKind) -> None:
    assert vocabulary.VOCABULARY[kind.code] is kind
    assert kind.type in vocabulary.ERROR_TYPES
    if kind is vocabulary.MODEL_NOT_FOUND:  # OpenAI's 404 invalid_request_error
        assert kind.type == vocabulary.INVALID_REQUEST_ERROR
    else:
        assert kind.type == vocabulary.type_for(kind.status)
    assert 400 <= kind.status <= 599


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (400, "invalid_request_error"),
        (401, "invalid_request_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (418, "invalid_request_error"),  # an unlisted 4xx
        (429, "rate_limit_error"),
        (500, "server_error"),
        (502, "server_error"),
        (503, "server_error"),
        (599, "server_error"),
    ],
)
def test_type_for_status(status: int, expected: str) -> None:
    assert vocabulary.type_for(status) == expected


def test_error_body_has_openais_shape() -> None:
    body = vocabulary.error_body("No such model.", "not_found_error", "model_not_found", "model")
    assert body == {
        "error": {
            "message": "No such model.",
            "type": "not_found_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


def test_routing_errors_are_named_by_status() -> None:
    kind = vocabulary.http_error_kind(405)
    assert (kind.code, kind.status, kind.type) == ("http_405", 405, "invalid_request_error")


def test_model_not_found_is_in_openais_words() -> None:
    kind = vocabulary.MODEL_NOT_FOUND
    assert (kind.status, kind.type, kind.code) == (404, "invalid_request_error", "model_not_found")
    assert vocabulary.model_not_found_message("gpt-9") == (
        "The model `gpt-9` does not exist or you do not have access to it."
    )


def test_an_unknown_model_is_echoed_as_a_bounded_prefix() -> None:
    message = vocabulary.model_not_found_message("m" * 10_000)
    assert f"`{'m' * vocabulary.MAX_ECHOED_ID_CHARS}...`" in message
    assert len(message) < vocabulary.MAX_ECHOED_ID_CHARS + 100
    assert vocabulary.echoed_id("m" * vocabulary.MAX_ECHOED_ID_CHARS) == "m" * 64
