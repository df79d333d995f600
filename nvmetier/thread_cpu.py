"""CPU time of this process's threads, read from ``/proc/self/task``: the
one reader the staging probe (``nvmetier.staging_probe``, at store creation)
and the benchmark's profiles (``nvmetier.bench``) share.

Owns no state. Any thread may call it; it blocks for a few small reads of
procfs per live thread. Linux only (elsewhere it returns nothing).
"""

from __future__ import annotations

import contextlib
import os


def thread_times() -> dict[int, tuple[str, float, float, float]]:
    """{tid: (name, user s, system s, total s)} of this process's live
    threads: user and system from ``stat`` (clock ticks, 10 ms resolution),
    the total from the scheduler's nanosecond run time (``schedstat``)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float, float, float]] = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            if name.startswith("iou-wrk-"):
                name = "iou-wrk (kernel io_uring workers)"
            fields = stat[stat.rindex(")") + 2 :].split()
            user, system = int(fields[11]) / tick, int(fields[12]) / tick
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    total = int(f.read().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):
                total = user + system
            out[int(tid)] = (name, user, system, total)
    return out
