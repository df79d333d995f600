"""The main job: the tier exercised end to end through vLLM's orchestrator.

``python -m nvmetier.demo [--dir DIR] [--chunk 256KiB] [--chunks N]``:

1. builds vLLM 0.33's real tiering stack (CPU primary tier + NvmeTierManager)
   and stores N chunks through it (GPU -> primary -> cascade to disk);
2. shuts it down and builds a new one on the same folder (warm restart);
3. empties the primary, promotes every chunk back from disk and compares the
   bytes with what was stored;
4. prints figures: throughput, open time, hits, verified chunks, disk usage.

Blocking, single-threaded (plus the tier's own threads). Exit status 0 only if
every chunk came back byte for byte.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from nvmetier.config import format_size, parse_size


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nvmetier.demo", description=__doc__.split("\n")[0])
    p.add_argument(
        "--dir", default="nvmetier-demo", help="root_dir of the tier (default: %(default)s)"
    )
    p.add_argument("--chunk", default="256KiB", help="chunk size (default: %(default)s)")
    p.add_argument(
        "--chunks", type=int, default=2048, help="chunks to store (default: %(default)s)"
    )
    p.add_argument("--capacity", default="2GiB", help="tier capacity (default: %(default)s)")
    p.add_argument("--engine", default="auto", choices=["auto", "threads", "uring"])
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("vllm", "vllm.v1.kv_offload.tiering.factory"):
        logging.getLogger(noisy).setLevel(logging.ERROR)

    from vllm.v1.kv_offload.base import LookupResult

    from nvmetier.vllm.harness import SimulatedEngine, key_of, make_config

    chunk = parse_size(args.chunk, "--chunk")
    root = os.path.abspath(args.dir)
    tier = {
        "type": "NvmeTierManager",
        "module_path": "nvmetier.vllm",
        "root_dir": root,
        "capacity_bytes": args.capacity,
        "io_engine": args.engine,
    }
    cpu_chunks = max(64, (256 << 20) // chunk)
    keys = [key_of(i) for i in range(args.chunks)]
    total = chunk * len(keys)
    print(
        f"nvmetier demo: {len(keys)} chunks of {format_size(chunk)} "
        f"({format_size(total)}) through vLLM's TieringOffloadingManager into {root}"
    )

    eng = SimulatedEngine(make_config([tier], chunk_bytes=chunk, cpu_chunks=cpu_chunks))
    store = eng.tiers[0].store
    d = store.describe()
    print(
        f"  store   {d['store_dir']}  ({d['slots']} slots x {format_size(d['slot_bytes'])}, "
        f"{d['ways']} ways, engine {d['engine']}, O_DIRECT {d['o_direct']})"
    )
    before = store.stats()["ops_written"]
    t0 = time.perf_counter()
    eng.store_all(keys, batch=max(1, cpu_chunks // 4))
    t_store = time.perf_counter() - t0
    written = store.stats()["ops_written"] - before
    print(
        f"  store   {written} chunks written ({len(keys) - written} already on disk) "
        f"in {t_store:.2f}s = {chunk * len(keys) / t_store / 1e9:.2f} GB/s through the orchestrator"
    )
    eng.shutdown()

    t0 = time.perf_counter()
    eng = SimulatedEngine(make_config([tier], chunk_bytes=chunk, cpu_chunks=cpu_chunks))
    t_open = time.perf_counter() - t0
    store = eng.tiers[0].store
    print(
        f"  reopen  warm: {store.stats()['slots_ready']} chunks on disk, "
        f"stack built in {t_open:.2f}s (store open {store.open_time_s * 1000:.1f} ms)"
    )

    batch = cpu_chunks // 2
    hits = verified = 0
    t_load = 0.0
    for start in range(0, len(keys), batch):
        part = keys[start : start + batch]
        eng.reset_primary()
        t0 = time.perf_counter()
        results = eng.promote(part)
        t_load += time.perf_counter() - t0
        hit = [k for k in part if results[k] is LookupResult.HIT]
        hits += len(hit)
        verified += eng.verify(hit)
    s = store.stats()
    print(
        f"  load    {hits}/{len(keys)} hits promoted in {t_load:.2f}s = "
        f"{chunk * hits / max(t_load, 1e-9) / 1e9:.2f} GB/s; {verified} verified byte for byte"
    )
    print(
        f"  disk    {format_size(s['bytes_used'])} used of {format_size(s['capacity_bytes'])}; "
        f"checksum failures {s.get('checksum_failures', 0)}, read errors {s.get('read_errors', 0)}"
    )
    eng.shutdown()
    ok = verified == len(keys)
    print("nvmetier demo: OK" if ok else "nvmetier demo: FAILED (chunks missing or wrong)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
