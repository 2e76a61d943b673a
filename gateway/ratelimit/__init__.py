"""Requests and tokens per minute: sliding-window counters per tenant.

``rate_limit_store`` holds what a hit reports (``WindowState``); ``memory_store`` counts in
process (one gateway), ``redis_window`` in Redis (many), its Lua run by the admission script,
and alone by ``redis_store`` for windows that are not a tenant's (the console's sign-ins).
The decision itself is the pure policy ``policies.rate_limit``.
"""
