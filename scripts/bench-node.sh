#!/usr/bin/env bash
# Node scale in one command: the tier level and the vLLM level beside fio at 1,
# 2, 4 and 8 drives (RAM-backed loop drives, or the drives given), one I/O
# worker per drive; a table of GB/s and CPU per GB (stores and loads) per drive
# count, and a JSON file. Made for a machine with many cores and much memory
# that may reach no package registry: it needs Python >= 3.11 and a C compiler,
# and takes what it lacks from a pack made here by scripts/bench-node-pack.sh
# (fio, the wheels the tier level imports, prebuilt extensions).
#
#   scripts/bench-node.sh                  # loop drives (root), counts 1,2,4,8
#   scripts/bench-node.sh --quick          # small runs: a check that it works
#   scripts/bench-node.sh --levels vllm --counts 2,8 --rounds 3   # medians of 3 alternated rounds
#   scripts/bench-node.sh --drives /mnt/nvme0,/mnt/nvme1,/mnt/nvme2,/mnt/nvme3
#   scripts/bench-node.sh --dry-run        # the plan, what is skipped and why
#   (every option: scripts/bench-node.sh --help, after the setup below)
#
# Setup, each step only when needed, all under .bench-node/ (git-ignored):
#   1. the interpreter: $PYTHON, else .venv/bin/python, else the first of
#      python3, python3.13, python3.12, python3.11 that is >= 3.11;
#   2. numpy and xxhash: when the interpreter lacks them, a venv made with
#      `python -m venv --system-site-packages` and the pack's wheels installed
#      into it offline; without venv/ensurepip, the wheels unzipped onto
#      PYTHONPATH instead;
#   3. the extensions: `setup.py build_ext --inplace` (needs Python.h); any of
#      the three that does not import then is copied from the pack's prebuilt
#      ones for this Python version;
#   4. fio: the one on PATH, else the pack's static bin/fio, else none (the
#      fio rows are then missing, and the table says so);
#   5. the vLLM level runs when vLLM imports (e.g. PYTHON=/path/to/vllm-venv/bin/python);
#      else, where the interpreter has torch, from the vLLM carry made by
#      scripts/bench-node-vllm-pack.sh ($BENCH_NODE_VLLM, default .bench-node-vllm/:
#      vLLM's Python files and the wheels they need, unzipped once into
#      .bench-node/vllm-site-TAG and put on PYTHONPATH, with VLLM_TARGET_DEVICE=cpu
#      since it has no CUDA kernels); otherwise it is skipped with the reason in
#      the table and the JSON.
# Environment: PYTHON (the interpreter), BENCH_NODE_PACK (default bench-node-pack),
# BENCH_NODE_VLLM (default .bench-node-vllm).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
pack=${BENCH_NODE_PACK:-$root/bench-node-pack}
state=$root/.bench-node
mkdir -p "$state"
say() { echo "bench-node: $*" >&2; }
die() { say "$*"; exit 2; }

# 1. the interpreter -----------------------------------------------------------
ok_version() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }
py=""
for cand in "${PYTHON:-}" "$root/.venv/bin/python" python3 python3.13 python3.12 python3.11; do
  [ -n "$cand" ] || continue
  path=$(command -v "$cand" 2>/dev/null || true)
  if [ -n "$path" ] && ok_version "$path"; then
    py=$path
    break
  fi
  [ "$cand" = "${PYTHON:-}" ] && die "PYTHON=$PYTHON is not a Python >= 3.11"
done
[ -n "$py" ] || die "no Python >= 3.11 found (python3, python3.13, python3.12, python3.11): install one or set PYTHON"
tag=$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
wheels=$pack/wheels/$tag
extra_path=""

