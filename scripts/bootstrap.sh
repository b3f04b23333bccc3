#!/usr/bin/env bash
# Create (once) and activate the project's Python environment.
#
# Two layers. The dependencies live outside the checkout, in a cache keyed by their pins, because
# torch from PyPI is a multi-gigabyte CUDA build that every clone (CI clones too) should share.
# The project itself is installed (editable) into a thin `.venv` inside the checkout, which sees
# the shared packages through a .pth file: checkouts never import each other's code.
# Source this file:  . scripts/bootstrap.sh
# It is idempotent: a second run takes about a second.
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
    # Install the pinned dependencies (not the project) so the environment is clone-independent:
    # the common and operator ones, the node agent's (extra `agent`) and the tests' (extra `test`).
    deps=$("$venv/bin/python" - "$repo_root/pyproject.toml" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = project["optional-dependencies"]
print("\n".join(project["dependencies"] + extras["agent"] + extras["test"]))
PY
)
    echo "$deps" > "$venv/requirements.txt"
    "$venv/bin/python" -m pip install --progress-bar off -r "$venv/requirements.txt" >&2
    touch "$venv/.complete"
fi

# An older layout installed the project into the shared environment; take it out again.
if compgen -G "$venv/lib/python3*/site-packages/__editable__*lorafleet*" >/dev/null; then
    "$venv/bin/python" -m pip uninstall --quiet --yes lorafleet >&2
fi

# This checkout's thin environment on top of the shared one.
local_venv="$repo_root/.venv"
site_packages() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
if [ "$(cat "$local_venv/.shared" 2>/dev/null)" != "$venv" ]; then
    rm -rf "$local_venv"
    "$python_bin" -m venv --without-pip "$local_venv"
    echo "import site; site.addsitedir('$(site_packages "$venv")')" > "$(site_packages "$local_venv")/lorafleet-shared.pth"
    echo "$venv" > "$local_venv/.shared"
fi
# Editable installs of the project and of its development tooling (devtools/, a distribution of
# its own so the product never ships it), each re-linked whenever its pyproject.toml changes
# (package layout, console scripts). --no-deps: the shared environment holds what they need.
link_editable() {  # <name> <source dir>
    local stamp
    stamp="$local_venv/.editable-$1.$(sha256sum < "$2/pyproject.toml" | cut -c1-16)"
    if [ -f "$stamp" ]; then
        return 0
    fi
    # setuptools is chatty about editable installs: keep its output unless the install fails.
    "$local_venv/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e "$2" \
        > "$local_venv/install-$1.log" 2>&1 || { cat "$local_venv/install-$1.log" >&2; exit 1; }
    rm -f "$local_venv/.editable-$1."*
    touch "$stamp"
}
link_editable lorafleet "$repo_root"
link_editable lorafleet-dev "$repo_root/devtools"

# Environments of older pins take ~5 GB each: drop those no checkout has used for a week.
touch "$venv/.last-used"
for old in "$cache_root"/venv-*; do
    if [ "$old" != "$venv" ] && [ -z "$(find "$old/.last-used" -mtime -7 2>/dev/null)" ]; then
        echo "bootstrap: removing unused environment $old" >&2
        rm -rf "$old"
    fi
done

echo "$local_venv $venv"
)

_lorafleet_venvs=$(_lorafleet_bootstrap) || { echo "bootstrap: failed" >&2; return 1 2>/dev/null || exit 1; }
export VIRTUAL_ENV="${_lorafleet_venvs% *}"
# The checkout's scripts (lorafleet-agent, lorafleet-operator) first, then the shared ones.
export PATH="$VIRTUAL_ENV/bin:${_lorafleet_venvs#* }/bin:$PATH"
unset -f _lorafleet_bootstrap
unset _lorafleet_venvs
