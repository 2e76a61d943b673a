"""Where a gateway starts when neither its config, ``TOLLWAY_*`` nor a flag says otherwise.

One place for each, light to import: the settings object reads them, and so do the
command line's defaults and ``--help`` texts, which must not pull in the settings' Redis
and database modules just to print a number.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_DATA_DIR = Path("tollway-data")
# How long `tollway serve` waits for every engine it starts to answer /health: loading a
# checkpoint and, the first time, compiling the CPU kernels.
DEFAULT_ENGINE_TIMEOUT_S = 600.0
# A gateway told to stop (SIGTERM): how long it keeps serving while /ready says 503, so load
# balancers stop sending to it, then how long streams in flight get to finish.
DEFAULT_DRAIN_DELAY_S = 0.0
DEFAULT_DRAIN_GRACE_S = 30.0
