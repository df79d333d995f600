#!/usr/bin/env bash
# The native code under sanitizers (called by scripts/test.sh; also on its own).
#
# 1. The C core test (tests/native/c/test_core.c) built with
#    -fsanitize=address,undefined, then with -fsanitize=thread.
# 2. A copy of the tree whose extensions (nvmetier._table, nvmetier._uring)
#    are built with -fsanitize=address,undefined (NVMETIER_SANITIZE, see
#    setup.py), and the native and table tests run on it (those that take
#    the default engine once more with io_uring as the default), with the
#    sanitizer runtime preloaded into CPython. Leak checking is off:
#    CPython itself does not free everything at exit. Any report fails the run
#    (-fno-sanitize-recover=all, halt_on_error).
# 3. The same with -fsanitize=thread, on the io_uring engine's tests only
#    (the native threads of the code base are the engine's I/O threads, which
#    also apply completions to the shared table: tests/native/test_uring_apply.py).
#
# Needs gcc with its sanitizer runtimes; without them the step is skipped
# with a message, never failed. Takes 2-3 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$PWD/.venv/bin/python}
CC=${CC:-gcc}
export PYTHONDONTWRITEBYTECODE=1

runtime() { # the sanitizer runtime gcc links against, or nothing
  local lib
  lib=$("$CC" -print-file-name="$1" 2>/dev/null) || return 0
  [ -e "$lib" ] && echo "$lib"
  return 0
}
ASAN_LIB=$(runtime libasan.so)
TSAN_LIB=$(runtime libtsan.so)
if ! command -v "$CC" >/dev/null || [ -z "$ASAN_LIB" ]; then
  echo "=== sanitizers: no $CC with libasan here: skipped ==="
  exit 0
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/nvmetier-sanitize-XXXXXX")
trap 'rm -rf "$work"' EXIT

# Reports go to stderr, which pytest leaves alone (--capture=sys: a halted
# process would lose what an fd-level capture holds).
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1

echo "=== sanitizers: C core test (address,undefined; thread) ==="
NVMETIER_SANITIZE=address,undefined "$PY" -m pytest -q -p no:cacheprovider tests/native/test_core_c.py
if [ -n "$TSAN_LIB" ]; then
  NVMETIER_SANITIZE=thread "$PY" -m pytest -q -p no:cacheprovider tests/native/test_core_c.py
fi

# A copy of the tree (tracked and new files), built in place with $1.
sanitized_tree() {
  local dir="$work/$2"
  mkdir -p "$dir"
  git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$dir" 2>/dev/null || true
  (cd "$dir" && NVMETIER_SANITIZE=$1 NVMETIER_REQUIRE_NATIVE=1 \
    "$PY" setup.py -q build_ext --inplace >"$work/$2.build.log" 2>&1) \
    || { cat "$work/$2.build.log" >&2; return 1; }
  echo "$dir"
}

# pytest on a sanitized tree, its runtime preloaded; checks that the
# sanitized modules are the ones imported.
run_tests() {
  local dir=$1 lib=$2 engine=$3; shift 3
  local so
  for so in "$dir"/nvmetier/_table.*.so "$dir"/nvmetier/_uring.*.so; do
    [ -e "$so" ] || continue
    nm -D "$so" >"$work/symbols"
    grep -q "__[at]san_" "$work/symbols" || { echo "sanitize: $so is not sanitized" >&2; exit 1; }
  done
  (cd "$dir" && PYTHONPATH="$dir" LD_PRELOAD="$lib" NVMETIER_ENGINE=$engine "$PY" - <<'EOF'
import importlib, os
for name in ("nvmetier._table", "nvmetier._uring"):
    try:
        mod = importlib.import_module(name)
    except ImportError:
        assert name == "nvmetier._uring"  # optional: the uring runs are skipped
        continue
    assert mod.__file__.startswith(os.getcwd()), f"{name} imported from {mod.__file__}"
EOF
  )
  (cd "$dir" && PYTHONPATH="$dir" LD_PRELOAD="$lib" NVMETIER_ENGINE=$engine \
    "$PY" -m pytest -q -p no:cacheprovider --capture=sys "$@")
}

TABLE_TESTS=(tests/native tests/unit/test_table_model.py tests/unit/test_table_snapshot.py
  tests/unit/test_table_header.py tests/unit/test_table_alloc_failure.py tests/unit/test_table_worker_apply.py
  tests/unit/test_table_contains_many.py tests/unit/test_chunk_run.py tests/unit/test_hot_request.py
  tests/unit/test_table_swar.py tests/unit/test_tier_calls.py tests/unit/test_table_refresh.py
  tests/unit/test_table_lease_takeover.py tests/unit/test_lease_takeover_attacks.py tests/unit/test_guard_call.py
  tests/integration/test_done_hint.py
  tests/integration/test_job_path.py tests/integration/test_engines.py tests/fault/test_fault_fork.py
  tests/integration/test_engine_sealing.py tests/integration/test_job_events_attacks.py
  tests/integration/test_engine_hash_builds.py)

echo "=== sanitizers: extensions built with address,undefined ==="
asan=$(sanitized_tree address,undefined asan)
run_tests "$asan" "$ASAN_LIB" threads "${TABLE_TESTS[@]}" --deselect tests/native/test_core_c.py
if "$PY" -c "import sys; from nvmetier.engine import uring_status; sys.exit(0 if uring_status()[0] else 1)"; then
  # Again with io_uring as the default engine: what the engine choice reaches.
  # The native, job-path, engine and sealing tests build both engines
  # themselves and already ran under the sanitizer above.
  run_tests "$asan" "$ASAN_LIB" uring tests/fault/test_fault_fork.py
  if [ -n "$TSAN_LIB" ]; then
    echo "=== sanitizers: io_uring engine built with thread ==="
    tsan=$(sanitized_tree thread tsan)
    run_tests "$tsan" "$TSAN_LIB" uring tests/native/test_uring.py tests/native/test_uring_workers.py \
      tests/native/test_uring_apply.py tests/integration/test_engine_sealing.py
  fi
else
  echo "=== sanitizers: io_uring unusable here: its sanitized runs are skipped ==="
fi
echo "=== sanitizers: clean ==="
