"""The ``tollway`` command line."""

from __future__ import annotations

import typer

from gateway.launcher.handed_over_commands import register_handed_over_commands
from gateway.launcher.serve_cli import register_serve_commands
from gateway.launcher.storage_cli import register_storage_commands

app = typer.Typer(
    name="tollway",
    help="Tollway: an OpenAI-compatible gateway and the inference engines behind it.",
    no_args_is_help=True,
    add_completion=False,
)
register_handed_over_commands(app)
register_storage_commands(app)
register_serve_commands(app)


if __name__ == "__main__":
    app()
