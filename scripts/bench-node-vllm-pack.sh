#!/usr/bin/env bash
# The vLLM level's carry for a machine that has torch but not vLLM (and may
# reach no package registry): vLLM 0.33.0's Python files, pruned of what the
# scheduler side never imports, and the wheels its import chain needs that such
# a machine lacks (pydantic, msgspec, pyzmq, cbor2, xgrammar, llguidance, ...),
# for one CPython version, all in one zip under 30 MiB. Run it here, where pip
# reaches its registry; scripts/bench-node.sh unpacks it on the big machine.
#
#   scripts/bench-node-vllm-pack.sh                  # -> .bench-node-vllm/ (cp312)
#   scripts/bench-node-vllm-pack.sh --python 3.11 --out /tmp/vllm-carry
#
# Out: OUT/site.zip (unzipped, it is a PYTHONPATH entry), OUT/unpack.py (stdlib
# only: `python3 OUT/unpack.py DEST` unzips it once and prints DEST), and
# OUT/MANIFEST (what is inside, the Python it is for). Unpacked it imports
# vLLM's scheduler side (vllm.v1.kv_offload, vllm.config, ...) with the
# machine's own torch, numpy, transformers; it has none of vLLM's kernels
# (no .so), so it needs VLLM_TARGET_DEVICE=cpu on a GPU machine: vLLM would
# otherwise pick its CUDA platform, whose module imports vllm._C_stable_libtorch.
#
# vLLM's files come from an installed vLLM 0.33.0 when --vllm-site (or
# .venv/bin/python's site-packages) has one, else from the vllm==0.33.0 wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=$root/.bench-node-vllm
pyver=3.12
vllm_site=""
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=$(realpath -m "$2"); shift 2 ;;
    --python) pyver=$2; shift 2 ;;
    --vllm-site) vllm_site=$2; shift 2 ;;
    -h | --help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "bench-node-vllm-pack: unknown option $1 (--out DIR, --python 3.X, --vllm-site DIR)" >&2; exit 2 ;;
  esac
