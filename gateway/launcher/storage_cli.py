"""Storage subcommands of the ``tollway`` CLI: ``migrate``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gateway.defaults import DEFAULT_DATA_DIR, default_database_url

DATABASE_URL_HELP = "sqlite:///… or postgresql+psycopg://…; default: SQLite in --data-dir."


def register_storage_commands(app: typer.Typer) -> None:
    app.command("migrate")(migrate)


def migrate(
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
    downgrade: Annotated[
        bool, typer.Option("--downgrade", help="Go down to REVISION (e.g. base).")
    ] = False,
    database_url: Annotated[
        str | None, typer.Option(envvar="TOLLWAY_DATABASE_URL", help=DATABASE_URL_HELP)
    ] = None,
    data_dir: Annotated[
        Path, typer.Option(envvar="TOLLWAY_DATA_DIR", help="Where the embedded database lives.")
    ] = DEFAULT_DATA_DIR,
) -> None:
    """Bring the database schema to a revision (the latest by default)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    from gateway.storage import migrate as migrations

    url = database_url or default_database_url(data_dir)
    try:
        shown = make_url(url).render_as_string(hide_password=True)
    except ArgumentError as exc:
        raise typer.BadParameter(str(exc), param_hint="--database-url") from exc
    try:
        if downgrade:
            migrations.downgrade(url, revision)
        else:
            migrations.upgrade(url, revision)
        current = migrations.current_revision(url)
    except SQLAlchemyError as exc:
        typer.echo(f"error: migrating {shown} failed: {exc}", err=True)
        raise typer.Exit(code=1) from exc
    typer.echo(f"{shown} is at revision {current or 'base'}")
