"""``nvmetier bench --loop-drives``: RAM-backed loop drives are made, used and
always removed (normal end and SIGTERM). Needs root, losetup and mkfs.ext4;
skipped otherwise, with the reason."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from nvmetier.bench.drives import check_can_make_drives

_WHY = check_can_make_drives()
pytestmark = [
    pytest.mark.skipif(_WHY is not None, reason=_WHY or ""),
    pytest.mark.timeout(180),
]


def _left_behind(base: str) -> list[str]:
    """Mounts and loop devices that still refer to ``base``."""
    with open("/proc/mounts") as f:
        mounts = [line.split()[1] for line in f if base in line]
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True, check=False).stdout
    return mounts + [line for line in loops.splitlines() if base in line]


def _cmd(tmp_path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "nvmetier.cli",
        "bench",
        "--loop-drives",
        "2",
        "--loop-drive-size",
        "256m",
        "--no-drop-caches",
        *extra,
    ]


def test_loop_drives_are_used_and_removed(tmp_path) -> None:
    out = subprocess.run(
        [
            *_cmd(tmp_path),
            "--level",
            "tier",
            "--bs",
            "64k",
            "--size",
            "4m",
            "--iodepth",
            "4",
            "--output-format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    dirs = report["params"]["dirs"]
    assert len(dirs) == 2
    assert all(r["errors"] == 0 and r["bytes"] > 0 for r in report["results"])
    base = os.path.dirname(dirs[0])
    assert "loop drives removed" in out.stderr
    assert not os.path.exists(base)
    assert _left_behind(base) == []


def test_loop_drives_are_removed_on_sigterm(tmp_path) -> None:
    proc = subprocess.Popen(
        [*_cmd(tmp_path), "--level", "tier", "--bs", "64k", "--size", "64m", "--iodepth", "4"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    assert proc.stdout is not None
    base = None
    for line in proc.stdout:
        m = re.search(r" at (\S+)/drive0", line)
        if m:
            base = m.group(1)
            break
    assert base, "the bench never reported its drives"
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    rest = proc.stdout.read()
    assert proc.wait(timeout=60) in (130, 0)  # 0: it finished before the signal
    assert "loop drives removed" in rest
    deadline = time.monotonic() + 10  # lazily detached mounts go once we exit
    while _left_behind(base) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _left_behind(base) == []
