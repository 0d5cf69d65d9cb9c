#!/usr/bin/env bash
# The README's first command: set up the environment, then run the package's main job.
. "$(dirname "$0")/env.sh"
exec python -m keras_tpu_optim "$@"
