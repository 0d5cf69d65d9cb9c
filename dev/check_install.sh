#!/usr/bin/env bash
# Builds the wheel and installs it with each backend extra into a fresh virtual environment, then
# imports the package and runs one step of each optimizer there: what a user's `pip install
# "keras_tpu_optim[jax]"` gets. Needs the package index (not part of the test suite).
#
#   bash dev/check_install.sh                 jax, torch and tensorflow
#   bash dev/check_install.sh jax             one extra
#   EXTRA_PINS="torch==2.13.0" bash dev/check_install.sh torch   pins added to the install
#   bash dev/check_install.sh --keras-nightly [pytest args]   the quick test tier with the next Keras
#
# torch: pass a CPU pin (as above) on a machine without a GPU, or pip takes a multi-GB CUDA build.
#
# --keras-nightly: before widening the `keras` bound in pyproject.toml, runs `dev/test.sh --quick`
# (extra arguments go to pytest) in the dev environment with the Keras release candidate below (or
# KERAS_NIGHTLY) in place of requirements.txt's Keras: installed without dependencies into
# .venv/keras-nightly and put first on PYTHONPATH, the environment itself left as it is. A
# keras-hub nightly built against it (or KERAS_HUB_NIGHTLY) goes there too: requirements-nodeps.txt's
# keras-hub imports private Keras names the next Keras may have dropped (tests/test_real_model.py).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "${1:-}" = "--keras-nightly" ]; then
  shift
  nightlies=("${KERAS_NIGHTLY:-keras-nightly==3.16.0.dev2026102704}"
             "${KERAS_HUB_NIGHTLY:-keras-hub-nightly==0.33.0.dev202610250352}")
  . "$repo/dev/env.sh"
  target="$repo/.venv/keras-nightly"
  # Reinstalled only when the versions asked for are not the ones there.
  for nightly in "${nightlies[@]}"; do
    if ! [ -d "$target/$(echo "${nightly%%==*}" | tr - _)-${nightly##*==}.dist-info" ]; then
      rm -rf "$target"
      python -m pip install --quiet --no-deps --target "$target" "${nightlies[@]}"
      break
    fi
  done
  export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
  # The Keras the tests will import: the one in $target, not the environment's own (the numpy
  # backend: nothing else to import); keras-hub's is checked without importing it (it imports
  # TensorFlow).
  version="$(KERAS_BACKEND=numpy python - "$target" <<'PY'
import importlib.util, os, sys
import keras
target = os.path.abspath(sys.argv[1]) + os.sep
for name, origin in (("keras", keras.__file__), ("keras_hub", importlib.util.find_spec("keras_hub").origin)):
    if not os.path.abspath(origin).startswith(target):
        sys.exit(f"{name} found at {origin}, not in {target}")
print(keras.__version__)
PY
)"
  echo "Keras $version and ${nightlies[1]} from $target"
  status=0
  bash "$repo/dev/test.sh" --quick "$@" || status=$?
  echo "Quick tier with Keras $version: $([ "$status" = 0 ] && echo passed || echo FAILED)"
  exit "$status"
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"${PYTHON:-python3}" -m pip wheel --quiet --no-deps --wheel-dir "$work/dist" "$repo"
wheel="$(ls "$work"/dist/keras_tpu_optim-*.whl)"
extras=("$@")
[ ${#extras[@]} -gt 0 ] || extras=(jax torch tensorflow)
failed=()
for extra in "${extras[@]}"; do
  echo "=== [$extra] ==="
  "${PYTHON:-python3}" -m venv "$work/$extra"
  py="$work/$extra/bin/python"
  # shellcheck disable=SC2086
  if ! "$py" -m pip install --quiet "${wheel}[$extra]" ${EXTRA_PINS:-}; then
    failed+=("$extra (install)"); continue
  fi
  "$py" -m pip list 2>/dev/null | grep -iE "^(keras|jax|jaxlib|torch|tensorflow|tensorflow-cpu|numpy) " || true
  if ! KERAS_BACKEND="$extra" "$py" - <<'PY'
import numpy as np
import keras
import keras_tpu_optim as kto

table = keras.Variable(np.ones((100, 8), "float32"))
kernel = keras.Variable(np.ones((16, 8), "float32"))
gradient = np.zeros((100, 8), "float32")
gradient[[3, 7]] = 1.0
embedding_adam, adafactor = kto.EmbeddingAdam(0.1), kto.Adafactor(0.1)
embedding_adam.apply([keras.ops.convert_to_tensor(gradient)], [table])
adafactor.apply([keras.ops.ones((16, 8))], [kernel])
moved = keras.ops.convert_to_numpy(table)
assert (moved[[3, 7]] < 1).all() and (moved[[0, 1, 99]] == 1).all()
assert (keras.ops.convert_to_numpy(kernel) < 1).all()
print(f"keras_tpu_optim {kto.__version__} on {keras.backend.backend()}: one step of each optimizer")
PY
  then
    failed+=("$extra (step)")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "Every extra installed and stepped."
