"""The ``reopen`` level: time ``BlockStore`` open of a store full of valid records.

Owns: ``run_reopen``. Runs on the calling thread and blocks for the length of
the run (it creates, fills and reopens a store under ``--dir``).
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

from nvmetier.bench.machine import drop_caches
from nvmetier.config import TierConfig


def run_reopen(args: argparse.Namespace, log: Callable) -> dict[str, Any]:
    """Open a store whose index holds ``--slots`` valid records; time the open."""
    import xxhash

    from nvmetier import format as fmt
    from nvmetier.files import INDEX_NAME
    from nvmetier.store import BlockStore

    chunk = 4096
    ways = 16
    want = args.slots
    root = os.path.join(args.dir, "reopen")
    shutil.rmtree(root, ignore_errors=True)
    ident = {"bench": "reopen"}
    cap = want * (chunk + fmt.RECORD_BYTES) + (1 << 20)
    cfg = TierConfig.from_dict(
        {
            "root_dir": root,
            "capacity_bytes": cap,
            "ways": ways,
            "io_engine": "threads",
            "io_threads": 1,
            "persist": True,
        }
    )
    buf = mmap.mmap(-1, 16 * chunk)
    view = memoryview(buf)
    out: dict[str, Any] = {}
    try:
        t = time.perf_counter()
        s = BlockStore(cfg, store_name="s", identity=ident, buffer=view, row_bytes=chunk)
        n_slots, n_sets = s.sb.n_slots, s.sb.n_sets
        store_dir = s.files.dirs[0]
        s.close(persist=True)
        out["create_s"] = time.perf_counter() - t
        log(f"reopen: created a store of {n_slots} slots in {out['create_s']:.2f}s")
        # Fill every slot with a valid record whose key hashes into the slot's set.
        t = time.perf_counter()
        fill = [0] * n_sets
        left = n_slots
        now = time.time_ns()
        h = xxhash.xxh3_64_intdigest
        with open(os.path.join(store_dir, INDEX_NAME), "r+b") as f:
            mm = mmap.mmap(f.fileno(), 0)
            try:
                i = 0
                while left:
                    key = b"reopen-bench-" + i.to_bytes(8, "little")
                    i += 1
                    st = h(key) % n_sets
                    w = fill[st]
                    if w == ways:
                        continue
                    fill[st] = w + 1
                    slot = st * ways + w
                    off = slot * fmt.RECORD_BYTES
                    mm[off : off + fmt.RECORD_BYTES] = fmt.pack_record(slot, key, 0, now)
                    left -= 1
                mm.flush()
            finally:
                mm.close()
        out["fill_s"] = time.perf_counter() - t
        log(f"reopen: wrote {n_slots} index records in {out['fill_s']:.2f}s")
        for label, cold in (("cold", True), ("warm", False)):
            if cold:
                ok, why = drop_caches()
                if not ok:
                    out["cold_note"] = why
            t = time.perf_counter()
            s = BlockStore(cfg, store_name="s", identity=ident, buffer=view, row_bytes=chunk)
            total = time.perf_counter() - t
            ready = s.stats()["slots_ready"]
            out[label] = {
                "open_s": round(total, 4),
                "recover_s": round(s.open_time_s, 4),
                "slots_ready": ready,
            }
            s.close(persist=True)
            log(
                f"reopen ({label} page cache): BlockStore() {total:.3f}s "
                f"(files+index recovery {s.open_time_s:.3f}s), {ready} slots ready"
            )
        if args.profile:
            import cProfile
            import io
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            s = BlockStore(cfg, store_name="s", identity=ident, buffer=view, row_bytes=chunk)
            prof.disable()
            s.close(persist=True)
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
            out["profile"] = text.getvalue()
            log(out["profile"])
        out["slots"] = n_slots
    finally:
        view.release()
        buf.close()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return out
