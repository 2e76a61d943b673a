#!/usr/bin/env bash
# Print the path of a Python X.Y interpreter that runs: `pythonX.Y` on PATH, else the newest
# X.Y.* that pyenv installed. A pyenv shim on PATH answers for every installed version but
# runs only the versions pyenv selects, so each candidate is run, not just found. Exit 1,
# saying so, when there is none.
#
#   .ci/find_python.sh 3.10          # e.g. /root/.pyenv/versions/3.10.13/bin/python3.10
set -euo pipefail
version="${1:?usage: .ci/find_python.sh X.Y}"

runs_as_version() {
    "$1" -c "import sys; sys.exit(f'{sys.version_info[0]}.{sys.version_info[1]}' != '$version')" \
        >/dev/null 2>&1
}

candidates=()
if on_path="$(command -v "python$version")"; then
    candidates+=("$on_path")
fi
pyenv_root="$(pyenv root 2>/dev/null || echo "${PYENV_ROOT:-$HOME/.pyenv}")"
while IFS= read -r installed; do
    candidates+=("$installed")
done < <(ls -d "$pyenv_root/versions/$version".*/bin/"python$version" 2>/dev/null | sort -rV)

for candidate in ${candidates[@]+"${candidates[@]}"}; do
    if runs_as_version "$candidate"; then
        echo "$candidate"
        exit 0
    fi
done
echo "no Python $version here: neither python$version on PATH nor $pyenv_root/versions/$version.*" \
    "runs (pyenv install $version, or put python$version on PATH)" >&2
exit 1
