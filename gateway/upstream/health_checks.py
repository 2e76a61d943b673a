"""The active check of one replica: may it take requests now?

A Tollway engine answers ``GET /ready``: 200 once its model is loaded, 503 while it loads
weights or drains. A foreign OpenAI-compatible server may have no ``/ready``: a 404 there
falls back to ``GET /health`` (liveness, the best it offers). Anything else (another
status, a connection error, no answer within the timeout) is not ready.
"""

from __future__ import annotations

import httpx

HEALTH_CHECK_TIMEOUT_S = 2.0


async def is_replica_ready(
    client: httpx.AsyncClient, base: str, timeout_s: float = HEALTH_CHECK_TIMEOUT_S
) -> bool:
    try:
        response = await client.get(base + "/ready", timeout=timeout_s)
        if response.status_code == 404:
            response = await client.get(base + "/health", timeout=timeout_s)
    except httpx.HTTPError:
        return False
    return response.status_code == 200
