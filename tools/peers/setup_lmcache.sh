#!/usr/bin/env bash
# Build LMCache 0.5.6's CPU-only environment for `nvmetier bench --peers lmcache`.
#
# Usage: tools/peers/setup_lmcache.sh [VENV]   (default: .venv-lmcache beside this repo)
#
# Its OWN virtual environment, never the product's .venv: LMCache pins numpy,
# protobuf, setuptools and transformers versions nvmetier does not want, and its
# wheel requires CUDA packages (cufile-python, cupy-cuda13x, cuda-python) that a
# CPU machine neither needs for the disk backends nor may install. So:
#   1. CPU torch 2.13.0 first, alone (`torch==2.13.0` resolves to the local
#      +cpu wheel where one is offered; a constraint keeps every later step on it,
#      so pip never swaps in a CUDA build);
#   2. lmcache==0.5.6 --no-deps, then its declared dependencies minus the three
#      CUDA ones, by hand;
#   3. lmcache-rust-raw-block-io==0.5.7rc2 (the `raw_block` backend's Rust core).
# Idempotent: a stamp file records a finished setup and a rerun exits at once.
# Exit codes: 0 ready; 3 a step failed (the failing step is printed last).
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${1:-$here/.venv-lmcache}"
stamp="$venv/.nvmetier-peers-lmcache-0.5.6"
if [[ -f "$stamp" ]]; then
    echo "setup_lmcache: ready ($venv)"
    exit 0
fi
py="${NVMETIER_PEERS_PYTHON:-}"
if [[ -z "$py" ]]; then
    for c in python3.11 python3; do
        if command -v "$c" >/dev/null 2>&1; then py="$(command -v "$c")"; break; fi
    done
fi
fail() { echo "setup_lmcache: FAILED at: $1" >&2; exit 3; }
[[ -n "$py" ]] || fail "no python3.11/python3 on PATH (set NVMETIER_PEERS_PYTHON)"
"$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    || fail "$py is not Python 3.11 (LMCache 0.5.6's wheels are cp311; set NVMETIER_PEERS_PYTHON)"
"$py" -m venv "$venv" || fail "python -m venv $venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
cons="$venv/nvmetier-constraints.txt"
echo "torch==2.13.0" > "$cons"
"${pip[@]}" "torch==2.13.0" || fail "pip install torch==2.13.0 (CPU build)"
"$venv/bin/python" - <<'PY' || fail "torch is not a CPU build"
import torch, sys
sys.exit(0 if torch.version.cuda is None else 1)
PY
"${pip[@]}" --no-deps "lmcache==0.5.6" || fail "pip install --no-deps lmcache==0.5.6"
# lmcache 0.5.6's Requires-Dist, less cufile-python, cupy-cuda13x and cuda-python.
"${pip[@]}" -c "$cons" \
    aiofile aiofiles blake3 aiohttp awscrt cryptography fastapi httpx \
    "huggingface_hub>=1.5.0" msgspec "numpy<=2.2.6" numba nvtx \
    "opentelemetry-api<=1.40.0,>=1.20.0" "opentelemetry-sdk>=1.20.0" \
    "opentelemetry-exporter-otlp>=1.20.0" \
    "opentelemetry-exporter-prometheus<=0.61b0,>=0.50b0" \
    "prometheus_client<=0.24.1,>=0.18.0" psutil py-cpuinfo pytest pyyaml \
    "pyzmq>=25.0.0" "grpcio>=1.78.0" "grpcio-observability==1.78.0" \
    "protobuf<7,>=6.31.1" redis safetensors "setuptools<81.0.0,>=77.0.3" \
    "setuptools_scm>=8" sortedcontainers "transformers>=5.4" uvicorn httptools \
    cachetools google-api-core google-cloud-bigtable \
    || fail "pip install of lmcache's dependencies"
"${pip[@]}" --no-deps "lmcache-rust-raw-block-io==0.5.7rc2" \
    || fail "pip install --no-deps lmcache-rust-raw-block-io==0.5.7rc2"
"$venv/bin/python" -c "import lmcache, torch; print('lmcache', getattr(lmcache, '__version__', '?'), 'torch', torch.__version__)" \
    || fail "import lmcache"
touch "$stamp"
echo "setup_lmcache: ready ($venv)"
