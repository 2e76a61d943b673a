"""Alembic migrations for the gateway's database; run them with ``tollway migrate``."""
