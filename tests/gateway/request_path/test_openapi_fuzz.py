"""Generated requests against ``/openapi.json``: no input is a server error, and every answer
matches the document (status codes, content types, bodies).

schemathesis derives requests from the document (valid ones, and ones that break it) for
every operation: the completion endpoints, the tenant API and the admin API, on the real
app in process, with two tiny engines behind it. The run is deterministic (derandomized)
and bounded: ``MAX_EXAMPLES`` per operation. Completions are clamped to a few tokens by the
tenant's quota, so the engines answer fast.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import negative_data_rejection, positive_data_acceptance
from schemathesis.core.failures import FailureGroup
from schemathesis.generation.modes import GenerationMode
from schemathesis.python.asgi import shutdown_lifespans
from schemathesis.schemas import APIOperation
from schemathesis.specs.openapi.schemas import OpenApiSchema

from gateway.app import build_gateway
from gateway.storage.api_keys import hash_key
from tests.gateway.request_path.conftest import Engines, settings_for
from tests.support.stand_in_stack import tenant_key

MAX_EXAMPLES = 60
ADMIN_KEY = "admin-" + "f" * 40
TENANT_ID = "fuzzed-tenant-with-an-unlikely-name"
# The tenant's quota keeps answers short: the engines are real and run on the CPU.
QUOTA = {"max_output_tokens": 4, "clamp_max_output": True}


@pytest.fixture(scope="module")
def tenant_key_for_fuzzing(
    migrated_sqlite: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, str]:
    """(database URL, API key) of a database shared by the module's generated requests."""
    path = tmp_path_factory.mktemp("fuzz") / "tollway.db"
    shutil.copyfile(migrated_sqlite, path)
    url = f"sqlite:///{path}"
    return url, tenant_key(url, TENANT_ID, **QUOTA)[1]


@pytest.fixture(scope="module")
def fuzzed_api(
    engines: Engines,
    tenant_key_for_fuzzing: tuple[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[OpenApiSchema]:
    db_url, _ = tenant_key_for_fuzzing
    data_dir = tmp_path_factory.mktemp("fuzz-gw")
    app = build_gateway(settings_for(engines, data_dir, db_url, admin_key_hash=hash_key(ADMIN_KEY)))
    yield schemathesis.openapi.from_asgi("/openapi.json", app)
    shutdown_lifespans()  # the gateway's lifespan: flush usage, close clients


@pytest.fixture
def subnormal_floats() -> Iterator[None]:
    """Hypothesis refuses to generate floats on a thread that flushes subnormals to zero, and
    an engine built in this process by an earlier test (``cpu_runtime``) turns that on for
    its thread: turn it off for this test, and back on after."""
    torch = sys.modules.get("torch")
    was_flushing = torch is not None and not 2.2250738585072014e-308 / 4 > 0
    if was_flushing:
        torch.set_flush_denormal(False)
    yield
    if was_flushing:
        torch.set_flush_denormal(True)


def assert_no_error_event(content: bytes) -> None:
    """A stream that failed after its 200 is a server error too: its error is an event."""
    for line in content.splitlines():
        if line.startswith(b"data: {") and b'"error"' in line[:16]:
            raise AssertionError(f"a streamed answer failed: {line[:300]!r}")


def rules_beyond_the_schema(case: schemathesis.Case) -> list[str]:
    """The documented rules a request breaks that JSON Schema cannot state (across fields, or
    against the clock). Such a request may get a 400 though the document allows it, so the
    "schema-valid data is accepted" check is left out for it; every other check still runs."""
    body = case.body if isinstance(case.body, dict) else {}
    query = case.query or {}
    broken = []
    if case.path in ("/v1/chat/completions", "/v1/completions"):
        # The engine's own request models and the rules across fields: a user message needs
        # content, top_logprobs needs logprobs, stream_options needs stream, n times the
        # prompts at most 128, a token id within the model's vocabulary.
        broken.append("engine request rules")
    if "start" in query and "end" in query:
        broken.append("start must not be after end")
    if "period" in query and ("start" in query or "end" in query):
        broken.append("either period or start/end")
    if "cursor" in query and case.path.endswith("/keys"):
        broken.append("a key cursor names one of the tenant's keys")
    if body.get("expires_at") is not None:
        broken.append("expires_at must be in the future, in years 1-9999 in UTC")
    quota = body.get("quota") if isinstance(body.get("quota"), dict) else body
    if quota.get("default_max_output_tokens") and quota.get("max_output_tokens"):
        broken.append("default_max_output_tokens <= max_output_tokens")
    thresholds = quota.get("alert_thresholds")
    if isinstance(thresholds, list) and thresholds != sorted(thresholds):
        broken.append("alert_thresholds ascending")
    return broken


def test_generated_requests_get_no_5xx_and_match_the_document(
    fuzzed_api: OpenApiSchema, tenant_key_for_fuzzing: tuple[str, str], subnormal_floats: None
) -> None:
    _, api_key = tenant_key_for_fuzzing
    failures: dict[str, str] = {}
    labels = []
    for result in fuzzed_api.get_all_operations():
        operation = result.ok()
        labels.append(operation.label)
        key = ADMIN_KEY if operation.path.startswith("/admin/") else api_key
        failure = fuzz(operation, key)
        if failure is not None:
            failures[operation.label] = failure
    assert len(labels) == 26, labels
    assert not failures, "\n\n".join(f"{label}:\n{error}" for label, error in failures.items())


def fuzz(operation: APIOperation, key: str) -> str | None:
    """``MAX_EXAMPLES`` generated requests to one operation: the first failure, or None."""

    modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)

    @given(case=st.one_of(*(operation.as_strategy(mode) for mode in modes)))
    @settings(
        max_examples=MAX_EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],  # no shrinking: report, don't minimise
    )
    def check(case: schemathesis.Case) -> None:
        excluded = [positive_data_acceptance] if rules_beyond_the_schema(case) else []
        if any(value == [] for value in (case.query or {}).values()):
            # An empty list sends no parameter at all: the request may be valid after all
            # (schemathesis 4.30, the last for Python 3.10, counts it as invalid)
            excluded.append(negative_data_rejection)
        response = case.call_and_validate(
            headers={"Authorization": f"Bearer {key}"}, excluded_checks=excluded
        )
        assert_no_error_event(response.content)

    try:
        check()
    except (Exception, FailureGroup) as exc:  # every operation runs; all are reported
        return f"{type(exc).__name__}: {exc}"
    return None
