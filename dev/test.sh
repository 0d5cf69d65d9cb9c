#!/usr/bin/env bash
# The README's second command: set up the environment if needed, then run the whole
# test suite once per Keras backend, each in its own process (TensorFlow and torch
# must not share a process). Fails if any backend fails. Extra args go to pytest.
. "$(dirname "$0")/env.sh"
failed=()
for backend in tensorflow jax torch; do
  echo "=== KERAS_BACKEND=$backend ==="
  if ! KERAS_BACKEND=$backend XLA_FLAGS="--xla_force_host_platform_device_count=8 ${XLA_FLAGS:-}" \
      python -m pytest -q -p no:cacheprovider "$@"; then
    failed+=("$backend")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED on: ${failed[*]}"
  exit 1
fi
echo "All backends passed."
