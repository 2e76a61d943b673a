"""The engine's wire protocol beyond OpenAI's, shared by the engine and the gateway: the
prefix cache's block hashes and the typed lines of ``GET /kv_events``. Imports neither side.
"""
