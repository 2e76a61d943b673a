"""Budgets: the one place a tenant's token balance changes.

``budget_ledger`` is the interface (in process or in Redis); ``settle_retries`` retries the
settles Redis missed; ``balance_rebuild`` rebuilds a balance the ledger lost from the usage
records. A request's reservation is settled through them by `gateway.accounting.settlement`.
"""
