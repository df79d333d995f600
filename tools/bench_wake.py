"""What one submit to idle io_uring workers costs the caller's thread.

    .venv/bin/python tools/bench_wake.py [--workers 1,2,4,8] [--ops 16,256] [--rounds 150]

Opens the native io_uring engine (``nvmetier.engine.uring.UringEngine``) over
one scratch file per worker (each worker serves one "drive"), and, as vLLM's
scheduler thread does when a step's promotions or stores find the engine
idle, submits ``--ops`` 64 KiB reads spread over every file after resting
3 ms (every I/O thread blocked in its ring), ``--rounds`` times. Each
``submit_raw`` is timed with the thread's CPU clock (kernel time included:
the eventfd writes that wake the I/O threads count) and the median is
printed per worker count and batch. Every batch is drained before the next.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ROW = 64 << 10
ROWS = 256


def measure(workers: int, n_ops: int, rounds: int, folder: str) -> float:
    from nvmetier.engine import uring
    from nvmetier.engine.base import OP_DTYPE, OP_READ

    region = mmap.mmap(-1, ROWS * ROW)
    fds = []
    for i in range(workers):
        fd = os.open(os.path.join(folder, f"drive{i}"), os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, ROWS * ROW)
        fds.append(fd)
    engine = uring.UringEngine(region, fds, workers=workers)
    try:
        ops = np.zeros(n_ops, dtype=OP_DTYPE)
        ops["op_id"] = np.arange(1, n_ops + 1)
        ops["file_idx"] = np.arange(n_ops) % workers
        ops["file_offset"] = (np.arange(n_ops) // workers % ROWS) * ROW
        ops["buf_offset"] = (np.arange(n_ops) % ROWS) * ROW
        ops["length"] = ROW
        ops["kind"] = OP_READ
        packed = ops.tobytes()
        submit, wait = engine.native_submit_raw, engine._native.wait_raw
        costs = []
        for _ in range(rounds):
            time.sleep(0.003)
            t0 = time.thread_time_ns()
            submit(packed)
            costs.append(time.thread_time_ns() - t0)
            got, deadline = 0, time.monotonic() + 30
            while got < n_ops:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{n_ops - got} of {n_ops} reads never completed")
                got += len(wait(1.0)) // 24
        return statistics.median(costs) / 1e3
    finally:
        engine.close()
        for fd in fds:
            os.close(fd)
        region.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", default="1,2,4,8", help="worker (drive) counts, comma list")
    p.add_argument("--ops", default="16,256", help="reads per submit, comma list")
    p.add_argument("--rounds", type=int, default=150)
    p.add_argument("--dir", default=None, help="where the scratch files go")
    args = p.parse_args()
    folder = tempfile.mkdtemp(prefix="nvmetier-bench-wake-", dir=args.dir)
    try:
        for workers in (int(x) for x in args.workers.split(",")):
            line = [f"workers {workers}:"]
            for n_ops in (int(x) for x in args.ops.split(",")):
                us = measure(workers, n_ops, args.rounds, folder)
                line.append(f"{n_ops} reads {us:.1f} us")
            print(" ".join(line), flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
