"""Where a gateway starts when neither its config, ``TOLLWAY_*`` nor a flag says otherwise.

One place for each, light to import (this module imports nothing of the gateway): the
settings object reads them, and so do the lower modules' own defaults (the Redis client,
the replica watch) and the command line's defaults and ``--help`` texts, which must not
pull in the settings' Redis and database modules just to print a number.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_DATA_DIR = Path("tollway-data")
DEFAULT_DATABASE_FILENAME = "tollway.db"  # in the data directory, when no database_url
# How long `tollway serve` waits for every engine it starts to answer /health: loading a
# checkpoint and, the first time, compiling the CPU kernels.
DEFAULT_ENGINE_TIMEOUT_S = 600.0
# A gateway told to stop (SIGTERM): how long it keeps serving while /ready says 503, so load
# balancers stop sending to it (a readiness probe every few seconds notices within this), then
# how long requests in flight get to finish before the gateway ends them itself.
DEFAULT_DRAIN_DELAY_S = 5.0
DEFAULT_DRAIN_GRACE_S = 30.0
# Bounds on one gateway process's HTTP connections (gateway/launcher/bounded_http.py): a
# request's headers must arrive within this long of the connection (or of its first byte on a
# kept-alive one), its body within this long of its headers; beyond this many connections open
# a request is answered 503. Keep max_connections under half the open-file limit (ulimit -n):
# each request in flight holds an upstream connection too.
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 1000
# A well-shaped API key the database did not know is refused from memory this long, unless a
# key is created meanwhile (gateway/auth/key_cache.py): a flood of one junk key reads once.
DEFAULT_AUTH_UNKNOWN_KEY_TTL_S = 5.0
# A healthy Redis answers in well under a millisecond: only a stalled one takes this long.
DEFAULT_REDIS_CONNECT_TIMEOUT_S = 0.5
DEFAULT_REDIS_TIMEOUT_S = 0.5
# Engine replicas: how often a dns:// upstream is resolved again and each replica's /ready
# read; how many failures in a row eject one, for how long at first and at most.
DEFAULT_DNS_REFRESH_S = 5.0
DEFAULT_HEALTH_CHECK_INTERVAL_S = 5.0
DEFAULT_EJECTION_FAILURES = 3
DEFAULT_EJECTION_BACKOFF_S = 1.0
DEFAULT_EJECTION_BACKOFF_MAX_S = 30.0


def default_database_url(data_dir: Path) -> str:
    """The embedded default: a SQLite file in the data directory."""
    return f"sqlite:///{(data_dir / DEFAULT_DATABASE_FILENAME).resolve()}"
