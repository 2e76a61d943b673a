"""The console's settings: one frozen value, built when the gateway app is.

The session secret signs the console's cookies and CSRF tokens. ``build_gateway`` takes it
from the gateway's ``console.session_secret`` (`gateway.console_section`), the same on every
replica, so a session issued by one is valid on all. Without one, each gateway process draws
its own here at start-up: a session then lasts as long as the process and is valid only on
the replica that issued it.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

DEFAULT_SESSION_TTL_S = 8 * 3600.0
DEFAULT_SIGN_IN_ATTEMPTS_PER_MINUTE = 10


@dataclass(frozen=True)
class ConsoleSettings:
    session_secret: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    session_ttl_s: float = DEFAULT_SESSION_TTL_S
    sign_in_attempts_per_minute: int = DEFAULT_SIGN_IN_ATTEMPTS_PER_MINUTE

    def __post_init__(self) -> None:
        if len(self.session_secret) < 32:
            raise ValueError("console session_secret must be at least 32 bytes")
        if not self.session_ttl_s > 0:
            raise ValueError(f"console session_ttl_s must be > 0, got {self.session_ttl_s}")
        if self.sign_in_attempts_per_minute < 1:
            raise ValueError(
                "console sign_in_attempts_per_minute must be at least 1, "
                f"got {self.sign_in_attempts_per_minute}"
            )
