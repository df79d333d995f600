#!/usr/bin/env bash
# Quick start, command 1: set up, then run the tier end to end through vLLM's
# orchestrator on ./nvmetier-demo (store, reopen, load, verify) and print figures.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m nvmetier.demo "$@"
