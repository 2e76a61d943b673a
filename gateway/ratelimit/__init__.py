"""Requests and tokens per minute: sliding-window counters per tenant.

``rate_limit_store`` is the interface; ``memory_store`` serves one gateway, ``redis_store`` many.
The decision itself is the pure policy ``policies.rate_limit``.
"""
