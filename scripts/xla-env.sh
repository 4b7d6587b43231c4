#!/usr/bin/env bash
# Runs accelfn's XLA tests on PJRT's CPU device, in a cached virtualenv outside the
# repository holding torch and torch_xla as pyproject.toml's xla extra pins them (2.9.0)
# and accelfn's dependencies (read from pyproject.toml). The first run creates the
# virtualenv (about 7 GB, a few minutes); later runs reuse it and only reinstall when the pins or pyproject's dependencies change.
# accelfn itself comes from this checkout through PYTHONPATH, so any clone can use the cache.
#
#   scripts/xla-env.sh [pytest arguments]          e.g. scripts/xla-env.sh -k loader -x
#
# ACCELFN_XLA_VENV    the virtualenv (default: ${XDG_CACHE_HOME:-~/.cache}/accelfn/xla-venv)
# ACCELFN_XLA_PYTHON  the Python 3.11+ that creates it (default: python3)
#
# The repository's constraints.txt pins the torch of the main environment and is not used
# here; pip's own configuration (such as a site-wide cap on torch) applies as usual.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${ACCELFN_XLA_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/accelfn/xla-venv}
python=${ACCELFN_XLA_PYTHON:-python3}

case "$(realpath -m "$venv")/" in
    "$repo"/*) echo "xla-env.sh: ACCELFN_XLA_VENV=$venv is inside the repository; choose a path outside it" >&2
               exit 2 ;;
esac

mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9  # one creator at a time; the others wait and reuse its result

if [ ! -x "$venv/bin/python" ]; then
    echo "xla-env.sh: creating $venv with $("$python" --version 2>&1)"
    "$python" -m venv "$venv"
fi

requirements=$("$venv/bin/python" - "$repo/pyproject.toml" <<'PY'
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
extras = project["optional-dependencies"]  # the xla extra pins torch and its torch_xla
print("\n".join(extras["xla"] + project["dependencies"] + extras["dev"]))
PY
)
stamp="$venv/.accelfn-requirements"
if [ "$(cat "$stamp" 2>/dev/null)" != "$requirements" ]; then
    echo "xla-env.sh: installing into $venv:" $requirements
    mapfile -t packages <<<"$requirements"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${packages[@]}"
    printf '%s' "$requirements" >"$stamp.tmp" && mv "$stamp.tmp" "$stamp"
fi

exec 9>&-
cd "$repo"
PJRT_DEVICE=CPU PYTHONPATH="$repo" \
    exec "$venv/bin/python" -m pytest -m xla tests/backends/test_xla_*.py "$@"
