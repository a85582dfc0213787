#!/usr/bin/env bash
# Makes (or checks) the virtual environment the Python tests run in, the Python part of
# scripts/install-deps.sh:
#   scripts/make-test-venv.sh VENV_DIR 'MODULE ...' PYPI_REQUIREMENT...
# The venv is made with Debian's /usr/bin/python3 (packages python3 and python3-venv) and sees
# its system packages (--system-site-packages), so what Debian 12 ships (python3-numpy) comes
# from apt; pip installs the pinned PyPI requirements into the venv only (Debian's python3 is
# externally managed, PEP 668: pip may not install into it). Then every MODULE must import.
# Idempotent: a venv that already has every pinned version is only checked. Exits non-zero, with
# the reason, when anything fails.
set -euo pipefail

if [ $# -lt 2 ]; then
  echo "usage: $0 VENV_DIR 'MODULE ...' [PYPI_REQUIREMENT...]" >&2
  exit 2
fi
venv=$1 modules=$2
shift 2
base=/usr/bin/python3
py="$venv/bin/python3"

if [ ! -x "$base" ]; then
  echo "make-test-venv: $base is missing (Debian package python3)" >&2
  exit 1
fi
# A venv whose interpreter no longer starts (the base python was replaced) is made again.
if [ -e "$venv" ] && ! "$py" -c 'import sys' 2>/dev/null; then
  echo "make-test-venv: $venv does not start; making it again"
  rm -rf "$venv"
fi
if [ ! -x "$py" ]; then
  echo "make-test-venv: $base -m venv --system-site-packages $venv"
  "$base" -m venv --system-site-packages "$venv"
fi

# The pinned requirements that are not installed at their version (none: nothing to do).
# -s: no user site-packages (~/.local), so only the venv and Debian's packages count.
todo_line=$("$py" -s - "$@" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
todo = []
for req in sys.argv[1:]:
    name, _, want = req.partition("==")
    try:
        if want and version(name) == want:
            continue
    except PackageNotFoundError:
        pass
    todo.append(req)
print(" ".join(todo))
PY
)
read -r -a todo <<<"$todo_line"
if [ ${#todo[@]} -gt 0 ]; then
  echo "make-test-venv: pip install ${todo[*]}"
  PYTHONNOUSERSITE=1 "$py" -m pip install -q --disable-pip-version-check "${todo[@]}"
fi

read -r -a mods <<<"$modules"
"$py" -s -c "import importlib, sys
for m in sys.argv[1:]:
    mod = importlib.import_module(m)
    print(f'  {m} {getattr(mod, \"__version__\", \"?\")} ({mod.__file__})')" "${mods[@]}"
echo "make-test-venv: $py is ready"
