#!/usr/bin/env bash
# The Kubernetes manifests (deploy/kubernetes): every overlay rendered with `kubectl kustomize`
# and validated strictly with the kubernetes-validate package against the Kubernetes version
# the README names, in a throwaway virtual environment (.ci/validate_kubernetes.py says what
# is and is not validated). About 10 s, most of it the pip install.
#
#   .ci/kubernetes.sh            # from anywhere; PYTHON=python3.12 to pick the interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
KUBERNETES_VERSION=1.35.0          # README.md, "Kubernetes": keep the two in step
PYTHON="${PYTHON:-python3}"
start=$SECONDS

if ! command -v kubectl >/dev/null; then
    echo "kubernetes manifests: kubectl (with Kustomize) is needed to render the overlays" >&2
    exit 1
fi
VENV="$(mktemp -d -t tollway-kubernetes.XXXXXX)"
trap 'rm -rf "$VENV"' EXIT
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet kubernetes-validate==1.37.0
"$VENV/bin/python" .ci/validate_kubernetes.py --kubernetes-version "$KUBERNETES_VERSION"
echo "kubernetes manifests: valid, in $((SECONDS - start)) s"
