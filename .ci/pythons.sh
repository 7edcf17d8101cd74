#!/usr/bin/env bash
# `make pythons`: the unit tests on every other Python that pyproject's requires-python
# claims (default 3.12 3.13; `make test` runs 3.11), each in its own venv, .venv-X.Y, with
# the project and its [dev] extra installed from pyproject.toml.
#
# An interpreter is looked for as pythonX.Y on PATH, then under pyenv's versions folder
# (pyenv's shim for a version that is not the selected one answers "command not found").
# A missing one is skipped with a message; with CI=true it is an error, because the
# machine image CI runs on (python-svc) ships 3.12 and 3.13 under pyenv: a CI run without
# them is a broken image, and a silent skip would claim support that was never tested.
set -uo pipefail
cd "$(dirname "$0")/.."

find_python() {  # X.Y -> prints the path of a working pythonX.Y
  local v=$1 c root
  root=${PYENV_ROOT:-$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")}
  local check="import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$v'.split('.'))))"
  if c=$(command -v "python$v") && "$c" -c "$check" >/dev/null 2>&1; then
    echo "$c"; return 0
  fi
  while read -r c; do
    if [ -n "$c" ] && "$c" -c "$check" >/dev/null 2>&1; then echo "$c"; return 0; fi
  done < <(ls -d "$root"/versions/"$v".*/bin/python"$v" 2>/dev/null | sort -V -r)
  return 1
}

versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(3.12 3.13)
status=0
for v in "${versions[@]}"; do
  start=$SECONDS
  if ! py=$(find_python "$v"); then
    if [ "${CI:-}" = true ]; then
      echo "pythons: python$v not found (PATH, pyenv); CI=true requires it" >&2
      status=1
    else
      echo "pythons: SKIPPED python$v: not found on PATH nor under pyenv"
    fi
    continue
  fi
  venv=.venv-$v
  if [ ! -f "$venv/.installed" ] || [ pyproject.toml -nt "$venv/.installed" ] \
      || ! "$venv/bin/python" -c 'import sys' >/dev/null 2>&1; then
    echo "pythons: building $venv with $py"
    rm -rf "$venv"
    if ! { "$py" -m venv "$venv" && "$venv/bin/pip" install -q --upgrade pip \
           && "$venv/bin/pip" install -q -e '.[dev]' && touch "$venv/.installed"; }; then
      echo "pythons: installing into $venv failed" >&2
      status=1
      continue
    fi
  fi
  echo "pythons: unit tests on $("$venv/bin/python" -V)"
  "$venv/bin/pytest" tests/unit -q -p no:cacheprovider || status=1
  echo "pythons: python$v took $((SECONDS - start)) s"
done
exit $status