done
case $pyver in 3.1[1-9]) ;; *) echo "bench-node-vllm-pack: --python $pyver: give 3.11 or later (e.g. 3.12)" >&2; exit 2 ;; esac
VLLM_VERSION=0.33.0
# What vLLM 0.33.0's scheduler-side import chain needs beyond a torch machine's
# usual packages (torch, numpy, transformers, tokenizers, psutil, aiohttp,
# pyyaml, requests, regex, filelock, prometheus-client, msgpack, cloudpickle,
# protobuf, pillow, huggingface-hub, einops, anyio, httpx, tiktoken, ...), at
# the versions .venv runs it with.
DEPS=(
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
  msgspec==0.22.0 pyzmq==27.3.0 cbor2==6.2.1 cachetools==8.0.1 pybase64==1.5.1
  fastapi==0.136.3 starlette==1.10.0 openai==3.54.0 httpx2==2.16.2 sniffio==1.3.1
  openai-harmony==0.0.8 partial-json-parser==0.2.1.1.post7
  xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 llguidance==1.9.1
)
PIP_TARGET=(--no-deps --only-binary=:all: --python-version "$pyver" --implementation cp
  --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
py=python3
[ -x "$root/.venv/bin/python" ] && py=$root/.venv/bin/python
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
site=$work/site
mkdir -p "$site" "$work/wheels"

# 1. vLLM's Python files ---------------------------------------------------------
if [ -z "$vllm_site" ] && [ -x "$root/.venv/bin/python" ]; then
  vllm_site=$("$root/.venv/bin/python" - "$VLLM_VERSION" <<'EOF' 2>/dev/null || true
import importlib.metadata as m, sys
d = m.distribution("vllm")
if d.version == sys.argv[1]:
    print(d.locate_file(""))
EOF
)
fi
if [ -n "$vllm_site" ] && [ -f "$vllm_site/vllm/__init__.py" ]; then
  echo "bench-node-vllm-pack: vLLM's files from $vllm_site" >&2
  (cd "$vllm_site" && find vllm "vllm-$VLLM_VERSION.dist-info" \( -name '*.py' -o -name py.typed \
    -o -name METADATA -o -name entry_points.txt -o -name top_level.txt -o -name WHEEL \) \
    -not -path '*/__pycache__/*' -print0 | tar --null -cf - -T -) | tar -xf - -C "$site"
else
  echo "bench-node-vllm-pack: downloading the vllm==$VLLM_VERSION wheel (large)" >&2
  "$py" -m pip download -q "${PIP_TARGET[@]}" -d "$work/vllm-wheel" "vllm==$VLLM_VERSION"
  "$py" - "$work"/vllm-wheel/vllm-*.whl "$site" <<'EOF'
import sys, zipfile
keep = (".py", "/py.typed", "/METADATA", "/entry_points.txt", "/top_level.txt", "/WHEEL")
with zipfile.ZipFile(sys.argv[1]) as z:
    for n in z.namelist():
        if n.endswith(keep) and "__pycache__" not in n:
            z.extract(n, sys.argv[2])
EOF
fi
grep -q "^Version: $VLLM_VERSION\$" "$site/vllm-$VLLM_VERSION.dist-info/METADATA" ||
  { echo "bench-node-vllm-pack: the vLLM files are not version $VLLM_VERSION" >&2; exit 1; }
# What the scheduler side never imports: model code, kernels' Python wrappers
# for FlashAttention, vendored kernel sources, the benchmarks.
v=$site/vllm
rm -rf "$v/models" "$v/vllm_flash_attn" "$v/benchmarks"
find "$v/third_party" -mindepth 1 -maxdepth 1 ! -name __init__.py ! -name pynvml.py -exec rm -rf {} +
find "$v/model_executor/models" -mindepth 1 ! -name __init__.py ! -name registry.py \
  ! -name interfaces.py ! -name interfaces_base.py -exec rm -rf {} +

# 2. the wheels its import chain needs ----------------------------------------------
"$py" -m pip download -q "${PIP_TARGET[@]}" -d "$work/wheels" "${DEPS[@]}"
"$py" - "$site" "$work"/wheels/*.whl <<'EOF'
import sys, zipfile
for whl in sys.argv[2:]:
    zipfile.ZipFile(whl).extractall(sys.argv[1])
EOF
# tvm_ffi (xgrammar's runtime): its C++ sources and headers are for building.
rm -rf "$site/tvm_ffi/3rdparty" "$site/tvm_ffi/include" "$site/tvm_ffi/src" \
  "$site/tvm_ffi/cython" "$site/tvm_ffi/share" "$site/tvm_ffi/CMakeLists.txt"
find "$site" -name RECORD -path '*.dist-info/*' -delete

# 3. one zip, the same bytes for the same inputs -----------------------------------
rm -rf "$out"
mkdir -p "$out"
tag=cp${pyver/./}
"$py" - "$site" "$out/site.zip" <<'EOF'
import os, sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
names = []
for dp, dn, fn in os.walk(src):
    names += [os.path.relpath(os.path.join(dp, f), src) for f in fn]
with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
    for n in sorted(names):
        info = zipfile.ZipInfo(n, date_time=(2020, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_DEFLATED
        info.external_attr = (0o755 if n.endswith((".so",)) or ".so." in n else 0o644) << 16
        with open(os.path.join(src, n), "rb") as f:
            z.writestr(info, f.read(), compresslevel=9)
EOF
{
  echo "python: $tag (CPython $pyver, manylinux x86_64)"
  echo "vllm: $VLLM_VERSION (Python files only, pruned: models/, vllm_flash_attn/, benchmarks/, third_party/ but pynvml, model_executor/models/ but the registry)"
  echo "wheels: ${DEPS[*]}"
  echo "env: VLLM_TARGET_DEVICE=cpu (no CUDA kernels carried)"
} >"$out/MANIFEST"
cat >"$out/unpack.py" <<'EOF'
"""Unzip site.zip (beside this file) into DEST once; print DEST.

python3 unpack.py DEST  -- then PYTHONPATH=DEST VLLM_TARGET_DEVICE=cpu.
Standard library only; redoes the unzip when site.zip changed.
"""

import os
import shutil
import sys
import zipfile

here = os.path.dirname(os.path.abspath(__file__))
dest = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "site"))
src = os.path.join(here, "site.zip")
st = os.stat(src)
stamp = f"{st.st_size} {int(st.st_mtime)}\n"
stamp_path = os.path.join(dest, ".unpacked")
if not (os.path.exists(stamp_path) and open(stamp_path).read() == stamp):
    shutil.rmtree(dest, ignore_errors=True)
    with zipfile.ZipFile(src) as z:
        z.extractall(dest)
        for info in z.infolist():
            mode = info.external_attr >> 16
            if mode:
                os.chmod(os.path.join(dest, info.filename), mode)
    with open(stamp_path, "w") as f:
        f.write(stamp)
print(dest)
EOF
size=$(stat -c %s "$out/site.zip")
echo "bench-node-vllm-pack: $out: $(du -sh "$out" | cut -f1) ($tag; site.zip $((size >> 20)) MiB)" >&2
[ "$size" -le $((30 << 20)) ] || echo "bench-node-vllm-pack: warning: site.zip is over 30 MiB" >&2
