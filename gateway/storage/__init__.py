"""Durable storage: tenants, API keys (hashed), usage records, the audit log and the alert
outbox, via SQLAlchemy 2 + Alembic; and the Redis client the shared stores use.

- ``database.Database``: the engine and sessions for one URL (SQLite default, PostgreSQL).
- ``tenants``, ``api_keys``, ``usage_store``: repository functions over a ``Session``.
- ``audit_log``: admin changes, written in the change's transaction; ``alert_outbox``: budget
  alerts from their crossing until their webhook is delivered.
- ``usage_writer.UsageWriter``: buffered, retrying, crash-safe writes of usage records.
- ``migrate``: Alembic upgrade/downgrade (``tollway migrate``).
- ``redis_client``: the lean Redis client the request path shares (budgets, rate limits, epochs).
"""
