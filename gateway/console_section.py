"""The ``console:`` settings: the secret that signs the console's sessions on every replica.

::

    console:
      session_secret: 3q2-7w8Gk2rQ...   # TOLLWAY_CONSOLE_SESSION_SECRET, at least 32 characters

A console session (its cookie and the CSRF tokens of its forms) is signed with this secret,
so a session that one gateway replica issued is valid on every replica given the same
secret: the replicas behind one address stay stateless. Unset, each gateway process draws
a random secret at start-up (`gateway.console.console_settings`): sessions then work only on
the replica that issued them and end with its process. The secret is better given by the
environment (a Kubernetes Secret) than in the file; it is never in a repr or a log line.
Changing it signs everyone out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SESSION_SECRET_ENV = "TOLLWAY_CONSOLE_SESSION_SECRET"
MIN_SESSION_SECRET_LENGTH = 32
_FIELDS = {"session_secret"}


@dataclass(frozen=True)
class ConsoleSection:
    session_secret: str | None = field(default=None, repr=False)  # None: one per process

    def __post_init__(self) -> None:
        secret = self.session_secret
        if secret is not None and len(secret) < MIN_SESSION_SECRET_LENGTH:
            raise ValueError(
                f"console.session_secret must be at least {MIN_SESSION_SECRET_LENGTH} "
                f"characters, got {len(secret)} (set it, or {SESSION_SECRET_ENV}, to the "
                "same random string on every gateway replica: "
                "python -c 'import secrets;print(secrets.token_urlsafe(32))')"
            )


def parse_console_section(raw: Any, env: Mapping[str, str]) -> ConsoleSection:
    """``console:`` from YAML with the ``TOLLWAY_CONSOLE_SESSION_SECRET`` override (an empty
    value leaves the file's)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError("`console:` must be a mapping, e.g. {session_secret: ...}")
    unknown = sorted(set(raw) - _FIELDS)
    if unknown:
        raise ValueError(
            f"console: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(_FIELDS))}"
        )
    secret = env.get(SESSION_SECRET_ENV) or raw.get("session_secret")
    if secret is not None and not isinstance(secret, str):
        raise ValueError("console.session_secret must be a string (quote it in YAML)")
    return ConsoleSection(session_secret=secret)
