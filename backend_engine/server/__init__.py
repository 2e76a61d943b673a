"""The engine's OpenAI-compatible HTTP server."""

from backend_engine.server.app import build_app, serve

__all__ = ["build_app", "serve"]
