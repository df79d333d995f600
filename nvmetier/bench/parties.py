"""Who used the machine's CPU over one phase: kernel threads, this process, fio, the rest.

Owns ``kernel_thread_cpu`` (the run time of every kernel thread on the
machine, by kind: the workqueue workers that run a loop drive's copies, the
softirq threads, ...), ``MachineShare`` (one phase's machine CPU split by
party, per GB moved) and ``verified_load_bound`` (the best load bandwidth any
tier that verifies an XXH3 checksum could reach on these cores, from fio's
kernel cost and one XXH3 pass). Called from the benchmark's thread around a
timed phase; reads ``/proc`` (a few hundred small files) and never blocks
otherwise. Linux only: elsewhere the figures read zero.

On a RAM-backed loop drive the "device" is a kernel thread copying between
the image file and the caller's pages (``kworker/uN:M-loopK``); on a real
NVMe drive the DMA engine does that copy and the kernel threads cost next to
nothing. ``machine_busy_cores`` alone cannot tell the two apart; the
kernel-thread share per GB can, and it is the part of fio's own run that no
tier can avoid.
"""

from __future__ import annotations

import contextlib
import os
import resource
from typing import Any

from nvmetier.bench.common import _bs
from nvmetier.bench.machine import machine_cpu

GB = 1e9
_PF_KTHREAD = 0x00200000


def kernel_thread_kind(name: str) -> str:
    """The kind of a kernel thread from its name: ``kworker`` (workqueue
    workers; a worker's name shows only the last workqueue it served, so
    workers are not split further), ``ksoftirqd``, ``jbd2``, ``loop`` ..."""
    if "/" in name:  # "kworker/u8:3-loop0", "ksoftirqd/1", "jbd2/loop0-8"
        return name.split("/", 1)[0] or name
    return name.rstrip("0123456789.") or name  # "loop0", "kswapd0", "kdamond.0"


