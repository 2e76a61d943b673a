"""The ``tollway`` commands that belong to other packages, handed over when they run.

``tollway engine``, ``demo-model`` and ``convert`` are the engine's (`backend_engine.cli`);
``tollway plan`` is the capacity planner's (`capacity_planner.cli`), an offline tool that
never serves a request. The gateway imports neither: each command here passes its
arguments, ``--help`` included, to the owner's own command when it runs, and only then
imports it (this module is the one place the gateway names them; the layer contracts in
``pyproject.toml`` allow these two imports and no other). Without the engine (a gateway-only
install) an engine command prints one line saying how to add it and exits 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import typer

from gateway.launcher.engine_install import EngineNotInstalledError, require_engine


@dataclass(frozen=True)
class HandedOverCommand:
    summary: str  # one line for `tollway --help` (the owner's command has the full help)
    owner: str  # the module whose typer `app` runs it
    needs_engine: bool


ENGINE_CLI = "backend_engine.cli"
PLANNER_CLI = "capacity_planner.cli"

HANDED_OVER_COMMANDS = {
    "engine": HandedOverCommand(
        "Serve one checkpoint over an OpenAI-compatible HTTP API.", ENGINE_CLI, True
    ),
    "demo-model": HandedOverCommand(
        "Write a random-weight Llama checkpoint in exact Hugging Face format.", ENGINE_CLI, True
    ),
    "convert": HandedOverCommand(
        "Convert a GGUF file to a Hugging Face directory, or either to a GGUF file.",
        ENGINE_CLI,
        True,
    ),
    "plan": HandedOverCommand(
        "How many GPUs a traffic needs, and what they cost.", PLANNER_CLI, False
    ),
}


def register_handed_over_commands(app: typer.Typer) -> None:
    for name, command in HANDED_OVER_COMMANDS.items():
        app.command(
            name,
            help=command.summary,
            add_help_option=False,  # --help is the owner's
            context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
        )(_handing_over_to(name, command))


def run_handed_over(name: str, args: list[str]) -> None:
    """Run ``tollway NAME ARGS`` in this process (raises ``SystemExit`` as a command does)."""
    if HANDED_OVER_COMMANDS[name].owner == ENGINE_CLI:
        from backend_engine.cli import app as engine_cli

        typer.main.get_command(engine_cli).main([name, *args], prog_name="tollway")
    else:  # the planner's app is its one command
        from capacity_planner.cli import app as planner_cli

        typer.main.get_command(planner_cli).main(args, prog_name=f"tollway {name}")


def _handing_over_to(name: str, command: HandedOverCommand) -> Callable[[typer.Context], None]:
    def run(ctx: typer.Context) -> None:
        if command.needs_engine:
            try:
                require_engine(f"`tollway {name}`")
            except EngineNotInstalledError as exc:
                typer.echo(f"error: {exc}", err=True)
                raise typer.Exit(code=1) from None
        run_handed_over(name, ctx.args)

    return run


def write_demo_checkpoint(directory: Path, size: str, show_progress: bool) -> None:
    """The engine's demo checkpoint writer (what ``tollway demo-model`` runs), for
    ``tollway serve``'s first start: needs the engine, `EngineNotInstalledError` without it."""
    require_engine("writing the demo models")
    from backend_engine.demo.checkpoint import write_demo_checkpoint as write

    write(directory, size=size, show_progress=show_progress)
