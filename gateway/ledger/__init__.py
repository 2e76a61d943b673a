"""Budgets: the one place a tenant's token balance changes, and how a request settles.

``budget_ledger`` is the interface (in process or in Redis); ``settlement`` ends every request
with its usage record and settles its reservation; ``settle_retries`` retries what Redis missed.
"""