def kernel_thread_cpu(proc: str = "/proc") -> dict[str, float]:
    """{kind: CPU seconds so far} summed over the machine's kernel threads
    (``PF_KTHREAD``), from each thread's scheduler run time (``schedstat``,
    nanoseconds; ``stat`` ticks where that is missing). Kernel threads that
    exited are missing. Never raises."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for pid in os.listdir(proc):
            if not pid.isdigit():
                continue
            try:
                with open(f"{proc}/{pid}/stat") as f:
                    stat = f.read()
                fields = stat[stat.rindex(")") + 2 :].split()
                if not int(fields[6]) & _PF_KTHREAD:
                    continue
                name = stat[stat.index("(") + 1 : stat.rindex(")")]
                ticks_s = (int(fields[11]) + int(fields[12])) / tick
            except (OSError, ValueError, IndexError):
                continue
            try:
                with open(f"{proc}/{pid}/schedstat") as f:
                    run_s = int(f.read().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):
                run_s = ticks_s
            kind = kernel_thread_kind(name)
            out[kind] = out.get(kind, 0.0) + run_s
    return out


def _children_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _self_s() -> float:
    t = os.times()
    return t.user + t.system


class MachineShare:
    """The machine's CPU between construction and ``report``, by party.

    ``machine`` is every core's busy time (``/proc/stat``: user, system,
    interrupts, steal); ``kernel_threads`` the kernel threads' run time (by
    kind); ``process`` this process (every thread); ``children`` the
    children waited for meanwhile (fio: ``RUSAGE_CHILDREN``); ``other`` the
    rest (other processes on the machine, interrupts taken on their time).
    Each as core-seconds and per GB of ``moved_bytes``.
    """

    def __init__(self) -> None:
        self._m0 = machine_cpu()
        self._k0 = kernel_thread_cpu()
        self._p0 = _self_s()
        self._c0 = _children_s()

    def report(self, moved_bytes: int) -> dict[str, Any]:
        m1 = machine_cpu()
        k1 = kernel_thread_cpu()
        process = _self_s() - self._p0
        children = _children_s() - self._c0
        tick = os.sysconf("SC_CLK_TCK")
        machine = (m1[0] - self._m0[0]) / tick
        kinds = {k: v - self._k0.get(k, 0.0) for k, v in k1.items()}
        kinds = {k: v for k, v in kinds.items() if v >= 0.0005}
        kernel = sum(kinds.values())
        other = max(0.0, machine - kernel - process - children)
        gb = max(moved_bytes, 1) / GB
        return {
            "machine_cpu_s_per_gb": round(machine / gb, 4),
            "kernel_threads_s_per_gb": round(kernel / gb, 4),
            "kernel_threads_by_kind_s_per_gb": {
                k: round(v / gb, 4) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])
            },
            "process_cpu_s_per_gb": round(process / gb, 4),
            "children_cpu_s_per_gb": round(children / gb, 4),
            "other_cpu_s_per_gb": round(other / gb, 4),
        }


def share_line(share: dict[str, Any], children: str = "") -> str:
    """One log line of a ``MachineShare.report``."""
    kinds = ", ".join(f"{k} {v:.3f}" for k, v in share["kernel_threads_by_kind_s_per_gb"].items())
    return (
        f"  machine CPU s/GB: {share['machine_cpu_s_per_gb']:.3f} = kernel threads "
        f"{share['kernel_threads_s_per_gb']:.3f} ({kinds or '-'}) + this process "
        f"{share['process_cpu_s_per_gb']:.3f}"
        + (f" + {children} {share['children_cpu_s_per_gb']:.3f}" if children else "")
        + f" + other {share['other_cpu_s_per_gb']:.3f}"
    )


def verified_load_bound(
    cores: int, fio_kernel_s_per_gb: float, fio_gbps: float, xxh3_s_per_gb: float
) -> dict[str, float] | None:
    """The best load bandwidth a tier that verifies one XXH3 pass could reach
    on ``cores`` cores when the drive's own work costs what fio's run cost the
    kernel threads: ``cores / (kernel s/GB + XXH3 s/GB)``, and its ratio to
    fio's bandwidth. It leaves the tier nothing else to pay (no submission, no
    completion, no scheduler), so it bounds from above. None without the
    figures (a drive whose kernel threads cost nothing gives no CPU bound)."""
    per_gb = fio_kernel_s_per_gb + xxh3_s_per_gb
    if cores <= 0 or per_gb <= 0 or fio_gbps <= 0 or fio_kernel_s_per_gb <= 0:
        return None
    gbps = cores / per_gb
    return {"gbps": round(gbps, 3), "x_fio": round(gbps / fio_gbps, 3)}


def load_bounds(results: list[Any], cores: int) -> tuple[list[str], list[dict[str, Any]]]:
    """Per chunk size with a fio load carrying its machine share: the bound of
    ``verified_load_bound`` beside what each of our targets reached, with the
    CPU per GB of each party of our load (kernel threads, the tier, the rest of
    this process: vLLM's orchestrator and the benchmark's loop). XXH3 is the
    cold pass of ``--profile`` where measured, else the warm one.

    Bandwidths measured on a shared machine move with what else runs; the
    CPU-bound figures do not: ``fio_cpu_bound_gbps`` is ``cores / (kernel
    threads + fio's own CPU in its run)`` (what fio reaches when the machine
    is its own), ``cpu_bound_gbps`` the same for our load (kernel threads +
    this whole process), and ``bound_x_fio_cpu`` / ``x_fio_cpu`` their ratios
    to fio's."""
    lines: list[str] = []
    rows: list[dict[str, Any]] = []
    for fio in results:
        share = fio.extra.get("machine_share") if fio.target == "fio" else None
        if not share or fio.phase != "read":
            continue
        for ours in results:
            if not ours.target.startswith("nvmetier") or ours.phase != "read" or ours.bs != fio.bs:
                continue
            if ours.extra.get("round") != fio.extra.get("round"):
                continue
            prof = ours.extra.get("cpu_profile") or {}
            xxh3 = (prof.get("xxh3") or {}).get("cold_s_per_gb")
            which = "cold"
            if xxh3 is None:
                xxh3, which = ours.extra.get("xxh3_s_per_gb"), "warm"
            if xxh3 is None:
                continue
            kernel = share["kernel_threads_s_per_gb"]
            bound = verified_load_bound(cores, kernel, fio.bw_gbps, xxh3)
            if bound is None:
                continue
            fio_run = sum(fio.cpu_per_gb())
            fio_cpu_bound = cores / (kernel + fio_run)
            mine = ours.extra.get("machine_share") or {}
            tier = ours.tier_cpu_per_gb()
            process = mine.get("process_cpu_s_per_gb")
            our_kernel = mine.get("kernel_threads_s_per_gb")
            ours_cpu = (
                cores / (our_kernel + process)
                if our_kernel is not None and process is not None and our_kernel + process > 0
                else None
            )
            row = {
                "bs": fio.bs,
                "target": ours.target,
                "cores": cores,
                "fio_gbps": round(fio.bw_gbps, 3),
                "fio_machine_cpu_s_per_gb": share["machine_cpu_s_per_gb"],
                "fio_kernel_threads_s_per_gb": kernel,
                "fio_process_cpu_s_per_gb": share["children_cpu_s_per_gb"],
                "fio_run_cpu_s_per_gb": round(fio_run, 4),
                "fio_cpu_bound_gbps": round(fio_cpu_bound, 3),
                "xxh3_s_per_gb": xxh3,
                "xxh3_pass": which,
                "bound_gbps": bound["gbps"],
                "bound_x_fio": bound["x_fio"],
                "bound_x_fio_cpu": round(bound["gbps"] / fio_cpu_bound, 3),
                "gbps": round(ours.bw_gbps, 3),
                "x_fio": round(ours.bw_gbps / fio.bw_gbps, 3) if fio.bw_gbps else None,
                "kernel_threads_s_per_gb": our_kernel,
                "tier_cpu_s_per_gb": round(tier, 4) if tier is not None else None,
                "harness_cpu_s_per_gb": (
                    round(max(0.0, process - tier), 4)
                    if process is not None and tier is not None
                    else None
                ),
                "machine_cpu_s_per_gb": mine.get("machine_cpu_s_per_gb"),
                "cpu_bound_gbps": round(ours_cpu, 3) if ours_cpu is not None else None,
                "x_fio_cpu": round(ours_cpu / fio_cpu_bound, 3) if ours_cpu is not None else None,
            }
            rows.append(row)
            lines.append(
                f"load bound bs={_bs(fio.bs)}: a tier verifying XXH3 on {cores} cores "
                f"reaches at most {bound['gbps']:.2f} GB/s = {bound['x_fio']:.2f}x fio's "
                f"{fio.bw_gbps:.2f} ({row['bound_x_fio_cpu']:.2f}x fio's own CPU bound "
                f"{fio_cpu_bound:.2f}) = {cores} / (fio's kernel threads {kernel:.3f} + XXH3 "
                f"{which} {xxh3:.3f} s/GB); {ours.target} {row['gbps']:.2f} GB/s = "
                f"{row['x_fio']:.2f}x fio (CPU bound "
                + (f"{ours_cpu:.2f} GB/s = {row['x_fio_cpu']:.2f}x fio's" if ours_cpu else "-")
                + "), CPU s/GB: "
                + ", ".join(
                    f"{label} {v:.3f}" if v is not None else f"{label} -"
                    for label, v in (
                        ("kernel threads", our_kernel),
                        ("tier", row["tier_cpu_s_per_gb"]),
                        ("harness", row["harness_cpu_s_per_gb"]),
                    )
                )
            )
    return lines, rows
