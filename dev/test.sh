#!/usr/bin/env bash
# The README's second command: set up the environment if needed, then run the test suite once
# per Keras backend, each in its own processes (TensorFlow and torch must not share one), with
# pytest-xdist workers. Fails if any backend fails. Prints each pass's wall time and its 15
# slowest tests, then the total.
#
#   bash dev/test.sh            every test, on TensorFlow, JAX and torch (what CI runs)
#   bash dev/test.sh --quick    the unit tests only (no subprocesses, multi-process jobs, demo or benchmarks, nor
#                               the `slow` tests: whole training runs and torch.compile traces),
#                               each parametrized test in as many cases as run every parameter value once;
#                               JAX's and TF's XLA programs are kept in .test-cache/ for the next run
#
# Extra arguments go to pytest (`bash dev/test.sh -k adafactor`). TEST_WORKERS sets the number
# of xdist workers per pass (default 2, this machine's cores; 0 runs in the pytest process).
start=$(date +%s)
. "$(dirname "$0")/env.sh"
echo "environment ready after $(( $(date +%s) - start )) s"
selection=()
quick=""
if [ "${1:-}" = "--quick" ]; then
  shift
  quick=1
  selection=(tests -m "not processes and not slow" --each-value-once)
fi
workers="${TEST_WORKERS:-2}"
parallel=()
if [ "$workers" != "0" ]; then
  # worksteal: an idle worker takes queued tests from a busy one (test times range from ms to minutes).
  parallel=(-n "$workers" --dist worksteal)
fi
# Test-run settings, not the package's: XLA's CPU code generated without LLVM's optimisations,
# its fusion emitters or its expensive passes (the tests' tensors are tiny; compiling is most of
# their time) and in one piece (XLA splits a program's LLVM module into parts compiled on a thread pool, which on two
# cores busy with two workers only adds work), and one JAX compilation cache for the run, shared
# by the workers and the processes tests start (identical programs compile once).
export XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 --xla_cpu_parallel_codegen_split_count=1 --xla_cpu_use_fusion_emitters=false --xla_llvm_disable_expensive_passes=true ${XLA_FLAGS:-}"
if [ -n "$quick" ]; then
  # The quick tier keeps its compiled programs between runs (JAX's and TF's XLA caches, in the
  # ignored .test-cache/): a rerun compiles only what changed. One folder per environment and
  # XLA_FLAGS (TF's cache key holds neither), the others removed; emptied past 1 GiB.
  key="$(printf '%s %s' "$(cat "$stamp")" "$XLA_FLAGS" | sha256sum | cut -c1-12)"
  cache="$repo/.test-cache/$key"
  find "$repo/.test-cache" -mindepth 1 -maxdepth 1 ! -name "$key" -exec rm -rf {} + 2>/dev/null || true
  if [ -d "$cache" ] && [ "$(du -sm "$cache" | cut -f1)" -gt 1024 ]; then rm -rf "$cache"; fi
  mkdir -p "$cache/jax" "$cache/tf-xla" "$cache/inductor"
  JAX_COMPILATION_CACHE_DIR="$cache/jax"
  TORCHINDUCTOR_CACHE_DIR="$cache/inductor"
  export TF_XLA_FLAGS="--tf_xla_persistent_cache_directory=$cache/tf-xla ${TF_XLA_FLAGS:-}"
else
  # The full tier (what CI runs) starts from nothing, every time (torch's inductor too, whose cache
  # otherwise lives in the system's temporary folder from one run to the next).
  caches="$(mktemp -d)"
  trap 'rm -rf "$caches"' EXIT
  JAX_COMPILATION_CACHE_DIR="$caches/jax"
  TORCHINDUCTOR_CACHE_DIR="$caches/inductor"
fi
export TORCHINDUCTOR_CACHE_DIR JAX_COMPILATION_CACHE_DIR JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
failed=()
for backend in tensorflow jax torch; do
  echo "=== KERAS_BACKEND=$backend ==="
  pass_start=$(date +%s)
  if ! KERAS_BACKEND=$backend python -m pytest -q -p no:cacheprovider --durations=15 "${parallel[@]}" "${selection[@]}" "$@"; then
    failed+=("$backend")
  fi
  echo "=== KERAS_BACKEND=$backend: $(( $(date +%s) - pass_start )) s ==="
done
echo "Total: $(( $(date +%s) - start )) s (environment included)"
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED on: ${failed[*]}"
  exit 1
fi
echo "All backends passed."
