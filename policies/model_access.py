"""Which models a tenant may call: 404 for a model nobody serves, 403 for one the
tenant is not allowed.

``known_models`` is everything a client may name: the served models and the
routing aliases (``auto``...). ``allowed_models`` is checked against the name the
client sent, so allowing ``auto`` allows whatever the router picks for it.
"""

from __future__ import annotations

from collections.abc import Collection

from policies.decision import Rejection
from policies.quota import TenantQuota


def check_model_access(
    model: str, quota: TenantQuota, known_models: Collection[str]
) -> Rejection | None:
    """None if the tenant may use ``model``; else a 404 or 403 `Rejection`."""
    if model not in known_models:
        return Rejection(
            status=404,
            code="model_not_found",
            type="not_found_error",
            message=f"The model `{model}` does not exist. GET /v1/models lists the models.",
            param="model",
        )
    if quota.allowed_models is not None and model not in quota.allowed_models:
        return Rejection(
            status=403,
            code="model_not_allowed",
            type="permission_error",
            message=f"Your plan does not include the model `{model}`.",
            param="model",
        )
    return None
