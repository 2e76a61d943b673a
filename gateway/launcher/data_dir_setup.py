"""What ``tollway serve`` creates once in its data directory, and never again.

::

    DATA/
      models/small/, models/large/   demo checkpoints (written to a temp dir, then renamed)
      tollway.db                     SQLite, migrated on every start (a no-op when current)
      admin_key.sha256               SHA-256 of the admin key; its presence means "not first run"

The admin key and the default tenant's API key exist in clear only in the returned
`Credentials`, which the caller prints once. The hash file is written last, after the
tenant and key are committed: a run that dies in between simply counts as a first run
again next time (a new admin key, and a new key for the existing ``default`` tenant).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from gateway.launcher.engine_install import require_engine
from gateway.launcher.handed_over_commands import write_demo_checkpoint
from gateway.storage import api_keys, tenants
from gateway.storage.database import Database
from policies.quota import TenantQuota

ADMIN_KEY_FILENAME = "admin_key.sha256"
ADMIN_KEY_PREFIX = "tw-admin-"
DEFAULT_TENANT_ID = "default"
# No default_max_output_tokens: an answer without max_tokens may run to the context's end
# (OpenAI's chat does), under the output cap; the reservation holds that bound.
DEFAULT_TENANT_QUOTA = TenantQuota(
    budget_tokens=1_000_000,
    budget_period="day",
    max_output_tokens=4096,
    rpm=600,
)
DEMO_MODEL_SIZES: Mapping[str, str] = {"small": "small", "large": "large"}
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Credentials:
    """The admin key's hash, plus the keys in clear when this run created them."""

    admin_key_hash: str
    admin_key: str | None = field(default=None, repr=False)
    api_key: str | None = field(default=None, repr=False)
    tenant_id: str = DEFAULT_TENANT_ID

    @property
    def is_new(self) -> bool:
        return self.admin_key is not None


def ensure_demo_checkpoints(
    models_dir: Path,
    sizes: Mapping[str, str] = DEMO_MODEL_SIZES,
    *,
    show_progress: bool = False,
    on_write: Callable[[str, Path], None] | None = None,
) -> dict[str, Path]:
    """Write a demo checkpoint for each ``name -> size`` that is not there yet; return the paths.

    ``on_write(name, path)`` is called before each checkpoint is written (to tell the user).
    Writing one needs the engine (torch): without it, `EngineNotInstalledError`.
    """
    paths: dict[str, Path] = {}
    for name, size in sizes.items():
        path = models_dir / name
        paths[name] = path
        if (path / "config.json").is_file():
            continue
        if path.exists():
            raise ValueError(
                f"{path} exists but holds no config.json: remove it to get a new demo checkpoint"
            )
        require_engine("writing the demo models")
        if on_write is not None:
            on_write(name, path)
        partial = models_dir / f".{name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        write_demo_checkpoint(partial, size=size, show_progress=show_progress)
        partial.rename(path)
    return paths


def read_admin_key_hash(data_dir: Path) -> str | None:
    """The stored admin key hash, or ``None`` before the first run."""
    path = data_dir / ADMIN_KEY_FILENAME
    if not path.is_file():
        return None
    stored = path.read_text(encoding="ascii").strip()
    if not _SHA256_HEX.fullmatch(stored):
        raise ValueError(
            f"{path} does not hold a SHA-256 hex digest: delete it to generate a new admin key"
        )
    return stored


def ensure_credentials(
    data_dir: Path,
    database_url: str,
    *,
    configured_admin_key_hash: str | None = None,
    now: datetime | None = None,
) -> Credentials:
    """The admin key hash to run with, creating the first-run keys if there is none yet.

    A configured hash (YAML or ``TOLLWAY_ADMIN_KEY_HASH``) wins and creates nothing. The
    database must already be migrated.
    """
    if configured_admin_key_hash is not None:
        return Credentials(admin_key_hash=configured_admin_key_hash)
    stored = read_admin_key_hash(data_dir)
    if stored is not None:
        return Credentials(admin_key_hash=stored)
    admin_key = ADMIN_KEY_PREFIX + secrets.token_urlsafe(32)
    api_key = _default_tenant_key(database_url, now)
    _write_private(data_dir / ADMIN_KEY_FILENAME, api_keys.hash_key(admin_key) + "\n")
    return Credentials(
        admin_key_hash=api_keys.hash_key(admin_key), admin_key=admin_key, api_key=api_key
    )


def _default_tenant_key(database_url: str, now: datetime | None) -> str:
    database = Database(database_url)
    try:
        with database.transaction() as session:
            if tenants.get_tenant(session, DEFAULT_TENANT_ID) is None:
                tenants.create_tenant(
                    session,
                    DEFAULT_TENANT_ID,
                    name="Default tenant",
                    tier=DEFAULT_TENANT_QUOTA.tier,
                    quota=DEFAULT_TENANT_QUOTA.to_dict(),
                    now=now,
                )
            created = api_keys.create_key(session, DEFAULT_TENANT_ID, name="first run", now=now)
    finally:
        database.dispose()
    return created.key


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` atomically, readable by the owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as out:
        out.write(text)
    partial.replace(path)
