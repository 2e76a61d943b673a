"""Durable storage: tenants, API keys (hashed) and usage records, via SQLAlchemy 2 + Alembic;
and the Redis client the shared stores use.

- ``database.Database``: the engine and sessions for one URL (SQLite default, PostgreSQL).
- ``tenants``, ``api_keys``, ``usage_store``: repository functions over a ``Session``.
- ``usage_writer.UsageWriter``: buffered, retrying, crash-safe writes of usage records.
- ``migrate``: Alembic upgrade/downgrade (``tollway migrate``).
- ``redis_client``: the lean Redis client the request path shares (budgets, rate limits, epochs).
"""
