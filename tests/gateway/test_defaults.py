"""The gateway's defaults: where the embedded database lives."""

from __future__ import annotations

from pathlib import Path

from gateway.defaults import default_database_url


def test_default_url_is_sqlite_in_the_data_dir(tmp_path: Path) -> None:
    assert default_database_url(tmp_path) == f"sqlite:///{tmp_path.resolve() / 'tollway.db'}"
