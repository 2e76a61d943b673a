import typer
from typer.testing import CliRunner

from gateway.launcher.storage_cli import register_storage_commands
from gateway.storage.migrate import current_revision, head_revision

runner = CliRunner()


def make_app() -> typer.Typer:
    app = typer.Typer()
    register_storage_commands(app)

    @app.command("noop")
    def noop() -> None:  # a second command keeps "migrate" a named subcommand
        pass

    return app


def test_migrate_upgrades_the_default_sqlite_database_then_downgrades(tmp_path):
    app = make_app()
    data_dir = tmp_path / "data"
    result = runner.invoke(app, ["migrate", "--data-dir", str(data_dir)])
    assert result.exit_code == 0, result.output
    url = f"sqlite:///{data_dir.resolve() / 'tollway.db'}"
    assert current_revision(url) == head_revision()
    assert f"at revision {head_revision()}" in result.output

    result = runner.invoke(app, ["migrate", "base", "--downgrade", "--data-dir", str(data_dir)])
    assert result.exit_code == 0, result.output
    assert current_revision(url) is None
    assert "at revision base" in result.output


def test_migrate_takes_the_url_from_the_environment(tmp_path):
    url = f"sqlite:///{tmp_path / 'env.db'}"
    result = runner.invoke(make_app(), ["migrate"], env={"TOLLWAY_DATABASE_URL": url})
    assert result.exit_code == 0, result.output
    assert current_revision(url) == head_revision()


def test_migrate_reports_an_unreachable_database_without_the_password():
    url = "postgresql+psycopg://admin:hunter2@127.0.0.1:1/tollway"
    result = runner.invoke(make_app(), ["migrate", "--database-url", url])
    assert result.exit_code == 1
    assert "error: migrating" in result.output
    assert "hunter2" not in result.output
