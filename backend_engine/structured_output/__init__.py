"""Structured outputs: constraining what a request may generate to a grammar.

- :mod:`.constraint`: what a request asks for (a JSON Schema, a regex, a choice, a Lark
  grammar), as plain data with a canonical key. Torch-free; the server builds it.
- :mod:`.grammar_compiler`: a constraint compiled by llguidance for this tokenizer, once per
  key (a bounded cache), checked and timed out off the event loop.
- :mod:`.matcher`: one request's position in its grammar: the next token's mask, and the
  tokens it has accepted.
- :mod:`.tool_grammar`: the grammar of tool calls for ``tools`` and ``tool_choice``.

The worker applies the masks (``backend_engine.worker.logits_mask``); the scheduler only
carries each request's matcher, never looking inside.
"""
