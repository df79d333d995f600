"""Helpers of the CLI tests: run ``python -m nvmetier.cli`` in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a user would (stdout and stderr piped, not a terminal)."""
    return subprocess.run(
        [sys.executable, "-m", "nvmetier.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
    )


def run_json(*args: str) -> tuple[int, dict[str, Any]]:
    proc = run_cli(*args, "--json")
    return proc.returncode, json.loads(proc.stdout)


def assert_one_line_error(proc: subprocess.CompletedProcess[str]) -> None:
    """A user error: one line on stderr, ``nvmetier: error: ...``, no traceback."""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("nvmetier: error: "), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
