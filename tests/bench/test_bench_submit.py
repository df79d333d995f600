"""tools/bench_submit.py: one store job's and one poll's cost on vLLM's thread.

A smoke run on a real io_uring store (a second or two): it runs, times both
calls in both states, and its ``--skip`` run claims nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("skip", [False, True])
def test_bench_submit_times_jobs_and_polls(tmp_path: Path, skip: bool) -> None:
    pytest.importorskip("nvmetier._uring")
    out = tmp_path / "submit.json"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "bench_submit.py"),
            *("--dir", str(tmp_path / "store"), "--jobs", "40", "--rounds", "1"),
            *("--thrash-mib", "0,1", "--json", str(out)),
            *(["--skip"] if skip else []),
        ],
        capture_output=True,
        text=True,
        timeout=110,
    )
    if r.returncode != 0 and "io_uring" in r.stderr and "not" in r.stderr:
        pytest.skip(f"io_uring unavailable: {r.stderr.strip()[-200:]}")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert set(doc) == {"thrash_0_mib", "thrash_1_mib"}
    for rounds in doc.values():
        (fig,) = rounds
        assert fig["submit_us_per_job"] > 0 and fig["poll_us_per_call"] > 0
    assert "median of 1 rounds" in r.stdout