# 2. numpy and xxhash ----------------------------------------------------------
has_deps() { PYTHONPATH="$extra_path" "$1" -c 'import numpy, xxhash' 2>/dev/null; }
if ! has_deps "$py"; then
  venv=$state/venv-$tag
  if [ -x "$venv/bin/python" ] && has_deps "$venv/bin/python"; then
    py=$venv/bin/python
  else
    [ -d "$wheels" ] || die "$py lacks numpy/xxhash and the pack has no wheels for $tag ($wheels): run scripts/bench-node-pack.sh --python ${tag:2:1}.${tag:3} where pip reaches its registry, and carry bench-node-pack/"
    if "$py" -m venv --system-site-packages "$venv" >"$state/venv.log" 2>&1 &&
      "$venv/bin/python" -m pip install -q --upgrade --no-index --find-links "$wheels" \
        numpy xxhash typing_extensions setuptools >>"$state/venv.log" 2>&1; then
      say "made $venv (system site packages, the pack's wheels)"
      py=$venv/bin/python
    else
      say "no venv here ($(tail -1 "$state/venv.log")): unzipping the pack's wheels onto PYTHONPATH"
      rm -rf "$venv" "$state/site-$tag"
      "$py" - "$wheels" "$state/site-$tag" <<'EOF'
import glob, sys, zipfile
for whl in sorted(glob.glob(sys.argv[1] + "/*.whl")):
    zipfile.ZipFile(whl).extractall(sys.argv[2])
EOF
      extra_path=$state/site-$tag
      has_deps "$py" || die "numpy/xxhash still do not import from $extra_path"
    fi
  fi
fi
export PYTHONPATH="$root${extra_path:+:$extra_path}${PYTHONPATH:+:$PYTHONPATH}"

# 3. the extensions ------------------------------------------------------------
imports() { (cd "$root" && "$py" -c "import nvmetier.$1" 2>/dev/null); }
if ! imports _table || ! imports _uring; then
  say "building the extensions with $py (log: .bench-node/build.log)"
  (cd "$root" && "$py" setup.py build_ext --inplace) >"$state/build.log" 2>&1 ||
    say "the build failed ($(grep -m1 -i 'error' "$state/build.log" || tail -1 "$state/build.log"))"
  for ext in _table _uring _crypto; do
    imports "$ext" && continue
    pre=$(ls "$pack/native/$tag/nvmetier.$ext".* "$pack/native/$tag/$ext".*.so 2>/dev/null | head -1 || true)
    if [ -n "$pre" ]; then
      cp "$pre" "$root/nvmetier/"
      imports "$ext" && say "nvmetier.$ext: the pack's prebuilt $(basename "$pre")"
    fi
  done
fi
imports _table || die "nvmetier._table is not built and the pack has none for $tag: install python3-dev (Python.h) or run scripts/bench-node-pack.sh --python ${tag:2:1}.${tag:3} here"
imports _uring || say "nvmetier._uring is not available: the thread engine is used"

# 4. fio -----------------------------------------------------------------------
if ! command -v fio >/dev/null 2>&1 && [ -x "$pack/bin/fio" ]; then
  export PATH="$pack/bin:$PATH"
  say "fio: the pack's $(fio --version 2>/dev/null || echo fio) ($pack/bin/fio)"
fi

# 5. vLLM: the interpreter's own, else the carry's (scripts/bench-node-vllm-pack.sh)
vllm_carry=${BENCH_NODE_VLLM:-$root/.bench-node-vllm}
if ! "$py" -c 'import vllm' 2>/dev/null && [ -f "$vllm_carry/site.zip" ]; then
  carry_tag=$(sed -n 's/^python: \(cp[0-9]*\).*/\1/p' "$vllm_carry/MANIFEST" 2>/dev/null || true)
  if [ "$carry_tag" != "$tag" ]; then
    say "vLLM carry $vllm_carry is for ${carry_tag:-an unknown Python}, not $tag: not used (scripts/bench-node-vllm-pack.sh --python ${tag:2:1}.${tag:3})"
  elif ! "$py" -c 'import torch' 2>/dev/null; then
    say "vLLM carry $vllm_carry not used: $py has no torch"
  else
    vsite=$("$py" "$vllm_carry/unpack.py" "$state/vllm-site-$tag")
    export PYTHONPATH="$PYTHONPATH:$vsite"
    export VLLM_TARGET_DEVICE=${VLLM_TARGET_DEVICE:-cpu}
    say "vLLM: the carry's ($vllm_carry unpacked in $vsite; VLLM_TARGET_DEVICE=$VLLM_TARGET_DEVICE)"
  fi
fi

# 6. the runs (tools/bench_node.py: the plan, the budget, the table) ------------
say "python: $py ($tag)"
exec "$py" "$root/tools/bench_node.py" "$@"
