"""Model versions over real HTTP: a rollout's versions behind one public name, each on its own
stand-in engine (which records what reached it). The tap is the referee: which engine got
the request, under which ``model`` id; the client sees the public name and the version header.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.api.completions import VERSION_HEADER
from gateway.rollouts import resolve_version
from gateway.settings import GatewaySettings
from gateway.storage.api_keys import hash_key
from tests.gateway.request_path.test_openai_sdk import usage_records
from tests.support.stand_in_stack import TappedEngine, gateway, stand_in_engine, tenant_key

LLAMA_ID = "meta-llama/Llama-3.1-8B-Instruct"
ADMIN_KEY = "admin-" + "v" * 40
CHAT = {"model": "large", "messages": [{"role": "user", "content": "one two three"}]}
NUM_USERS = 24


class Stack:
    def __init__(self, base: str, settings: GatewaySettings, engines: dict[str, TappedEngine]):
        self.base, self.settings, self.engines = base, settings, engines

    def version_for(self, tenant_id: str, user: str | None) -> str:
        return resolve_version(self.settings.rollouts, "large", tenant_id, user)

    def engine_models(self, version: str) -> list[str]:
        return [body["model"] for _, body in self.engines[version].requests]


@pytest.fixture
def stack(sqlite_db_url: str, tmp_path: Path) -> Iterator[Stack]:
    with ExitStack() as stack:
        engines = {v: stack.enter_context(stand_in_engine(num_chunks=3)) for v in ("v1", "v2")}
        engines["small"] = stack.enter_context(stand_in_engine(num_chunks=3))

        def model(engine: TappedEngine, **fields: Any) -> dict[str, Any]:
            return {"upstreams": [engine.upstream], "context_window": 4096} | fields

        settings = GatewaySettings.from_dict(
            {
                "data_dir": str(tmp_path),
                "database_url": sqlite_db_url,
                "admin_key_hash": hash_key(ADMIN_KEY),
                "models": {
                    "small": model(engines["small"]),
                    "large-v1": model(
                        engines["v1"], upstream_model=LLAMA_ID, prices={"output": 1_000_000}
                    ),
                    "large-v2": model(
                        engines["v2"], prices={"output": 3_000_000}, context_window=256
                    ),
                },
                "rollouts": {"large": {"large-v1": 50, "large-v2": 50}},
                "routing": {"aliases": {"auto": {"small": "small", "large": "large"}}},
            }
        )
        base = stack.enter_context(gateway(settings))
        by_version = {"large-v1": engines["v1"], "large-v2": engines["v2"]}
        yield Stack(base, settings, {**by_version, "small": engines["small"]})


def post(stack: Stack, key: str, **body: Any) -> httpx.Response:
    response = httpx.post(
        f"{stack.base}/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={**CHAT, **body},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    return response


def test_users_stick_to_the_version_their_hash_chooses(stack: Stack, sqlite_db_url: str) -> None:
    tenant_id, key = tenant_key(sqlite_db_url)
    served: dict[str, str] = {}
    for n in range(NUM_USERS):
        user = f"user-{n}"
        response = post(stack, key, user=user)
        served[user] = response.headers[VERSION_HEADER]
        assert served[user] == stack.version_for(tenant_id, user)
        assert response.json()["model"] == "large"  # the engine said LLAMA_ID or large-v2
    assert set(served.values()) == {"large-v1", "large-v2"}
    # Each engine got exactly its version's requests, under the id it knows the model by.
    num_v1 = sum(v == "large-v1" for v in served.values())
    assert stack.engine_models("large-v1") == [LLAMA_ID] * num_v1
    assert stack.engine_models("large-v2") == ["large-v2"] * (NUM_USERS - num_v1)
    again = [post(stack, key, user="user-0").headers[VERSION_HEADER] for _ in range(3)]
    assert again == [served["user-0"]] * 3
    # Without a user, the tenant is the key.
    assert post(stack, key).headers[VERSION_HEADER] == stack.version_for(tenant_id, None)


def test_a_stream_carries_the_public_name_and_the_version_header(
    stack: Stack, sqlite_db_url: str
) -> None:
    tenant_id, key = tenant_key(sqlite_db_url)
    user = next(f"u{n}" for n in range(100) if stack.version_for(tenant_id, f"u{n}") == "large-v1")
    with httpx.stream(
        "POST",
        f"{stack.base}/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={**CHAT, "user": user, "stream": True, "stream_options": {"include_usage": True}},
        timeout=30,
    ) as response:
        assert response.status_code == 200
        assert response.headers[VERSION_HEADER] == "large-v1"
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line[len("data: ") :]) for line in lines]
    assert len(chunks) >= 4
    assert {c["model"] for c in chunks} == {"large"}
    assert stack.engine_models("large-v1") == [LLAMA_ID]


def test_the_version_is_recorded_priced_and_summed(stack: Stack, sqlite_db_url: str) -> None:
    tenant_id, key = tenant_key(sqlite_db_url)
    versions = [
        post(stack, key, user=f"user-{n}").headers[VERSION_HEADER] for n in range(NUM_USERS)
    ]
    records = usage_records(sqlite_db_url, tenant_id, NUM_USERS)
    assert len(records) == NUM_USERS
    by_request = sorted(records, key=lambda r: r.created_at)
    assert [r.model_version for r in by_request] == versions
    assert {r.served_model for r in records} == {"large"}
    for record in records:  # 3 output tokens each, at the version's own price (input: free)
        per_token = 1 if record.model_version == "large-v1" else 3
        assert record.completion_tokens == 3
        assert record.cost_micros == 3 * per_token
    usage = httpx.get(f"{stack.base}/v1/usage", headers={"authorization": f"Bearer {key}"})
    assert {r["model_version"] for r in usage.json()["data"]} == set(versions)
    summary = httpx.get(
        f"{stack.base}/admin/usage/summary",
        params={"tenant_id": tenant_id, "period": "total"},
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
    )
    assert summary.status_code == 200, summary.text
    rows = {row["model_version"]: row for row in summary.json()["data"]}
    assert set(rows) == {"large-v1", "large-v2"}
    assert {row["served_model"] for row in rows.values()} == {"large"}
    assert rows["large-v2"]["num_requests"] == versions.count("large-v2")
    assert rows["large-v2"]["cost_micros"] == 9 * versions.count("large-v2")


def test_an_alias_routes_first_then_the_rollout_picks(stack: Stack, sqlite_db_url: str) -> None:
    tenant_id, key = tenant_key(sqlite_db_url)
    response = post(stack, key, model="auto", tollway_hint="large", user="alice")
    assert response.headers["x-tollway-route"] == "large; reason=hint"
    assert response.headers[VERSION_HEADER] == stack.version_for(tenant_id, "alice")
    assert response.json()["model"] == "large"
    small = post(stack, key, model="auto", tollway_hint="small")
    assert small.headers[VERSION_HEADER] == "small"
    assert small.json()["model"] == "small"
    assert stack.engine_models("small") == ["small"]


def test_models_lists_public_names_and_a_version_stays_callable(
    stack: Stack, sqlite_db_url: str
) -> None:
    _, key = tenant_key(sqlite_db_url)
    listed = httpx.get(f"{stack.base}/v1/models", headers={"authorization": f"Bearer {key}"})
    assert [m["id"] for m in listed.json()["data"]] == ["auto", "large", "small"]
    auth = {"authorization": f"Bearer {key}"}
    assert httpx.get(f"{stack.base}/v1/models/large", headers=auth).json()["id"] == "large"
    # Retrieved as listed: a rollout's versions are not cards (though they may be called).
    assert httpx.get(f"{stack.base}/v1/models/large-v2", headers=auth).status_code == 404
    pinned = post(stack, key, model="large-v2")  # an eval pinned to one version
    assert pinned.headers[VERSION_HEADER] == "large-v2"
    assert pinned.json()["model"] == "large-v2"


def test_metrics_carry_the_version(stack: Stack, sqlite_db_url: str) -> None:
    _, key = tenant_key(sqlite_db_url)
    version = post(stack, key, user="bob").headers[VERSION_HEADER]
    metrics = httpx.get(
        f"{stack.base}/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"}
    ).text
    series = f'endpoint="chat",model="large",status="completed",version="{version}"'
    assert f"tollway_gateway_requests_total{{{series}}} 1.0" in metrics
    assert (
        f'tollway_gateway_tokens_total{{direction="output",model="large",version="{version}"}}'
        in metrics
    )


def test_each_version_is_admitted_by_its_own_context_window(
    stack: Stack, sqlite_db_url: str
) -> None:
    """large-v2 holds 256 tokens, large-v1 4096: a 500-token prompt fits one version only,
    and the refusal is recorded under the version that refused it."""
    tenant_id, key = tenant_key(sqlite_db_url)
    users = {stack.version_for(tenant_id, f"u{n}"): f"u{n}" for n in range(50)}
    long_chat = {"messages": [{"role": "user", "content": "word " * 500}], "max_tokens": 4}
    assert post(stack, key, user=users["large-v1"], **long_chat).json()["model"] == "large"
    refused = httpx.post(
        f"{stack.base}/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={**CHAT, **long_chat, "user": users["large-v2"]},
    )
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    assert stack.engine_models("large-v2") == []
    records = usage_records(sqlite_db_url, tenant_id, 2)
    assert sorted((r.status.value, r.model_version) for r in records) == [
        ("completed", "large-v1"),
        ("rejected", "large-v2"),
    ]
