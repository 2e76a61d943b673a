"""The gateway served as ``tollway serve`` serves it (one uvicorn worker, uvloop, httptools,
start-up objects frozen out of garbage collection), in a process of its own: run
`serve_gateway` with `tests.support.child_process.child_process`. For the fault suites (a
replica to SIGKILL) and the benchmarks, which add their probes around `gateway_server`.

``hosts_file``: ``dns://`` upstreams resolve from that JSON file (`hosts_file_resolver`), which
a test or benchmark rewrites (`write_hosts_file`) to add and remove replicas.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import uvicorn


def gateway_server(settings_data: dict[str, Any], hosts_file: str | None = None) -> uvicorn.Server:
    """The gateway app on the settings ``settings_data`` describes, in its server, not yet run."""
    from gateway.app import build_gateway
    from gateway.launcher.serve import tune_gc_for_serving
    from gateway.settings import GatewaySettings
    from tests.support import stand_in_engine

    settings = GatewaySettings.from_dict(settings_data)
    if hosts_file is None:
        app = build_gateway(settings)
    else:
        app = build_gateway(settings, resolver=hosts_file_resolver(hosts_file))
    tune_gc_for_serving()  # as `tollway serve` does
    return stand_in_engine.bench_server(app)


def serve_gateway(
    settings_data: dict[str, Any], sock: socket.socket, hosts_file: str | None = None
) -> None:
    """Serve the gateway on the bound ``sock`` until SIGTERM."""
    gateway_server(settings_data, hosts_file).run(sockets=[sock])


def hosts_file_resolver(path: str) -> Callable[[str, int], Awaitable[Sequence[str]]]:
    """A DNS stand-in: ``{"name": ["10.0.0.1", ...]}`` read from ``path`` at every lookup."""

    async def resolve(host: str, port: int) -> Sequence[str]:
        try:
            addresses = json.loads(Path(path).read_text())[host]  # noqa: ASYNC240 (a few bytes)
        except (OSError, ValueError, KeyError) as exc:
            raise OSError(f"{host} is not in {path}: {exc}") from None
        return [str(address) for address in addresses]

    return resolve


def write_hosts_file(path: str | Path, hosts: dict[str, list[str]]) -> None:
    """Replace ``path`` at once (a reader never sees half a file)."""
    partial = Path(f"{path}.partial")
    partial.write_text(json.dumps(hosts))
    partial.replace(path)
