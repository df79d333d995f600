"""Drive one LMCache 0.5.6 disk backend through its own L2-adapter API; print JSON.

Runs ONLY inside LMCache's environment (``nvmetier.bench.peers`` builds it;
``tools/peers/setup_lmcache.sh`` does the same by hand), never the product's:
``nvmetier bench --peers lmcache`` starts it by path (``python -P``) as a
subprocess, one backend and one chunk size per call. It imports lmcache,
torch and numpy, never nvmetier.

What it does, as LMCache's store and prefetch controllers call an L2 adapter:
  store: ``submit_store_task(keys, objs)`` with ``--iodepth`` chunks in flight
         (one chunk per task), completions from ``pop_completed_store_tasks``;
  load:  ``submit_lookup_and_lock_task`` for every key (timed apart), then
         ``submit_load_task(keys, objs)`` with ``--iodepth`` chunks in flight,
         in a shuffled order, results from ``query_load_result``, then
         ``submit_unlock``.
The chunks live in plain CPU memory: one private anonymous mapping (4 KiB
pages, no huge-page advice), as a process's malloc'd buffers are; its
huge-page share is reported. Each chunk is stamped with its index before it
is stored and checked after each load (outside the timed loop: LMCache
verifies nothing itself). O_DIRECT on for every backend.

Backends: ``fs_native`` (the C++ filesystem connector, one file per chunk),
``raw_block`` (Rust, on a preallocated file; ``--raw-block-engine`` io_uring
or posix), ``fs`` (the Python ``FSL2Adapter``, aiofiles; the L2 form of
``local_disk``). Prints one JSON object: per phase bytes, seconds, GB/s, CPU
seconds (this process: LMCache's I/O threads included), chunks wrong.
Exit codes: 0 ok, 2 bad arguments, 3 the backend could not be created.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import sys
import time

import numpy as np


def _huge_share(addr: int, length: int) -> float:
    """Share of [addr, addr+length) in huge pages, from /proc/self/smaps."""
    end, total = addr + length, 0.0
    lo = hi = overlap = 0
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0] if line.strip() else ""
                if "-" in head and not head.endswith(":"):
                    a, b = head.split("-")
                    lo, hi = int(a, 16), int(b, 16)
                    overlap = max(0, min(hi, end) - max(lo, addr))
                elif overlap and head in ("AnonHugePages:", "ShmemPmdMapped:"):
                    total += int(line.split()[1]) * 1024 * overlap / max(1, hi - lo)
    except OSError:
        return 0.0
    return round(total / length, 3) if length else 0.0


def _make_adapter(args: argparse.Namespace, root: str):  # type: ignore[no-untyped-def]
    from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class
    from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry

    if args.backend == "fs_native":
        d = {"base_path": root, "num_workers": args.workers, "use_odirect": True}
    elif args.backend == "fs":
        d = {"base_path": root, "use_odirect": True}
    elif args.backend == "raw_block":
        path = os.path.join(root, "raw_block.img")
        meta = 64 << 20
        slot = args.bs + 4096  # one header block per slot
        cap = meta + 2 * (args.size // args.bs + 8) * slot
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, cap)
        finally:
            os.close(fd)
        d = {
            "device_path": path,
            "slot_bytes": slot,
            "capacity_bytes": cap,
            "meta_total_bytes": meta,
            "use_odirect": True,
            "io_engine": args.raw_block_engine,
            "iouring_queue_depth": max(32, args.iodepth),
            "load_checkpoint_on_init": False,
            "num_load_workers": args.workers,
            "num_store_workers": max(2, args.workers // 2),
        }
    else:
        raise ValueError(f"unknown backend {args.backend!r}")
    cfg = get_l2_adapter_config_class(args.backend).from_dict(d)
    return create_l2_adapter_from_registry(cfg)


def _run(args: argparse.Namespace) -> dict:
    import torch
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    bs, qd = args.bs, args.iodepth
    n = args.size // bs
    root = os.path.join(args.dir, f"lmcache-{args.backend}-{bs}")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    buf = mmap.mmap(-1, qd * bs, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arr = np.frombuffer(buf, dtype=np.uint8)
    pattern = np.frombuffer(os.urandom(bs), dtype=np.uint8)
    for r in range(qd):
        arr[r * bs : (r + 1) * bs] = pattern
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    base = torch.frombuffer(buf, dtype=torch.uint8)
    objs = []
    for r in range(qd):
        meta = MemoryObjMetadata(
            shape=torch.Size([bs]),
            dtype=torch.uint8,
            address=addr + r * bs,
            phy_size=bs,
            ref_count=1,
            fmt=MemoryFormat.KV_2LTD,
        )
        objs.append(TensorMemoryObj(base[r * bs : (r + 1) * bs], meta, None))
    keys = [ObjectKey(i.to_bytes(8, "little") * 4, "nvmetier-bench", 0) for i in range(n)]
    try:
        adapter = _make_adapter(args, root)
    except Exception as exc:
        shutil.rmtree(root, ignore_errors=True)
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        sys.exit(3)
    out: dict = {
        "backend": args.backend
        + (f"-{args.raw_block_engine}" if args.backend == "raw_block" else ""),
        "bs": bs,
        "iodepth": qd,
        "buffer_huge_page_share": _huge_share(addr, qd * bs),
        "phases": {},
    }
    try:
        order = np.random.default_rng(1).permutation(n).tolist()
        out["phases"]["write"] = _phase(adapter, keys, objs, arr, bs, list(range(n)), "write", qd)
        if args.drop_caches:
            _drop_caches()
        t0 = time.perf_counter()
        task = adapter.submit_lookup_and_lock_task(keys, {})
        found = None
        while found is None:
            found = adapter.query_lookup_and_lock_result(task)
            if found is None:
                time.sleep(50e-6)
        out["lookup_s"] = time.perf_counter() - t0
        out["lookup_found"] = found.popcount()
        out["phases"]["read"] = _phase(adapter, keys, objs, arr, bs, order, "read", qd)
        adapter.submit_unlock(keys)
    finally:
        adapter.close()
        shutil.rmtree(root, ignore_errors=True)
    return out


def _drop_caches() -> None:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass


def _phase(adapter, keys, objs, arr, bs, order, phase, qd):  # type: ignore[no-untyped-def]
    """Keep ``qd`` one-chunk tasks in flight over ``order``; time it."""
    is_load = phase == "read"
    free = list(range(qd))
    pending: dict[int, tuple[int, int]] = {}
    moved = failed = wrong = 0
    nxt = 0
    c0 = os.times()
    t0 = time.perf_counter()
    while nxt < len(order) or pending:
        while free and nxt < len(order):
            i, r = order[nxt], free.pop()
            nxt += 1
            if is_load:
                arr[r * bs : r * bs + 8] = 0
                tid = adapter.submit_load_task([keys[i]], [objs[r]])
            else:
                arr[r * bs : r * bs + 8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
                tid = adapter.submit_store_task([keys[i]], [objs[r]])
            pending[tid] = (i, r)
        done = []
        if is_load:
            for tid in list(pending):
                res = adapter.query_load_result(tid)
                if res is not None:
                    done.append((tid, res.popcount() == 1))
        else:
            for tid, res in adapter.pop_completed_store_tasks().items():
                done.append((tid, res.is_successful()))
        if not done:
            time.sleep(50e-6)
            continue
        for tid, ok in done:
            i, r = pending.pop(tid)
            if ok:
                moved += bs
                if is_load and bytes(arr[r * bs : r * bs + 8]) != i.to_bytes(8, "little"):
                    wrong += 1
            else:
                failed += 1
            free.append(r)
    elapsed = time.perf_counter() - t0
    c1 = os.times()
    return {
        "bytes": moved,
        "seconds": elapsed,
        "gbps": moved / elapsed / 1e9 if elapsed else 0.0,
        "cpu_usr_s": c1.user - c0.user,
        "cpu_sys_s": c1.system - c0.system,
        "failed": failed,
        "wrong_chunks": wrong,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", required=True, choices=("fs_native", "raw_block", "fs"))
    p.add_argument("--raw-block-engine", default="io_uring", choices=("io_uring", "posix"))
    p.add_argument("--dir", required=True)
    p.add_argument("--bs", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--iodepth", type=int, default=32)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--drop-caches", action="store_true")
    args = p.parse_args(argv)
    if args.bs % 4096 or args.size < args.bs:
        print(json.dumps({"error": "--bs must be a multiple of 4096 and <= --size"}))
        return 2
    print(json.dumps(_run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
