"""Render every Kustomize overlay under deploy/kubernetes/overlays and validate it strictly.

Each overlay is rendered with ``kubectl kustomize``; each object it yields is validated with
the ``kubernetes-validate`` package against the Kubernetes version the README names, in
strict mode (a misspelt or misplaced field is an error, not ignored). So is the Secret
template, deploy/kubernetes/secrets.example.yaml, which no overlay includes. An object whose
kind has no schema is an error, except the custom resources below: no package on the
registries this project uses ships their published schemas (KEDA's ScaledObject, the
Prometheus Operator's ServiceMonitor), so they are listed as NOT VALIDATED, by name, in the
output. tests/deploy/test_kubernetes_manifests.py checks what it can of them (their metric
names and targets against the code).

    python .ci/validate_kubernetes.py --kubernetes-version 1.35.0   # needs kubectl and
                                                                    # kubernetes-validate
Exit 0 when every object validated, 1 otherwise (one line per error).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
KUBERNETES_DIR = REPO_ROOT / "deploy" / "kubernetes"
# API groups whose objects are not validated (no published schema vendored): why in the doc.
NOT_VALIDATED_GROUPS = {"keda.sh": "KEDA", "monitoring.coreos.com": "Prometheus Operator"}


def render(overlay: Path) -> str:
    result = subprocess.run(
        ["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise SystemExit(f"kubectl kustomize {overlay} failed: {result.stderr.strip()}")
    return result.stdout


def objects(text: str) -> Iterator[dict[str, Any]]:
    for document in yaml.safe_load_all(text):
        if document:
            yield document


def name_of(obj: dict[str, Any]) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def check(source: str, items: Iterable[dict[str, Any]], version: str) -> tuple[int, list[str]]:
    """Validate ``items``; print one line per error and per object not validated.
    Returns (number validated, errors)."""
    num_validated = 0
    errors: list[str] = []
    for obj in items:
        group = str(obj.get("apiVersion", "")).partition("/")[0]
        if group in NOT_VALIDATED_GROUPS:
            print(
                f"  NOT VALIDATED {source}: {name_of(obj)} ({obj['apiVersion']}): no published "
                f"{NOT_VALIDATED_GROUPS[group]} schema vendored"
            )
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(part) for part in exc.path)
            errors.append(f"{source}: {name_of(obj)}: {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError:
            errors.append(
                f"{source}: {name_of(obj)}: Kubernetes {version} has no "
                f"{obj.get('apiVersion')} {obj.get('kind')}"
            )
        else:
            num_validated += 1
    return num_validated, errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kubernetes-version", required=True)
    args = parser.parse_args()
    version: str = args.kubernetes_version

    overlays = sorted(path for path in (KUBERNETES_DIR / "overlays").iterdir() if path.is_dir())
    if not overlays:
        print(f"no overlays under {KUBERNETES_DIR / 'overlays'}", file=sys.stderr)
        return 1
    sources = [(str(path.relative_to(REPO_ROOT)), list(objects(render(path)))) for path in overlays]
    template = KUBERNETES_DIR / "secrets.example.yaml"
    sources.append(
        (str(template.relative_to(REPO_ROOT)), list(objects(template.read_text("utf-8"))))
    )

    all_errors: list[str] = []
    for source, items in sources:
        num_validated, errors = check(source, items, version)
        print(f"{source}: {num_validated} of {len(items)} objects valid for Kubernetes {version}")
        all_errors.extend(errors)
    for error in all_errors:
        print(f"ERROR {error}", file=sys.stderr)
    return 1 if all_errors else 0


if __name__ == "__main__":
    sys.exit(main())
