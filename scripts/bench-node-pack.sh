#!/usr/bin/env bash
# Prepare what scripts/bench-node.sh needs on a machine that reaches no package
# registry: a folder (default bench-node-pack/, git-ignored) to carry beside the
# working tree. Run here, where apt and pip reach their registries:
#
#   bin/fio             fio built from Debian's fio source as one static
#                       executable (io_uring, psync; no rados/rdma/gluster/pmem:
#                       the packaged fio's shared libraries come to ~80 MiB)
#   wheels/cpXY/        numpy, xxhash, typing_extensions and setuptools wheels
#                       (manylinux x86_64) for each Python version asked for:
#                       what the tier level imports (bench/*.py, store.py) and
#                       what building the extensions needs
#   native/cpXY/        nvmetier's three extensions prebuilt for that Python
#                       (liburing linked statically), used where the machine
#                       cannot build them (no Python.h, no liburing-dev)
#   MANIFEST.txt        what is in it, its versions and sizes
#
# The folder must stay under 64 MiB (what the device tool carries); numpy is
# ~16 MiB a Python version, so the default is two versions.
#
# Usage: scripts/bench-node-pack.sh [--out DIR] [--python 3.11,3.12] [--fio PATH]
#   --fio PATH: carry this fio instead of building one (it must be static).
# Needs: apt-get (for fio's source), a C compiler and make, pip (of --pip-python,
# default .venv/bin/python or python3), and pyenv or pythonX.Y for each version
# whose extensions are prebuilt (versions without one get wheels only).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=bench-node-pack
pyvers=""
fio_src=""
pip_py=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=$2; shift 2 ;;
    --python) pyvers=$2; shift 2 ;;
    --fio) fio_src=$2; shift 2 ;;
    --pip-python) pip_py=$2; shift 2 ;;
    -h|--help) sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench-node-pack: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$pip_py" ]; then
  if [ -x .venv/bin/python ]; then pip_py=.venv/bin/python; else pip_py=python3; fi
fi
if [ -z "$pyvers" ]; then
  local_ver=$("$pip_py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  pyvers=$local_ver
  [ "$local_ver" = 3.12 ] || pyvers="$pyvers,3.12"
fi
limit=$((64 << 20))
work=$(mktemp -d "${TMPDIR:-/tmp}/bench-node-pack.XXXXXX")
trap 'rm -rf "$work"' EXIT
rm -rf "$out"
mkdir -p "$out/bin" "$out/wheels" "$out/native"
log() { echo "bench-node-pack: $*" >&2; }

# --- fio ---------------------------------------------------------------------
fio_note=""
if [ -n "$fio_src" ]; then
  cp "$fio_src" "$out/bin/fio"
  fio_note="copied from $fio_src"
else
  log "fio: fetching Debian's fio source with apt-get (a private source list, nothing system-wide changes)"
  apt="$work/apt"
  mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/src"
  codename=$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-bookworm}")
  if [ -r /etc/os-release ] && grep -qi ubuntu /etc/os-release; then
    echo "deb-src http://archive.ubuntu.com/ubuntu $codename universe" >"$apt/src.list"
  else
    echo "deb-src http://deb.debian.org/debian $codename main" >"$apt/src.list"
  fi
  aopt=(-o "Dir::Etc::SourceList=$apt/src.list" -o "Dir::Etc::SourceParts=/nonexistent"
    -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache")
  if apt-get "${aopt[@]}" update >"$work/apt.log" 2>&1 &&
    (cd "$apt/src" && apt-get "${aopt[@]}" source --download-only fio >>"$work/apt.log" 2>&1); then
    tar -C "$work" -xzf "$apt"/src/fio_*.orig.tar.gz
    fdir=$(ls -d "$work"/fio-*/ | head -1)
    log "fio: building $(basename "$fdir") static (a minute or two)"
    if (cd "$fdir" && ./configure --build-static --disable-native --disable-numa --disable-rdma \
      --disable-rados --disable-rbd --disable-http --disable-gfapi --disable-pmem \
      --disable-xnvme --disable-libzbc --disable-tcmalloc --disable-dfs --disable-shm &&
      make -j"$(nproc)") >"$work/fio-build.log" 2>&1; then
      strip -o "$out/bin/fio" "$fdir/fio"
      fio_note="$(basename "$fdir") from Debian's source, static (ldd: not a dynamic executable)"
    else
      tail -20 "$work/fio-build.log" >&2
      log "fio: the build failed; the pack has no fio (bench-node.sh then uses one on PATH)"
    fi
  else
    tail -5 "$work/apt.log" >&2
    log "fio: no source reachable; the pack has no fio (bench-node.sh then uses one on PATH)"
  fi
fi
if [ -x "$out/bin/fio" ]; then
  "$out/bin/fio" --version >/dev/null || { log "fio: $out/bin/fio does not run"; exit 1; }
  case "$(file -b "$out/bin/fio" 2>/dev/null || echo static)" in
    *dynamic*) log "warning: $out/bin/fio is dynamically linked: it needs its libraries there" ;;
  esac
