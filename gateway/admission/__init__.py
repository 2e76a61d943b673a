"""Deciding whether a request may run, and what it holds if it does.

``admitter`` composes two steps: ``planning_step`` asks the pure policies what the request
would run as (counting its prompt with ``prompt_tokens`` / ``token_counter``: tiktoken, with
the ``encodings`` shipped here), then ``counting_step`` counts it against the tenant's rate
limits and budget in one call of the ``admission_store`` (in process or in Redis). The
result is one of ``outcomes``: an ``Admission`` or a ``Refusal``.
"""
