#!/usr/bin/env bash
# Build LMCache 0.5.6's CPU-only environment for `nvmetier bench --peers lmcache`.
#
# Usage: tools/peers/setup_lmcache.sh [VENV]   (default: .venv-lmcache in this checkout)
#
# Its OWN virtual environment, never the product's .venv: LMCache pins numpy,
# protobuf, setuptools and transformers versions nvmetier does not want, and
# its wheel requires CUDA packages (cufile-python, cupy-cuda13x, cuda-python)
# that the disk backends never call and this project never installs. The
# steps (nvmetier/bench/peers.py, setup_lmcache): CPU torch 2.13.0 alone
# first, then lmcache==0.5.6 --no-deps and its dependencies by hand minus the
# three CUDA ones (torch held by a constraint), then the raw_block Rust wheel
# lmcache-rust-raw-block-io==0.5.7rc2. `nvmetier bench --peers lmcache` runs
# the same steps itself when the environment is missing.
#
# Exit codes: 0 ready (or already built); 3 a step failed (printed).
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
exec "$here/.venv/bin/python" -m nvmetier.bench.peers setup "$@"
