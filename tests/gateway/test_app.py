"""The gateway app: it stays light (never loads the engine's stack) and guards /metrics."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from gateway.app import build_gateway
from gateway.settings import GatewaySettings, ModelSettings
from gateway.storage.api_keys import hash_key

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_gateway_app_imports_neither_torch_nor_the_engine() -> None:
    # A gateway that imported torch would take ~2 s longer to start and ~300 MB more memory
    # per worker, for nothing: it shares only the SSE helpers and the tokenizer with the engine.
    code = (
        "import sys, gateway.app, gateway.launcher.serve; "
        "loaded = [m for m in ('torch', 'transformers', 'backend_engine.llm_engine', "
        "'backend_engine.server.app') if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)


# --- /metrics -----------------------------------------------------------------------------

ADMIN_KEY = "admin-" + "m" * 40
METRICS_TOKEN = "scrape-" + "t" * 40


def metrics_app(db_url: str, tmp_path: Path, **settings: Any) -> Starlette:
    model = ModelSettings(name="m", upstreams=("http://127.0.0.1:9",), context_window=64)
    return build_gateway(
        GatewaySettings(models={"m": model}, data_dir=tmp_path, database_url=db_url, **settings)
    )


async def scrape(app: Starlette, token: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        return await client.get("/metrics", headers=headers)


@pytest.mark.parametrize("metrics_token", [True, False])
async def test_metrics_need_the_metrics_token_or_the_admin_key(
    sqlite_db_url: str, tmp_path: Path, metrics_token: bool
) -> None:
    """The labels name every tenant's models and outcomes: no scrape without a token."""
    token_hash = hash_key(METRICS_TOKEN) if metrics_token else None
    app = metrics_app(
        sqlite_db_url, tmp_path, admin_key_hash=hash_key(ADMIN_KEY), metrics_token_hash=token_hash
    )
    for token in (ADMIN_KEY, *([METRICS_TOKEN] if metrics_token else [])):
        response = await scrape(app, token)
        assert response.status_code == 200, response.text
        assert "tollway_gateway_reservations_in_flight" in response.text
    refused = [None, "", "wrong", ADMIN_KEY + "x", *([] if metrics_token else [METRICS_TOKEN])]
    for token in refused:
        response = await scrape(app, token)
        assert response.status_code == 401, (token, response.text)
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"
        assert "tollway_gateway" not in response.text


async def test_metrics_without_any_token_configured_refuse_every_scrape(
    sqlite_db_url: str, tmp_path: Path
) -> None:
    app = metrics_app(sqlite_db_url, tmp_path)
    for token in (None, "", ADMIN_KEY, METRICS_TOKEN):
        assert (await scrape(app, token)).status_code == 401


async def test_the_openapi_document_describes_the_completion_endpoints(
    sqlite_db_url: str, tmp_path: Path
) -> None:
    app = metrics_app(sqlite_db_url, tmp_path, admin_key_hash=hash_key(ADMIN_KEY))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        document = (await client.get("/openapi.json")).json()
    schemas = document["components"]["schemas"]
    for path, body, answer, event in [
        ("/v1/chat/completions", "ChatCompletionBody", "ChatCompletion", "ChatCompletionChunk"),
        ("/v1/completions", "CompletionBody", "Completion", "Completion"),
    ]:
        operation = document["paths"][path]["post"]
        assert operation["security"] == [{"tenantKey": []}]
        assert operation["requestBody"]["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{body}"
        }
        content = operation["responses"]["200"]["content"]
        assert content["application/json"]["schema"]["$ref"].endswith(f"/{answer}")
        assert content["text/event-stream"]["x-event-schema"]["$ref"].endswith(f"/{event}")
        assert {"400", "401", "429", "503"} <= set(operation["responses"])
        assert schemas[body]["properties"]["model"]["enum"] == ["m"]  # the served models
        assert schemas[body]["properties"]["temperature"]["maximum"] == 2
    assert "messages" in schemas["ChatCompletionBody"]["required"]
    assert "prompt" in schemas["CompletionBody"]["required"]
    # The field rules on tools and output constraints, as JSON Schema (field_rules' own).
    chat = schemas["ChatCompletionBody"]["properties"]
    tools = chat["tools"]["anyOf"][0]
    assert tools["maxItems"] == 128
    name = tools["items"]["properties"]["function"]["properties"]["name"]
    assert name["pattern"] == "^[a-zA-Z0-9_-]{1,64}$"
    assert chat["tool_choice"]["anyOf"][0] == {"enum": ["none", "auto", "required"]}
    for body in ("ChatCompletionBody", "CompletionBody"):
        properties = schemas[body]["properties"]
        extension = properties["structured_outputs"]["anyOf"][0]["properties"]
        assert extension["choice"]["maxItems"] == 1000
        response_format = properties["response_format"]["anyOf"][0]["properties"]
        assert response_format["type"]["enum"] == ["json_object", "json_schema", "text"]
    # A tool-call answer: calls in the message, pieces of them in the deltas.
    assert "tool_calls" in schemas["AssistantMessage"]["properties"]
    assert "tool_calls" in schemas["ChatDelta"]["properties"]
    # Issue #26's fields: n up to 128, penalties, logit_bias, prompt lists, echo, refusal.
    for body in ("ChatCompletionBody", "CompletionBody"):
        properties = schemas[body]["properties"]
        assert properties["n"]["maximum"] == 128
        assert properties["presence_penalty"]["minimum"] == -2
        assert properties["repetition_penalty"]["exclusiveMinimum"] == 0
        assert properties["logit_bias"]["maxProperties"] == 300
    completion = schemas["CompletionBody"]["properties"]
    assert len(completion["prompt"]["anyOf"]) == 4  # string, strings, token ids, id lists
    assert "echo" in completion
    assert "refusal" in schemas["AssistantMessage"]["properties"]
    for answer in ("ChatCompletion", "ChatCompletionChunk", "Completion"):
        assert "system_fingerprint" in schemas[answer]["properties"]
    retrieve = document["paths"]["/v1/models/{model}"]["get"]
    assert retrieve["parameters"] == [{"$ref": "#/components/parameters/ModelId"}]
    assert retrieve["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ModelCard"
    }
    assert {"401", "404"} <= set(retrieve["responses"])
