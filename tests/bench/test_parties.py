"""``nvmetier.bench.parties``: the machine's CPU over a phase split by party
(kernel threads by kind, this process, fio as a child, the rest) and the load
bound of a tier that verifies XXH3. Fake ``/proc`` trees and synthetic phase
results, one short child process; about 0.5 s in all. The loop-drive check
at the end runs fio and needs root; it is skipped elsewhere, with the reason.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import nvmetier
from nvmetier.bench.drives import check_can_make_drives
from nvmetier.bench.parties import (
    MachineShare,
    kernel_thread_cpu,
    kernel_thread_kind,
    load_bounds,
    share_line,
    verified_load_bound,
)
from nvmetier.bench.report import PhaseResult

_KTHREAD = 0x00200000


def _task(root, pid: int, name: str, flags: int, ticks: tuple[int, int], run_ns: int | None):
    d = root / str(pid)
    d.mkdir()
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
    (d / "stat").write_text(
        f"{pid} ({name}) S 2 0 0 0 -1 {flags} 0 0 0 0 {ticks[0]} {ticks[1]} 0 0 20 0 1 0\n"
    )
    if run_ns is not None:
        (d / "schedstat").write_text(f"{run_ns} 0 1\n")


def test_kernel_threads_are_summed_by_kind_and_processes_left_out(tmp_path) -> None:
    tick = os.sysconf("SC_CLK_TCK")
    _task(tmp_path, 40, "kworker/u8:3-loop0", _KTHREAD | 0x40, (0, 0), 300_000_000)
    _task(tmp_path, 41, "kworker/u8:7+iou_exit", _KTHREAD, (0, 0), 200_000_000)
    _task(tmp_path, 14, "ksoftirqd/0", _KTHREAD, (0, 0), 10_000_000)
    # No schedstat (a kernel without schedstats): its ticks count instead.
    _task(tmp_path, 77, "jbd2/loop0-8", _KTHREAD, (0, 2 * tick), None)
    # A process whose name looks like a kernel thread's: not one (no PF_KTHREAD).
    _task(tmp_path, 900, "kworker-lookalike", 0x400100, (500, 500), 9_000_000_000)
    (tmp_path / "950").mkdir()
    (tmp_path / "950" / "stat").write_text("garbage")  # unreadable: skipped
    (tmp_path / "self").mkdir()
    got = kernel_thread_cpu(str(tmp_path))
    assert got == pytest.approx({"kworker": 0.5, "ksoftirqd": 0.01, "jbd2": 2.0})


def test_kernel_thread_kind_drops_the_cpu_and_workqueue() -> None:
    assert kernel_thread_kind("kworker/u8:3-loop0") == "kworker"
    assert kernel_thread_kind("kworker/R-dio/loop1") == "kworker"
    assert kernel_thread_kind("ksoftirqd/1") == "ksoftirqd"
    assert kernel_thread_kind("loop0") == "loop"
    assert kernel_thread_kind("kdamond.0") == "kdamond"


def test_a_child_s_cpu_is_counted_as_the_child_s_not_this_process_s() -> None:
    share = MachineShare()
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    subprocess.run([sys.executable, "-c", burn], check=True)
    got = share.report(10**9)  # per GB = seconds
    assert got["children_cpu_s_per_gb"] >= 0.3
    # This process only waited (and read /proc): far less than the child.
    assert got["process_cpu_s_per_gb"] < got["children_cpu_s_per_gb"]
    # The machine was busy at least while the child burned (10 ms ticks).
    assert got["machine_cpu_s_per_gb"] >= 0.25
    assert got["other_cpu_s_per_gb"] >= 0.0
    assert "fio 0.3" in share_line(got, children="fio")


def test_the_bound_leaves_the_tier_only_its_xxh3_pass() -> None:
    # 2 cores, the drive's kernel threads 0.2 s/GB, XXH3 0.05: 8 GB/s at most.
    assert verified_load_bound(2, 0.2, 10.0, 0.05) == {"gbps": 8.0, "x_fio": 0.8}
    assert verified_load_bound(16, 0.2, 10.0, 0.05) == {"gbps": 64.0, "x_fio": 6.4}
    # A drive whose kernel threads cost nothing (DMA) gives no CPU bound.
    assert verified_load_bound(2, 0.0, 10.0, 0.05) is None
    assert verified_load_bound(2, 0.2, 0.0, 0.05) is None


def _phase(target: str, phase: str, gbps: float, **extra) -> PhaseResult:
    return PhaseResult(
        "vllm",
        target,
        phase,
        2 << 20,
        2 * 10**9,
        2 / gbps,
        954,
        {},
        0.1,
        0.02,
        extra={"round": 0, **extra},
        tier_cpu_s=0.2 if target != "fio" else None,
    )


def test_load_bounds_pair_our_load_with_fio_s_and_split_our_cpu() -> None:
    fio_share = {
        "machine_cpu_s_per_gb": 0.32,
        "kernel_threads_s_per_gb": 0.23,
        "children_cpu_s_per_gb": 0.1,
    }
    ours_share = {"machine_cpu_s_per_gb": 0.45, "kernel_threads_s_per_gb": 0.24}
    ours_share["process_cpu_s_per_gb"] = 0.16
    results = [
        _phase("fio", "write", 5.0, machine_share=fio_share),  # stores: no bound
        _phase("fio", "read", 8.0, machine_share=fio_share),
        _phase(
            "nvmetier-uring",
            "read",
            4.0,
            machine_share=ours_share,
            xxh3_s_per_gb=0.03,
            cpu_profile={"xxh3": {"cold_s_per_gb": 0.07}},
        ),
        _phase("nvmetier-uring", "write", 4.0, machine_share=ours_share, xxh3_s_per_gb=0.03),
    ]
    lines, rows = load_bounds(results, 2)
    (row,) = rows
    assert row["xxh3_pass"] == "cold" and row["xxh3_s_per_gb"] == 0.07
    assert row["bound_gbps"] == pytest.approx(2 / 0.30, abs=1e-3)
    assert row["bound_x_fio"] == pytest.approx(2 / 0.30 / 8.0, abs=1e-3)
    assert row["x_fio"] == 0.5
    assert row["tier_cpu_s_per_gb"] == 0.1  # 0.2 s over 2 GB
    assert row["harness_cpu_s_per_gb"] == pytest.approx(0.06)
    # Free of the machine's other load: fio's CPU bound (its kernel threads +
    # its own 0.06 s/GB in its run) and ours (kernel threads + this process).
    assert row["fio_run_cpu_s_per_gb"] == pytest.approx(0.06)
    assert row["fio_cpu_bound_gbps"] == pytest.approx(2 / 0.29, abs=1e-3)
    assert row["bound_x_fio_cpu"] == pytest.approx(0.29 / 0.30, abs=1e-3)
    assert row["cpu_bound_gbps"] == pytest.approx(5.0)
    assert row["x_fio_cpu"] == pytest.approx(0.29 / 0.40, abs=1e-3)
    assert "0.83x fio's 8.00" in lines[0] and "nvmetier-uring 4.00 GB/s = 0.50x fio" in lines[0]
    assert "kernel threads 0.240, tier 0.100, harness 0.060" in lines[0]
    # Without --profile the warm pass stands in, and says so.
    del results[2].extra["cpu_profile"]
    _, (row,) = load_bounds(results, 2)
    assert row["xxh3_pass"] == "warm" and row["xxh3_s_per_gb"] == 0.03
    # fio without its machine share (an older report): nothing to bound with.
    del results[1].extra["machine_share"]
    assert load_bounds(results, 2) == ([], [])


_WHY = check_can_make_drives() or (None if shutil.which("fio") else "fio is not installed")


@pytest.mark.skipif(_WHY is not None, reason=_WHY or "")
@pytest.mark.timeout(60)
def test_fio_on_loop_drives_shows_the_loop_driver_in_kernel_threads(tmp_path) -> None:
    """On RAM-backed loop drives the copies are the loop driver's kernel
    threads' work: fio's load charges them, and the report bounds our load
    with them; about 4 s."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "nvmetier.cli",
            "bench",
            "--level",
            "tier",
            "--loop-drives",
            "2",
            "--loop-drive-size",
            "256m",
            "--bs",
            "2m",
            "--size",
            "64m",
            "--iodepth",
            "8",
            "--engine",
            "uring",
            "--compare-fio",
            "--profile",
            "--no-drop-caches",
            "--output-format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
        cwd=tmp_path,
        # This tree's nvmetier, not whichever the interpreter has installed.
        env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(nvmetier.__file__))},
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    (fio_load,) = [r for r in report["results"] if r["target"] == "fio" and r["phase"] == "read"]
    share = fio_load["extra"]["machine_share"]
    assert share["kernel_threads_s_per_gb"] > 0
    assert share["kernel_threads_by_kind_s_per_gb"].get("kworker", 0) > 0
    assert share["children_cpu_s_per_gb"] > 0  # fio itself
    (bound,) = report["load_bounds"]
    assert bound["xxh3_pass"] == "cold"
    assert bound["bound_gbps"] > 0 and bound["gbps"] > 0 and bound["fio_cpu_bound_gbps"] > 0
    assert "load bound bs=2MiB" in out.stderr


def test_the_simulated_scheduler_steps_as_often_as_vllm_s_idle_engine() -> None:
    """``--step-ms`` defaults to the pause vLLM's engine core takes after a
    step that ran no model while requests wait on transfers
    (``EngineCoreProc._process_engine_step``), so the bench's scheduler costs
    the drives' cores what vLLM's would. Reads vLLM's source, no import."""
    import importlib.util

    from nvmetier.bench.main import build_parser

    spec = importlib.util.find_spec("vllm")  # finds, imports nothing
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    path = os.path.join(next(iter(spec.submodule_search_locations)), "v1", "engine", "core.py")
    with open(path) as f:
        src = f.read()
    body = src[src.index("def _process_engine_step(") :]
    body = body[: body.index("\n    def ", 1)]
    (pause,) = re.findall(r"time\.sleep\(([0-9.]+)\)", body)
    args = build_parser().parse_args(["--level", "vllm"])
    assert args.step_ms == pytest.approx(float(pause) * 1000.0)
