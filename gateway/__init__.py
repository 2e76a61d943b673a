"""Tollway gateway: the OpenAI-compatible front door (tenants, budgets, routing)."""
