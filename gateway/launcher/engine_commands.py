"""``tollway engine``, ``tollway demo-model`` and ``tollway convert``: the engine's commands.

They belong to the engine (`backend_engine.cli`), which the gateway does not import: each
command here passes its arguments, ``--help`` included, to the engine's own command when it
runs, and only then imports it. Without the engine (a gateway-only install) it prints one
line saying how to add it and exits 1.
"""

from __future__ import annotations

from collections.abc import Callable

import typer

from gateway.launcher.engine_install import EngineNotInstalledError, require_engine

# name -> one line for `tollway --help` (the engine's command has the full help).
ENGINE_COMMANDS = {
    "engine": "Serve one checkpoint over an OpenAI-compatible HTTP API.",
    "demo-model": "Write a random-weight Llama checkpoint in exact Hugging Face format.",
    "convert": "Convert a GGUF file into a Hugging Face checkpoint directory.",
}


def register_engine_commands(app: typer.Typer) -> None:
    for name, summary in ENGINE_COMMANDS.items():
        app.command(
            name,
            help=summary,
            add_help_option=False,  # --help is the engine command's
            context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
        )(_handing_over_to(name))


def _handing_over_to(name: str) -> Callable[[typer.Context], None]:
    def run(ctx: typer.Context) -> None:
        try:
            require_engine(f"`tollway {name}`")
        except EngineNotInstalledError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(code=1) from None
        from backend_engine.cli import app as engine_cli

        typer.main.get_command(engine_cli).main([name, *ctx.args], prog_name="tollway")

    return run
