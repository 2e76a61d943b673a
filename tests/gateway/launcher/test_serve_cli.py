"""``tollway serve``'s refusals: one line on stderr and exit status 1, never a traceback."""

from __future__ import annotations

import fcntl
import socket
from pathlib import Path

from typer.testing import CliRunner

from gateway.app import SPILL_FILENAME
from gateway.launcher.cli import app
from gateway.launcher.serve import ServeOptions, prepare


def test_a_spill_file_another_gateway_holds_is_a_one_line_error(tmp_path: Path) -> None:
    config = tmp_path / "tollway.yaml"
    config.write_text(
        "models:\n  m:\n    upstreams: [http://127.0.0.1:9]\n    context_window: 4096\n"
    )
    data = tmp_path / "data"
    first_run = prepare(ServeOptions(config=config, data_dir=data), say=lambda _: None)
    assert first_run[1].is_new  # the first gateway made the keys and the database
    spill = data / SPILL_FILENAME
    with socket.socket() as probe:  # refused before it binds, but the port must be valid
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    with open(spill, "a") as held:  # what the first gateway's usage writer does
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        result = CliRunner().invoke(
            app, ["serve", "--config", str(config), "--data-dir", str(data), "--port", port]
        )
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: "), lines[0]
    assert str(spill) in lines[0]
    assert "held by another gateway" in lines[0]
