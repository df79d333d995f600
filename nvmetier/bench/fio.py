"""fio beside our engines: the best ioengine that works here, and a run with our parameters.

Owns: ``fio_engine`` (probe) and ``run_fio``. Runs fio as a subprocess and
blocks until it exits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable

from nvmetier.bench.common import PCTS, _note_drop, _phases, _prealloc
from nvmetier.bench.machine import busy_cores, machine_cpu
from nvmetier.bench.parties import MachineShare, share_line
from nvmetier.bench.report import PhaseResult, _phase_line


def fio_engine(directory: str) -> tuple[str | None, list[str], str]:
    """The best fio ioengine that works here: io_uring+fixedbufs, libaio, psync."""
    if shutil.which("fio") is None:
        return None, [], "fio is not installed"
    probe = os.path.join(directory, "fio-probe.dat")
    try:
        for engine, extra in (
            ("io_uring", ["--fixedbufs=1"]),
            ("io_uring", []),
            ("libaio", []),
            ("psync", []),
        ):
            cmd = [
                "fio",
                "--name=probe",
                f"--ioengine={engine}",
                *extra,
                f"--filename={probe}",
                "--size=1m",
                "--bs=64k",
                "--rw=write",
                "--direct=1",
                "--output-format=json",
            ]
            r = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if r.returncode == 0:
                return engine, extra, " ".join([f"--ioengine={engine}", *extra])
        return None, [], "fio failed with io_uring, libaio and psync"
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(probe)


def run_fio(
    args: argparse.Namespace,
    bs: int,
    rw: str,
    rand_pattern: bool,
    engine: str,
    extra: list[str],
    log: Callable,
    level: str,
) -> list[PhaseResult]:
    """fio on fresh fallocated files, same bs/iodepth/size/direct/numjobs.

    With several drives (``args.dirs``, e.g. ``--loop-drives``) fio runs one
    job section per drive (``--numjobs`` jobs each), and ``--size`` is split
    between the drives so that fio moves the bytes the tier moves.
    """
    dirs = list(getattr(args, "dirs", None) or [args.dir])
    size = args.size // len(dirs) // bs * bs
    paths = [
        os.path.join(d, f"fiobench{i}.{j}.0")
        for i, d in enumerate(dirs)
        for j in range(args.numjobs)
    ]
    rand = "rand" if rand_pattern else ""
    results: list[PhaseResult] = []
    try:
        for p in paths:
            _prealloc(p, size)
        for phase, timed in _phases(rw):
            if phase == "read" and timed:
                _note_drop(args, log)
            fio_rw = rand + ("write" if phase == "write" else "read")
            cmd = [
                "fio",
                f"--ioengine={engine}",
                *extra,
                f"--rw={fio_rw}",
                f"--bs={bs}",
                f"--iodepth={args.iodepth}",
                f"--size={size}",
                f"--direct={args.direct}",
                f"--numjobs={args.numjobs}",
                "--group_reporting",
                "--percentile_list=50:90:99:99.9",
                "--output-format=json",
                "--randrepeat=0",
            ]
            if args.runtime > 0:
                cmd.append(f"--runtime={args.runtime}")
            # Options above are global; one job section per drive.
            for i, d in enumerate(dirs):
                cmd += [f"--name=fiobench{i}", f"--directory={d}"]
            m0 = machine_cpu()
            share = MachineShare()
            r = subprocess.run(cmd, capture_output=True, text=True, check=False)
            busy = busy_cores(m0, machine_cpu())
            if r.returncode != 0:
                raise RuntimeError(f"fio failed ({r.returncode}): {r.stderr.strip()[:500]}")
            job = json.loads(r.stdout[r.stdout.index("{") :])["jobs"][0]
            if not timed:
                continue
            side = job["write" if phase == "write" else "read"]
            runtime_s = job["job_runtime"] / 1000.0 / max(1, args.numjobs * len(dirs))
            runtime_s = side["io_bytes"] / side["bw_bytes"] if side["bw_bytes"] else runtime_s
            pct = side.get("clat_ns", {}).get("percentile", {})
            clat: dict[str, float] = {}
            for pc in PCTS:
                v = pct.get(f"{pc:.6f}")
                if v is not None:
                    clat[f"p{pc:g}"] = float(v)
            cpu_total = job["job_runtime"] / 1000.0
            res = PhaseResult(
                level=level,
                target="fio",
                phase=phase,
                bs=bs,
                bytes=int(side["io_bytes"]),
                runtime_s=runtime_s,
                ops=int(side["total_ios"]),
                clat_ns=clat,
                cpu_usr_s=job["usr_cpu"] / 100.0 * cpu_total,
                cpu_sys_s=job["sys_cpu"] / 100.0 * cpu_total,
                errors=int(job.get("error", 0)),
                extra={
                    "cmd": " ".join(cmd),
                    "rw": fio_rw,
                    "drives": len(dirs),
                    # over fio's whole run, its start and the untimed file layout included
                    "machine_busy_cores": round(busy, 2),
                    # the same span, by party: the drives' kernel threads, fio, the rest
                    "machine_share": share.report(int(side["io_bytes"])),
                },
            )
            log(_phase_line(res))
            log(share_line(res.extra["machine_share"], children="fio"))
            results.append(res)
    finally:
        if not args.keep:
            for p in paths:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
    return results
