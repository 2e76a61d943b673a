"""`from_engine_answer`: what a client sees for an engine's error answer (the cases a live
stand-in engine answers are in test_engine_errors.py; these are the odd bodies)."""

from __future__ import annotations

import json

from gateway.errors import MAX_ENGINE_MESSAGE_CHARS, from_engine_answer


def _body(**error: object) -> bytes:
    return json.dumps({"error": error}).encode()


def test_a_code_that_is_not_an_identifier_is_not_passed_on() -> None:
    rejection = from_engine_answer(400, _body(message="Bad.", code="<script>"), "m")
    assert (rejection.status, rejection.code, rejection.message) == (400, "invalid_request", "Bad.")


def test_an_engine_message_and_param_are_bounded() -> None:
    body = _body(message="x" * 100_000, code="invalid_value", param="p" * 100_000)
    rejection = from_engine_answer(400, body, "m")
    assert len(rejection.message) == MAX_ENGINE_MESSAGE_CHARS
    assert rejection.param is not None
    assert len(rejection.param) == MAX_ENGINE_MESSAGE_CHARS
    assert rejection.code == "invalid_value"


def test_a_422_is_the_clients_400() -> None:
    rejection = from_engine_answer(422, _body(message="Bad field.", param="top_k"), "m")
    assert (rejection.status, rejection.type, rejection.param) == (
        400,
        "invalid_request_error",
        "top_k",
    )


def test_a_refused_gateway_credential_is_not_the_clients_401() -> None:
    body = _body(message="Incorrect API key provided: sk-abc***", code="invalid_api_key")
    rejection = from_engine_answer(401, body, "remote")
    assert (rejection.status, rejection.code) == (502, "upstream_error")
    assert "sk-abc" not in rejection.message
    assert "(401 invalid_api_key)" in rejection.message


def test_a_body_that_is_not_json_still_gets_the_gateways_error() -> None:
    for status, expected in [(400, 400), (404, 502), (500, 502), (503, 502)]:
        rejection = from_engine_answer(status, b"<html>oops</html>", "m")
        assert rejection.status == expected
        assert rejection.error_body()["error"]["message"]
