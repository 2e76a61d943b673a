"""The engine server's errors and the gateway's come from one table (`openai_protocol.errors`):
for every entry of the vocabulary, and every status, both build the same error."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from backend_engine.async_engine import EngineError, EngineStopped
from backend_engine.server import errors as engine_errors
from gateway import errors as gateway_errors
from openai_protocol import errors as vocabulary
from openai_protocol.errors import ErrorKind
from openai_protocol.field_rules import FieldError
from openai_protocol.json_body import parse_json_object
from policies.decision import Rejection

KINDS = list(vocabulary.VOCABULARY.values())


def _engine(error: engine_errors.APIError) -> tuple[int, str, str | None]:
    return error.status_code, error.error_type, error.code


def _gateway(rejection: Rejection) -> tuple[int, str, str | None]:
    return rejection.status, rejection.type, rejection.code


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.code)
def test_both_servers_build_the_same_error_of_each_kind(kind: ErrorKind) -> None:
    engine = engine_errors.APIError.of(kind, "Something is wrong.", param="model")
    gateway = Rejection.of(kind, "Something is wrong.", "model")
    assert _engine(engine) == _gateway(gateway) == (kind.status, kind.type, kind.code)
    assert engine.body() == gateway.error_body()


@pytest.mark.parametrize("status", [*vocabulary.TYPE_BY_STATUS, 500, 502, 503])
def test_both_servers_type_a_routing_error_alike(status: int) -> None:
    engine = engine_errors.to_api_error(HTTPException(status))
    gateway = gateway_errors.to_rejection(HTTPException(status))
    assert _engine(engine) == _gateway(gateway)
    assert engine.error_type == vocabulary.type_for(status)


def _validation_error(body: bytes) -> ValidationError:
    class Model(BaseModel):
        n: int

    try:
        Model.model_validate_json(body)
    except ValidationError as exc:
        return exc
    raise AssertionError("no error")


def _json_error() -> FieldError:
    try:
        parse_json_object(b"[1")
    except FieldError as exc:
        return exc
    raise AssertionError("no error")


# Every error the engine's server builds, and the vocabulary entry it must be.
ENGINE_ERRORS = [
    (engine_errors.invalid_request("Bad.", param="n"), vocabulary.INVALID_REQUEST),
    (
        engine_errors.context_length_exceeded("Long.", param="messages"),
        vocabulary.CONTEXT_LENGTH_EXCEEDED,
    ),
    (engine_errors.from_field_error(_json_error()), vocabulary.INVALID_JSON),
    (engine_errors.to_api_error(_validation_error(b"{")), vocabulary.INVALID_JSON),
    (engine_errors.model_not_found("gpt-17"), vocabulary.MODEL_NOT_FOUND),
    (engine_errors.body_too_large(10), vocabulary.REQUEST_TOO_LARGE),
    (engine_errors.unsupported_encoding("br"), vocabulary.UNSUPPORTED_CONTENT_ENCODING),
    (engine_errors.to_api_error(_validation_error(b'{"n": "x"}')), vocabulary.INVALID_REQUEST),
    (engine_errors.to_api_error(EngineError("failed")), vocabulary.ENGINE_ERROR),
    (engine_errors.engine_not_ready(), vocabulary.ENGINE_NOT_READY),
    (engine_errors.engine_draining(), vocabulary.ENGINE_DRAINING),
    (engine_errors.to_api_error(EngineStopped("stopped")), vocabulary.ENGINE_DRAINING),
    (engine_errors.to_api_error(RuntimeError("bug")), vocabulary.INTERNAL_ERROR),
]

# Every error the gateway's errors module builds, and its entry.
GATEWAY_ERRORS = [
    (gateway_errors.invalid_request("Bad.", "n").rejection, vocabulary.INVALID_REQUEST),
    (  # how the gateway refuses a body parse_json_object refused
        gateway_errors.invalid_request("Bad.", code=_json_error().code).rejection,
        vocabulary.INVALID_JSON,
    ),
    (gateway_errors.invalid_api_key().rejection, vocabulary.INVALID_API_KEY),
    (gateway_errors.body_too_large(10).rejection, vocabulary.REQUEST_TOO_LARGE),
    (gateway_errors.unsupported_encoding("br").rejection, vocabulary.UNSUPPORTED_CONTENT_ENCODING),
    (gateway_errors.upstream_unavailable("m").rejection, vocabulary.UPSTREAM_UNAVAILABLE),
    (gateway_errors.state_unavailable("Redis").rejection, vocabulary.SERVICE_UNAVAILABLE),
    (gateway_errors.change_not_announced().rejection, vocabulary.SERVICE_UNAVAILABLE),
    (gateway_errors.to_rejection(RuntimeError("bug")), vocabulary.INTERNAL_ERROR),
    (gateway_errors.from_engine_answer(500, b"", "m"), vocabulary.UPSTREAM_ERROR),
    (gateway_errors.usage_records_unavailable().rejection, vocabulary.USAGE_RECORDS_UNAVAILABLE),
    (gateway_errors.SHUTTING_DOWN, vocabulary.SERVER_SHUTTING_DOWN),
    (gateway_errors.SHUTTING_DOWN_MID_STREAM, vocabulary.SERVER_SHUTTING_DOWN),
]


@pytest.mark.parametrize(("error", "kind"), ENGINE_ERRORS, ids=lambda v: getattr(v, "code", ""))
def test_every_engine_error_is_a_vocabulary_entry(
    error: engine_errors.APIError, kind: ErrorKind
) -> None:
    assert _engine(error) == (kind.status, kind.type, kind.code)


@pytest.mark.parametrize(
    ("rejection", "kind"), GATEWAY_ERRORS, ids=lambda v: getattr(v, "code", "")
)
def test_every_gateway_error_is_a_vocabulary_entry(rejection: Rejection, kind: ErrorKind) -> None:
    assert _gateway(rejection) == (kind.status, kind.type, kind.code)


def test_every_vocabulary_entry_is_used_by_a_server() -> None:
    used = {kind.code for _, kind in [*ENGINE_ERRORS, *GATEWAY_ERRORS]}
    assert used == set(vocabulary.VOCABULARY)


def test_a_field_error_is_a_400_of_its_code_on_both_sides() -> None:
    exc = FieldError("Invalid 'seed'.", "seed", "integer_above_max_value")
    engine = engine_errors.from_field_error(exc)
    gateway = gateway_errors.invalid_request(exc.message, exc.param, code=exc.code).rejection
    assert _engine(engine) == _gateway(gateway) == (400, "invalid_request_error", exc.code)
    assert engine.body() == gateway.error_body()
