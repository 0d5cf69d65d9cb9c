# Sourced by dev/demo.sh and dev/test.sh: creates .venv from requirements*.txt if it is
# missing or out of date, installs the package in editable mode, and activates it.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo/.venv"
stamp="$venv/.requirements.sha256"
want="$(cat "$repo/requirements.txt" "$repo/requirements-nodeps.txt" "$repo/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "Setting up $venv (one-off, a few minutes)..." >&2
  "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  # --no-compile: byte-compiling every module of TensorFlow, torch and JAX takes longer than installing
  # them; the modules a run imports are compiled then, once (below).
  "$venv/bin/python" -m pip install --quiet --no-compile -r "$repo/requirements.txt"
  "$venv/bin/python" -m pip install --quiet --no-compile --no-deps -r "$repo/requirements-nodeps.txt"
  "$venv/bin/python" -m pip install --quiet --no-compile --no-deps -e "$repo"
  echo "$want" > "$stamp"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
# Imported modules keep their compiled code (in __pycache__, which git ignores), whatever the caller's
# PYTHONDONTWRITEBYTECODE: the suite starts hundreds of processes that import the same frameworks.
unset PYTHONDONTWRITEBYTECODE
cd "$repo"
