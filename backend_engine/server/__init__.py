"""The engine's OpenAI-compatible HTTP server (`backend_engine.server.app`).

Nothing is imported here: the gateway uses `backend_engine.server.sse` and must not load the
engine (and torch) by importing this package.
"""
