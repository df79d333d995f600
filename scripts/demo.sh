#!/usr/bin/env bash
# Quick start, command 1: set up, then run the tier end to end through vLLM's
# orchestrator on ./nvmetier-demo (store, reopen, load, verify) and print figures.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Importing vLLM logs "Failed to import from vllm._C: ModuleNotFoundError(...)":
# expected on this CPU-only install (vLLM without its compiled GPU kernels; only
# its scheduler side runs here), so that one line is dropped from stderr. Every
# other line, and the demo's exit status, pass through.
expected="Failed to import from vllm._C: ModuleNotFoundError(\"No module named 'vllm._C'\")"
{ .venv/bin/python -m nvmetier.demo "$@" 2>&1 1>&3 3>&- \
  | { grep --line-buffered -vxF "$expected" || true; } >&2; } 3>&1
