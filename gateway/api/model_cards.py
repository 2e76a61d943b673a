"""``GET /v1/models`` and ``GET /v1/models/{model}``: the model cards a key may use.

A card is listed, and retrieved, for each public name the key's quota allows: served models,
rollouts and routing aliases (a rollout's versions are not listed, though they may be called:
clients ask for the rollout). Any other name, whether nobody serves it or the key may not use
it, is OpenAI's 404 ``model_not_found`` ("does not exist or you do not have access to it"),
so a key cannot tell the models of other plans from names that do not exist.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.api.handler_context import GatewayContext
from gateway.auth.bearer_keys import authenticate_request
from gateway.errors import ApiError
from openai_protocol.errors import MODEL_NOT_FOUND, model_not_found_message
from policies.decision import Rejection


async def list_models(request: Request) -> Response:
    """List the models, rollouts and routing aliases this key may use (a rollout's versions
    are not listed: clients ask for the rollout).
    ---
    {200: ModelList}
    """
    names = await _usable_models(request)
    return JSONResponse({"object": "list", "data": [model_card(name) for name in sorted(names)]})


async def retrieve_model(request: Request) -> Response:
    """Retrieve the card of a model, rollout or routing alias this key may use.
    ---
    {params: [ModelId], 200: ModelCard, errors: [404]}
    """
    name = request.path_params["model"]
    if name not in await _usable_models(request):
        rejection = Rejection.of(MODEL_NOT_FOUND, model_not_found_message(name), param="model")
        raise ApiError(rejection)
    return JSONResponse(model_card(name))


def model_card(name: str) -> dict[str, Any]:
    """OpenAI's model object (``created`` is unknown here: 0)."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "tollway"}


async def _usable_models(request: Request) -> frozenset[str]:
    ctx = GatewayContext.of(request)
    caller = await authenticate_request(ctx.database, request)
    allowed = caller.quota.allowed_models
    public = ctx.settings.public_models(ctx.rollouts.table)
    return public if allowed is None else public & frozenset(allowed)
