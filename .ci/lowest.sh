#!/usr/bin/env bash
# `make lowest`: the unit tests with the LOWEST versions pyproject.toml's ranges allow, so a
# lower bound that does not work is seen (and fixed in pyproject.toml), not claimed.
#
# In .venv-lowest on $PY (3.11, the lowest Python requires-python allows): uv (from PyPI)
# resolves the project's dependencies and its [dev] extra with --resolution lowest-direct
# (each dependency pyproject names at its lowest allowed version, what they pull in at
# the newest that fits), and build-system.requires likewise; pip installs that set, then
# the project itself with that setuptools (--no-build-isolation), and pytest runs
# tests/unit. The resolved set is kept in .venv-lowest/lowest.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3.11}
venv=.venv-lowest
start=$SECONDS

command -v "$PY" >/dev/null 2>&1 || { echo "lowest: need $PY on PATH" >&2; exit 2; }
if [ ! -f "$venv/.installed" ] || [ pyproject.toml -nt "$venv/.installed" ]; then
  rm -rf "$venv"
  "$PY" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q 'uv>=0.5,<1'
  "$venv/bin/python" - "$venv/build.in" <<'PYEOF'
import sys, tomllib
reqs = tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]
open(sys.argv[1], "w").write("\n".join(reqs) + "\n")
PYEOF
  uv() { "$venv/bin/uv" pip compile --quiet --no-header --resolution lowest-direct \
           --python "$venv/bin/python" "$@"; }
  uv pyproject.toml --extra dev -o "$venv/lowest.txt"
  uv "$venv/build.in" -o "$venv/build.txt"
  "$venv/bin/pip" install -q -r "$venv/build.txt"
  "$venv/bin/pip" install -q -r "$venv/lowest.txt"
  "$venv/bin/pip" install -q --no-deps --no-build-isolation -e .
  touch "$venv/.installed"
fi
echo "lowest: the direct dependencies at their lower bounds:"
"$venv/bin/python" - <<'PYEOF'
import re, tomllib
from importlib.metadata import version
p = tomllib.load(open("pyproject.toml", "rb"))
reqs = [*p["build-system"]["requires"], *p["project"]["dependencies"],
        *p["project"]["optional-dependencies"]["dev"]]
names = sorted({re.match(r"[A-Za-z0-9_.-]+", r).group(0) for r in reqs}, key=str.lower)
print("  " + ", ".join(f"{n}=={version(n)}" for n in names))
PYEOF
"$venv/bin/pytest" tests/unit -q -p no:cacheprovider
echo "lowest: took $((SECONDS - start)) s"
