"""``python -m backend_engine --model CHECKPOINT [--uds SOCKET] ...``: serve one checkpoint.

This is how ``tollway serve`` starts its engines (`gateway.launcher.engine_processes`).
"""

from backend_engine.cli import engine_app

if __name__ == "__main__":
    engine_app(prog_name="python -m backend_engine")