fi

# --- wheels ------------------------------------------------------------------
# The versions the local environment runs (tested together), else the newest.
pins=$("$pip_py" - <<'EOF'
import importlib.metadata as m
out = []
for name, floor in (("numpy", ">=1.26"), ("xxhash", ">=3.4"), ("typing_extensions", ">=4.4")):
    try:
        out.append(f"{name}=={m.version(name)}")
    except m.PackageNotFoundError:
        out.append(name + floor)
# setuptools reads pyproject.toml's SPDX license from 77 on: never older.
print(" ".join([*out, "setuptools>=77"]))
EOF
)
IFS=, read -r -a versions <<<"$pyvers"
built=()
for v in "${versions[@]}"; do
  tag="cp${v/./}"
  log "wheels for Python $v: $pins"
  mkdir -p "$out/wheels/$tag"
  # shellcheck disable=SC2086
  if ! "$pip_py" -m pip download -q --only-binary=:all: --python-version "$v" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$out/wheels/$tag" $pins 2>"$work/pip.log"; then
    # A pin with no wheel for that version: take the newest that has one.
    log "  (no wheels of those exact versions for $v: taking the newest)"
    "$pip_py" -m pip download -q --only-binary=:all: --python-version "$v" --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$out/wheels/$tag" \
      "numpy>=1.26" "xxhash>=3.4" "typing_extensions>=4.4" "setuptools>=77"
  fi
  # --- the extensions, prebuilt for this version -----------------------------
  vpy=""
  for cand in "$(command -v pyenv >/dev/null && pyenv prefix "$v" 2>/dev/null | head -1)/bin/python$v" \
    "$(command -v "python$v" || true)"; do
    if [ -x "$cand" ] && "$cand" -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' 2>/dev/null; then
      vpy=$cand
      break
    fi
  done
  if [ -z "$vpy" ]; then
    log "  no Python $v with headers here: no prebuilt extensions for $tag"
    continue
  fi
  log "  building the extensions with $vpy"
  "$vpy" -m venv "$work/venv-$tag"
  "$work/venv-$tag/bin/pip" install -q --upgrade --no-index --find-links "$out/wheels/$tag" setuptools
  rm -rf "$work/src-$tag"
  mkdir -p "$work/src-$tag"
  git ls-files -z setup.py pyproject.toml native nvmetier | xargs -0 cp --parents -t "$work/src-$tag"
  if (cd "$work/src-$tag" && NVMETIER_REQUIRE_NATIVE=1 "$work/venv-$tag/bin/python" setup.py -q \
    build_ext --inplace) >"$work/build-$tag.log" 2>&1; then
    mkdir -p "$out/native/$tag"
    cp "$work/src-$tag"/nvmetier/_*.so "$out/native/$tag/"
    strip --strip-unneeded "$out/native/$tag"/*.so
    built+=("$tag")
  else
    tail -20 "$work/build-$tag.log" >&2
    log "  the build for $tag failed: no prebuilt extensions for it"
  fi
done

# --- manifest and size -------------------------------------------------------
{
  echo "bench-node-pack made $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -srm), $(ldd --version 2>&1 | head -1)"
  echo "from nvmetier $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo "fio: ${fio_note:-none}"
  echo "python versions: $pyvers (extensions prebuilt for: ${built[*]:-none})"
  echo "files:"
  (cd "$out" && find . -type f ! -name MANIFEST.txt -printf '  %p %s\n' | sort)
} >"$out/MANIFEST.txt"
total=$(du -sb "$out" | cut -f1)
echo "total: $total bytes" >>"$out/MANIFEST.txt"
cat "$out/MANIFEST.txt"
if [ "$total" -gt "$limit" ]; then
  log "the pack is $((total >> 20)) MiB, over the 64 MiB a device run carries: ask for fewer --python versions"
  exit 1
fi
log "ready: $out ($((total >> 20)) MiB); carry it with the working tree and run scripts/bench-node.sh"
