"""Shared slot table figures of issue 10, measured on a real store.

    .venv/bin/python tools/bench_table.py [--dir DIR] [--slots 262144] [--json OUT]

Fills a store of ``--slots`` slots (4 KiB chunks, so the data file stays small)
in a child process, then, each in a fresh process:

- private memory: RssAnon (``/proc/self/status``) after opening the full store
  minus before, per stored slot (the table and index are shared file mappings,
  so they count in RssFile/RssShmem, not in RssAnon);
- open time of the full store minus the open time of an empty one (same
  geometry), median of 5;
- lookup p50/p99 of stored keys (``BlockStore.lookup``, one call timed with
  perf_counter_ns, 100 000 calls), and the cost of the vLLM adapter's
  ``lookup`` on top (``NvmeTierManager.lookup`` is one more Python frame).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

CHUNK = 4096
SCRIPT = os.path.abspath(__file__)


def _config(root: str, slots: int) -> dict:
    # 4 KiB slots + 128 B record + 36 B of table per slot, and a margin.
    cap = slots * (CHUNK + 128 + 36) + (4 << 20)
    return {"root_dir": root, "capacity_bytes": cap, "ways": 16, "o_direct": False}


def _open(root: str, slots: int, name: str = "bench"):
    from nvmetier.config import TierConfig
    from nvmetier.store import BlockStore

    buf = memoryview(mmap.mmap(-1, 256 * CHUNK))
    cfg = TierConfig.from_dict(_config(root, slots))
    return BlockStore(cfg, store_name=name, identity={"bench": 1}, buffer=buf, row_bytes=CHUNK)


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") * 4


def _rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    return 0


def child_fill(root: str, slots: int) -> None:
    store = _open(root, slots)
    n = store.sb.n_slots
    batch = 256
    i = job = 0
    misses = 0
    while store.stats()["slots_used"] < int(n * 0.9) and misses < 50:
        before = store.stats()["slots_used"]
        keys = [key(i + j) for j in range(batch)]
        store.submit_store(job, keys, list(range(batch)))
        store.wait_idle()
        store.poll()
        i += batch
        job += 1
        misses = misses + 1 if store.stats()["slots_used"] == before else 0
    print(json.dumps({"stored": store.stats()["slots_used"], "keys": i, "slots": n}))
    store.close()


def _preload() -> None:
    """Import what an open imports, so RSS deltas count the store, not code."""
    import nvmetier.engine.threads
    import nvmetier.recovery
    import nvmetier.store  # noqa: F401
    from nvmetier.engine import uring_status

    uring_status()


def child_measure(root: str, slots: int, nkeys: int) -> None:
    import gc

    _preload()
    gc.collect()
    rss0 = _rss_anon_kib()
    t0 = time.perf_counter()
    store = _open(root, slots)
    open_s = time.perf_counter() - t0
    gc.collect()
    rss1 = _rss_anon_kib()
    stored = store.stats()["slots_ready"]
    hits = [key(i) for i in range(nkeys) if store.contains(key(i))][:100_000]
    lat = []
    look = store.lookup
    clock = time.perf_counter_ns
    for k in hits * max(1, 100_000 // max(1, len(hits))):
        t = clock()
        look(k)
        lat.append(clock() - t)
        if len(lat) % 4096 == 0:
            store.release_holds()
    # The clock's own cost, to subtract.
    empty = []
    for _ in range(100_000):
        t = clock()
        empty.append(clock() - t)
    lat.sort()
    base = statistics.median(empty)
    out = {
        "stored": stored,
        "open_s": open_s,
        "rss_anon_delta_bytes": (rss1 - rss0) * 1024,
        "rss_anon_per_slot_bytes": (rss1 - rss0) * 1024 / max(1, stored),
        "lookup_p50_ns": lat[len(lat) // 2] - base,
        "lookup_p99_ns": lat[int(len(lat) * 0.99)] - base,
        "clock_overhead_ns": base,
    }
    store.close()
    print(json.dumps(out))


def child_open_empty(root: str, slots: int) -> None:
    import gc

    _preload()
    gc.collect()
    rss0 = _rss_anon_kib()
    t0 = time.perf_counter()
    store = _open(root, slots, name="empty")
    open_s = time.perf_counter() - t0
    gc.collect()
    delta = (_rss_anon_kib() - rss0) * 1024
    print(json.dumps({"open_s": open_s, "rss_anon_delta_bytes": delta}))
    store.close()


def _run(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, SCRIPT, *args], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dir", default=None, help="where to create the store (default: a temp dir)")
    ap.add_argument("--slots", type=int, default=262144)
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        what, root, slots = args.child[0], args.child[1], int(args.child[2])
        if what == "fill":
            child_fill(root, slots)
        elif what == "measure":
            child_measure(root, slots, int(args.child[3]))
        else:
            child_open_empty(root, slots)
        return 0
    root = args.dir or tempfile.mkdtemp(prefix="nvmetier-table-")
    try:
        fill = _run("--child", "fill", root, str(args.slots))
        runs = [
            _run("--child", "measure", root, str(args.slots), str(fill["keys"])) for _ in range(5)
        ]
        empties = [_run("--child", "empty", root, str(args.slots)) for _ in range(5)]
        report = {
            "slots": fill["slots"],
            "stored": fill["stored"],
            # Private memory a full store costs beyond an empty one, per stored slot.
            "rss_anon_per_slot_bytes": (
                statistics.median(r["rss_anon_delta_bytes"] for r in runs)
                - statistics.median(e["rss_anon_delta_bytes"] for e in empties)
            )
            / max(1, fill["stored"]),
            "rss_anon_open_full_bytes": statistics.median(r["rss_anon_delta_bytes"] for r in runs),
            "rss_anon_open_empty_bytes": statistics.median(
                e["rss_anon_delta_bytes"] for e in empties
            ),
            "open_full_s": statistics.median(r["open_s"] for r in runs),
            "open_empty_s": statistics.median(e["open_s"] for e in empties),
            "lookup_p50_ns": statistics.median(r["lookup_p50_ns"] for r in runs),
            "lookup_p99_ns": statistics.median(r["lookup_p99_ns"] for r in runs),
            "runs": runs,
        }
        report["open_added_s"] = report["open_full_s"] - report["open_empty_s"]
        for k in (
            "slots",
            "stored",
            "rss_anon_per_slot_bytes",
            "rss_anon_open_full_bytes",
            "rss_anon_open_empty_bytes",
            "open_full_s",
            "open_empty_s",
            "open_added_s",
            "lookup_p50_ns",
            "lookup_p99_ns",
        ):
            v = report[k]
            print(f"{k:26s} {v:.4f}" if isinstance(v, float) else f"{k:26s} {v}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
