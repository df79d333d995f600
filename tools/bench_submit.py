"""What one store job and one poll cost vLLM's scheduler thread, warm and cold.

    .venv/bin/python tools/bench_submit.py [--dir DIR] [--jobs 450] [--keys 16]
        [--thrash-mib 0,8] [--skip] [--rounds 3]

Opens a real store (io_uring engine, 64 KiB chunks, the ``vllm`` bench level's
settings) and, as vLLM's scheduler thread does, submits one store job of
``--keys`` fresh keys (``Table.submit_store`` itself, as the vLLM adapter calls
it) then polls (``Table.poll``), ``--jobs`` times, resting 0.5 ms every 8 jobs
so that the I/O workers go idle as between vLLM's steps. Each call is timed
with the thread's CPU clock (kernel time included: an eventfd wake counts) and
the median per call is reported, robust to the other processes of a shared
machine.

``--thrash-mib N`` writes N MiB of unrelated memory before each job, as
vLLM's own scheduling does between two calls into the tier: the job then runs
with the table, the code and the interpreter cold, which is what the ``vllm``
bench level measures. ``--skip`` marks every key skipped (the admission
policy's path): the job then claims nothing and queues nothing, which leaves
the fixed cost of a job (arguments, job slot, key hashing, finish).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ROW = 64 << 10
ROWS = 256


def measure(root: str, jobs: int, keys: int, thrash_mib: int, skip: bool) -> dict[str, float]:
    import numpy as np

    from nvmetier.config import TierConfig
    from nvmetier.store import BlockStore

    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    buf = memoryview(mmap.mmap(-1, ROWS * ROW))
    cfg = TierConfig.from_dict(
        {
            "root_dir": root,
            "capacity_bytes": max(1 << 30, 2 * jobs * keys * (ROW + 4096)),
            "io_engine": "uring",
            "queue_depth": 32,
            "persist": False,
        }
    )
    store = BlockStore(cfg, store_name="bench", identity={"bench": 1}, buffer=buf, row_bytes=ROW)
    try:
        submit, _, _ = store.table_calls()
        poll = store.poll_raw()
        rows = np.arange(keys, dtype=np.int32)  # as vLLM's chunk_ids
        skip_bytes = b"\x01" * keys if skip else None
        junk = np.zeros(max(1, thrash_mib << 17), dtype=np.int64)
        rng = random.Random(1)
        clock = time.thread_time_ns
        subs: list[int] = []
        polls: list[int] = []
        for j in range(jobs):
            batch = [rng.randbytes(32) for _ in range(keys)]
            if thrash_mib:
                junk += 1
            t0 = clock()
            if skip_bytes is None:
                submit(j, batch, rows)
            else:
                submit(j, batch, rows, skip_bytes)
            t1 = clock()
            poll()
            t2 = clock()
            subs.append(t1 - t0)
            polls.append(t2 - t1)
            if j % 8 == 7:
                time.sleep(0.0005)
        store.wait_idle()
        poll()
        # The clock's own cost, to subtract (one read per call).
        empty = []
        for _ in range(2000):
            t0 = clock()
            empty.append(clock() - t0)
        base = statistics.median(empty)
        return {
            "submit_us_per_job": round((statistics.median(subs) - base) / 1e3, 2),
            "poll_us_per_call": round((statistics.median(polls) - base) / 1e3, 2),
        }
    finally:
        store.close()
        buf.release()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=None, help="where the store goes (a new temporary folder)")
    p.add_argument("--jobs", type=int, default=450, help="store jobs per round")
    p.add_argument("--keys", type=int, default=16, help="keys per job (vLLM: 16 at 64 KiB)")
    p.add_argument("--thrash-mib", default="0,8", help="MiB written between jobs, comma list")
    p.add_argument("--skip", action="store_true", help="every key skipped: a job's fixed cost")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args()
    base = args.dir or tempfile.mkdtemp(prefix="nvmetier-bench-submit-")
    out: dict[str, list[dict[str, float]]] = {}
    for r in range(args.rounds):
        for mib in (int(x) for x in args.thrash_mib.split(",")):
            got = measure(os.path.join(base, "store"), args.jobs, args.keys, mib, args.skip)
            out.setdefault(f"thrash_{mib}_mib", []).append(got)
            print(f"round {r + 1} thrash {mib} MiB: {got}", flush=True)
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    for name, rounds in out.items():
        med = {k: statistics.median(x[k] for x in rounds) for k in rounds[0]}
        print(f"median of {len(rounds)} rounds, {name}: {med}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
