"""What a request's keys cost the slot table on vLLM's thread, cold and warm.

    .venv/bin/python tools/bench_keys.py [--requests 16] [--keys 256] [--rounds 10]
        [--capacity-mib 1280] [--thrash-mib 8]

Fills a real store (64 KiB chunks, the ``vllm`` bench level's shape; thread
engine, buffered, so that no I/O thread runs beside the measured calls) with
``--requests`` requests of ``--keys`` keys, then, request after request, as a
promotion does on vLLM's scheduler thread: the plan's lease of the request's
keys (``Table.lease_many``, two halves), the load's ops (``Table.load_ops``:
the table side of ``submit_load``, no engine), their completions (untimed),
the step's lease release, and the finish's refresh (``Table.touch``). Before
the lease and the touch, ``--thrash-mib`` MiB of unrelated memory are
written (vLLM's own work between two calls into the tier), so those run cold;
the load's ops run right after the lease, as in a step. Each call is timed
with the thread's CPU clock; medians per request are printed, and the
mappings' huge-page coverage (``FilePmdMapped``) of the table and index.
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


def _pmd_mapped(folder: str) -> dict[str, str]:
    out = {}
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if folder in line:
            name = os.path.basename(line.split()[-1])
            for follow in lines[i + 1 : i + 30]:
                if follow.startswith("FilePmdMapped:"):
                    size = next(x for x in lines[i + 1 : i + 4] if x.startswith("Size:"))
                    out[name] = f"{follow.split()[1]} of {size.split()[1]} KiB"
                    break
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--keys", type=int, default=256, help="keys per request (at most 256)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--capacity-mib", type=int, default=1280)
    p.add_argument("--thrash-mib", type=int, default=8)
    p.add_argument("--dir", default=None)
    args = p.parse_args()

    from nvmetier.config import TierConfig
    from nvmetier.engine.base import COMPLETION_DTYPE, OP_DTYPE
    from nvmetier.store import BlockStore

    folder = tempfile.mkdtemp(prefix="nvmetier-bench-keys-", dir=args.dir)
    buf = memoryview(mmap.mmap(-1, ROWS * ROW))
    cfg = TierConfig.from_dict(
        {
            "root_dir": folder,
            "capacity_bytes": args.capacity_mib << 20,
            "io_engine": "threads",
            "persist": False,
            "o_direct": False,
        }
    )
    store = BlockStore(cfg, store_name="bench", identity={"bench": 1}, buffer=buf, row_bytes=ROW)
    try:
        submit_store, _, release = store.table_calls()
        poll, table = store.poll_raw(), store._table
        n = min(args.keys, ROWS)
        keys = [i.to_bytes(8, "little") * 4 + bytes(4) for i in range(args.requests * n)]
        rows = np.arange(ROWS, dtype=np.int64)
        for r in range(args.requests):
            submit_store(r, keys[r * n : (r + 1) * n], rows[:n])
            store.wait_idle()
            poll()
        junk = np.zeros(max(1, args.thrash_mib << 17), dtype=np.int64)
        clock = time.thread_time_ns
        got: dict[str, list[int]] = {"lease": [], "load_ops": [], "touch": [], "lease warm": []}
        job = 1 << 20
        for _ in range(args.rounds):
            for r in range(args.requests):
                ks = keys[r * n : (r + 1) * n]
                junk += 1
                t0 = clock()
                table.lease_many(ks[: n // 2])
                table.lease_many(ks[n // 2 :])
                t1 = clock()
                packed, _missing = table.load_ops(job, ks, rows[:n], False)
                t2 = clock()
                job += 1
                ops = np.frombuffer(packed, dtype=OP_DTYPE)
                done = np.zeros(len(ops), dtype=COMPLETION_DTYPE)
                done["op_id"], done["result"] = ops["op_id"], ops["length"]
                table.complete(done.tobytes(), False)
                release()
                t3 = clock()
                table.lease_many(ks)
                t4 = clock()
                release()
                junk += 1
                t5 = clock()
                table.touch(ks)
                t6 = clock()
                got["lease"].append(t1 - t0)
                got["load_ops"].append(t2 - t1)
                got["lease warm"].append(t4 - t3)
                got["touch"].append(t6 - t5)
        pmd = _pmd_mapped(folder)
        figures = ", ".join(f"{k} {statistics.median(v) / 1e3:.1f} us" for k, v in got.items())
        print(f"per request of {n} keys: {figures}")
        print(f"huge-page mapped: {pmd}")
        load = os.getloadavg()
        print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    finally:
        store.close()
        buf.release()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
