#!/usr/bin/env bash
# Create (once) and activate the project's Python environment.
#
# The environment lives outside the checkout, in a cache keyed by the dependency pins, because
# torch from PyPI is a multi-gigabyte CUDA build that every clone (CI clones too) should share.
# Source this file:  . scripts/bootstrap.sh
# It is idempotent: a second run only re-links this checkout into the environment (seconds).
# The work runs in a subshell with strict options, so sourcing leaves the caller's shell as it was.
_lorafleet_bootstrap() (
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache_root=${LORAFLEET_CACHE:-$HOME/.cache/lorafleet}
python_bin=${LORAFLEET_PYTHON:-$(command -v python3.11 || command -v python3)}

key=$("$python_bin" - "$repo_root/pyproject.toml" <<'PY'
import hashlib, json, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
pins = {"deps": project["dependencies"], "extras": project.get("optional-dependencies", {}),
        "python": sys.version_info[:2]}
print(hashlib.sha256(json.dumps(pins, sort_keys=True).encode()).hexdigest()[:12])
PY
)
venv="$cache_root/venv-$key"

mkdir -p "$cache_root"
# Two runs at once (CI and a developer, or parallel test jobs) must not build the same
# environment twice: the second waits for the first (the lock goes with this subshell).
exec {lock_fd}>"$cache_root/.bootstrap.lock"
flock "$lock_fd"
if [ ! -f "$venv/.complete" ]; then
    echo "bootstrap: creating Python environment $venv (first run downloads torch; several minutes)" >&2
    rm -rf "$venv"
    mkdir -p "$cache_root"
    "$python_bin" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip setuptools wheel
    # Install the pinned dependencies (not the project) so the environment is clone-independent.
    deps=$("$venv/bin/python" - "$repo_root/pyproject.toml" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["test"]))
PY
)
    echo "$deps" > "$venv/requirements.txt"
    "$venv/bin/python" -m pip install --progress-bar off -r "$venv/requirements.txt" >&2
    touch "$venv/.complete"
fi

# Point the shared environment at this checkout (editable, no dependency resolution: fast).
# Redone whenever the checkout or its pyproject.toml changes (package layout, console scripts).
stamp="$venv/.editable-$(cat "$repo_root/pyproject.toml" <(echo "$repo_root") | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    "$venv/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e "$repo_root" >&2
    rm -f "$venv"/.editable-*
    touch "$stamp"
fi

# Environments of older pins take ~5 GB each: drop those no checkout has used for a week.
touch "$venv/.last-used"
for old in "$cache_root"/venv-*; do
    if [ "$old" != "$venv" ] && [ -z "$(find "$old/.last-used" -mtime -7 2>/dev/null)" ]; then
        echo "bootstrap: removing unused environment $old" >&2
        rm -rf "$old"
    fi
done

echo "$venv"
)

_lorafleet_venv=$(_lorafleet_bootstrap) || { echo "bootstrap: failed" >&2; return 1 2>/dev/null || exit 1; }
export VIRTUAL_ENV="$_lorafleet_venv"
export PATH="$_lorafleet_venv/bin:$PATH"
unset -f _lorafleet_bootstrap
unset _lorafleet_venv
