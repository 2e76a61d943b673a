"""What every console page handler shares: storage, the session guard, the templates, the
clock, and the gateway's live state the Fleet page reads; and the one way a page is
rendered (with its CSRF token and the signed-in role).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from prometheus_client import CollectorRegistry
from starlette.requests import Request
from starlette.responses import HTMLResponse

from gateway.auth.epochs import AuthEpochs
from gateway.console.console_auth import ConsoleGuard
from gateway.console.console_session import ConsoleSession, SessionCodec
from gateway.console.console_settings import ConsoleSettings
from gateway.console.svg_charts import budget_bar
from gateway.rollouts import LiveRollouts
from gateway.settings import GatewaySettings
from gateway.storage.database import Database
from gateway.upstream.prefix_index import PrefixIndex
from gateway.upstream.replica_set import ReplicaSet
from policies.scoped_budgets import money_text


@dataclass(frozen=True)
class FleetSources:
    """The gateway's live objects the Fleet page reads (never changes)."""

    replica_set: ReplicaSet
    prefix_index: PrefixIndex
    registry: CollectorRegistry
    rollouts: LiveRollouts


@dataclass(frozen=True)
class ConsoleContext:
    gateway: GatewaySettings
    settings: ConsoleSettings
    database: Database
    epochs: AuthEpochs
    codec: SessionCodec
    guard: ConsoleGuard
    templates: jinja2.Environment
    fleet: FleetSources | None
    now: Callable[[], datetime]

    def render(
        self,
        request: Request,
        template: str,
        session: ConsoleSession | None,
        status_code: int = 200,
        headers: dict[str, str] | None = None,
        **values: Any,
    ) -> HTMLResponse:
        csrf = None if session is None else self.guard.csrf_token(session)
        page = self.templates.get_template(template).render(
            session=session, csrf_token=csrf, **values
        )
        return HTMLResponse(page, status_code=status_code, headers=headers)


def template_environment(currency: str) -> jinja2.Environment:
    """Templates from this package, every value escaped unless marked safe (`Markup`); money
    (``| money``) in ``currency``, the code the prices are in, which pages also see."""
    environment = jinja2.Environment(
        loader=jinja2.PackageLoader("gateway.console", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    environment.globals["budget_bar"] = budget_bar
    environment.globals["currency"] = currency
    environment.filters["money"] = lambda micros: money_text(micros, currency)
    environment.filters["thousands"] = lambda n: f"{n:,}"
    environment.filters["percent"] = lambda x: "–" if x is None else f"{x:.0%}"
    environment.filters["when"] = lambda at: "never" if at is None else f"{at:%Y-%m-%d %H:%M} UTC"
    return environment
