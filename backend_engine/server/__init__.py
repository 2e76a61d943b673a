"""The engine's OpenAI-compatible HTTP server (`backend_engine.server.app`).

The wire format it speaks (request models, field rules, SSE framing, error vocabulary) is
`openai_protocol`, shared with the gateway.
"""
