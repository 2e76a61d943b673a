"""Which models a tenant may call: 404 for a model nobody serves, 403 for one the
tenant is not allowed.

The 404 is OpenAI's: type ``invalid_request_error``, code ``model_not_found`` and its
sentence, which clients (the openai SDK's ``NotFoundError``, LiteLLM's mapping) read.

``known_models`` is everything a client may name: the served models and the
routing aliases (``auto``...). ``allowed_models`` is checked against the name the
client sent, so allowing ``auto`` allows whatever the router picks for it.
"""

from __future__ import annotations

from collections.abc import Collection

from openai_protocol.errors import MODEL_NOT_FOUND, model_not_found_message
from policies.decision import Rejection
from policies.quota import TenantQuota


def check_model_access(
    model: str, quota: TenantQuota, known_models: Collection[str]
) -> Rejection | None:
    """None if the tenant may use ``model``; else a 404 or 403 `Rejection`."""
    if model not in known_models:
        return Rejection.of(MODEL_NOT_FOUND, model_not_found_message(model), param="model")
    if quota.allowed_models is not None and model not in quota.allowed_models:
        return Rejection(
            status=403,
            code="model_not_allowed",
            type="permission_error",
            message=f"Your plan does not include the model `{model}`.",
            param="model",
        )
    return None
