"""Deciding whether a request may run: the admitter and the facts it gathers.

``admitter`` asks the policies in order; ``token_counter`` counts prompt tokens (tiktoken, with
the ``encodings`` shipped here); ``pool_load_reader`` feeds routing; ``atomic_step`` checks
and records rate limits and the budget reservation at once (in process or in Redis).
"""
