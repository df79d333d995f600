"""The ``tier`` level: the whole ``BlockStore`` API over a primary like vLLM's.

Owns: ``run_tier_level``, ``vllm_like_primary`` (the primary: a ``/dev/shm``
file mapped shared and populated at once with ``MADV_POPULATE_WRITE``, as
vLLM's ``SharedOffloadRegion`` does, so the tier level gets the same kind of
memory the vLLM adapter gets, never a faster kind), its store configuration
and the per-phase driver (completions collected by ``BlockStore.poll`` on the
calling thread). Blocks for the length of the run.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from nvmetier.bench.common import _note_drop, _phases
from nvmetier.bench.cpuprof import CpuProfile
from nvmetier.bench.machine import _Cpu, _settle_heap, disk_requests, vllm_like_primary
from nvmetier.bench.report import PhaseResult, _percentiles, _phase_line
from nvmetier.config import TierConfig


def _tier_config(
    args: argparse.Namespace, root: str | list[str], bs: int, n_chunks: int
) -> TierConfig:
    # 2x the data: a set-associative index with 16 ways then overflows a set for
    # well under 1% of keys (Poisson mean 8 per set), so little is evicted.
    cap = 2 * n_chunks * (bs + 128) + (64 << 20)
    return TierConfig.from_dict(
        {
            "root_dir": root,
            "capacity_bytes": cap,
            "io_workers": getattr(args, "io_workers", "auto"),
            "io_threads": args.iodepth,
            "queue_depth": args.iodepth,
            "max_inflight_bytes": args.iodepth * bs,
            "max_queued_bytes": max(1 << 30, 2 * args.iodepth * bs),
            "o_direct": bool(args.direct),
            "persist": False,
            "staging": getattr(args, "staging_mode", "auto"),
        }
    )


def tier_target(engine: str, staging: str, shm_dir: str | None) -> str:
    """The tier level's target name: ``nvmetier-ENGINE``, then ``-staging-MODE``
    unless auto, then ``@DIR`` for a primary outside ``/dev/shm``."""
    name = f"nvmetier-{engine}" + ("" if staging == "auto" else f"-staging-{staging}")
    if shm_dir and shm_dir.rstrip("/") != "/dev/shm":
        name += "@" + shm_dir.rstrip("/")
    return name


def run_tier_level(
    args: argparse.Namespace, bs: int, engine_name: str, log: Callable
) -> list[PhaseResult]:
    from nvmetier.store import BlockStore

    n = args.size // bs
    jc = max(1, min(args.job_chunks, args.iodepth))
    rows = args.iodepth
    dirs = list(getattr(args, "dirs", None) or [args.dir])
    roots = [os.path.join(d, f"tier-{engine_name}-{bs}") for d in dirs]
    root = roots[0]
    cfg = _tier_config(args, roots if len(roots) > 1 else root, bs, n)
    shm_dir = getattr(args, "primary_shm_dir", None)
    buf = vllm_like_primary(rows * bs, shm_dir=shm_dir)
    pattern = os.urandom(bs)
    for r in range(rows):
        buf[r * bs : (r + 1) * bs] = pattern
    view = memoryview(buf)
    keys = [b"nvmetier-bench-" + i.to_bytes(8, "little") for i in range(n)]
    order = np.arange(n)
    if args.rw.startswith("rand"):
        np.random.default_rng(1).shuffle(order)
    results: list[PhaseResult] = []
    store = BlockStore(
        cfg,
        store_name="bench",
        identity={"bench": bs},
        buffer=view,
        row_bytes=bs,
        engine=engine_name,
    )
    try:
        for phase, timed in _phases(args.rw):
            if phase == "read" and timed:
                _note_drop(args, log)
            _settle_heap()
            res = _tier_phase(store, buf, bs, keys, order, phase, jc, args, timed, log)
            if timed:
                rq = res.extra.get("disk_requests_per_chunk")
                log(_phase_line(res) + (f" disk_reqs/chunk={rq}" if rq is not None else ""))
                results.append(res)
        stats = store.stats()
        desc = store.describe()
        for phase_res in results:
            phase_res.extra["primary"] = {
                k: desc.get(k)
                for k in (
                    "primary_bytes",
                    "primary_huge_page_bytes",
                    "thp_enabled",
                    "thp_shmem_enabled",
                    "staging",
                    "staging_reason",
                    "staged_bytes",
                )
            }
            phase_res.extra["store_stats"] = {
                k: stats.get(k, 0)
                for k in (
                    "evictions",
                    "stores_dropped_set_busy",
                    "stores_dropped_queue_full",
                    "checksum_failures",
                    "load_keys_missing",
                )
            }
    finally:
        store.close(persist=args.keep)
        view.release()
        buf.close()
        if not args.keep:
            for path in roots:
                shutil.rmtree(path, ignore_errors=True)
    return results


def _tier_phase(
    store: Any,
    buf: mmap.mmap,
    bs: int,
    keys: list[bytes],
    order: np.ndarray,
    phase: str,
    jc: int,
    args: argparse.Namespace,
    timed: bool,
    log: Callable = print,
) -> PhaseResult:
    """Keep ``iodepth`` chunks outstanding as jobs of ``jc`` chunks."""
    is_load = phase == "read"
    n = len(keys)
    free = list(range(args.iodepth))
    jobs: dict[int, tuple[list[int], float, list[int]]] = {}
    lat: list[float] = []
    next_i = moved = ops = errors = bad_bytes = 0
    job_id = 0
    perf = time.perf_counter
    deadline = perf() + (args.runtime if timed and args.runtime > 0 else 1e12)
    disk0 = disk_requests(args.dir)
    cprof = CpuProfile(bs, n * bs) if timed and getattr(args, "profile", False) else None
    cpu = _Cpu()
    t0 = perf()
    while True:
        while len(free) >= jc and next_i < n and perf() < deadline:
            idx = [int(i) for i in order[next_i : next_i + jc]]
            rows = [free.pop() for _ in idx]
            next_i += len(idx)
            if not is_load:
                for i, r in zip(idx, rows, strict=True):
                    buf[r * bs : r * bs + 8] = i.to_bytes(8, "little")
            jkeys = [keys[i] for i in idx]
            jobs[job_id] = (rows, perf(), idx)
            if is_load:
                store.submit_load(job_id, jkeys, rows)
            else:
                store.submit_store(job_id, jkeys, rows)
            job_id += 1
        if not jobs:
            break
        outs = store.poll()
        if not outs:
            # Block in the engine (GIL released) rather than spin: on a small
            # machine a polling loop takes CPU from the tier's own I/O threads.
            store.wait_completions(0.002)
            continue
        now = perf()
        for o in outs:
            rows, start, idx = jobs.pop(o.job_id)
            lat.append(now - start)
            moved += o.transfer_bytes
            ops += o.transfer_bytes // bs
            if not o.success:
                errors += len(idx) - (len(o.successful_keys or ()))
            if is_load:
                ok_keys = set(o.successful_keys or ()) if not o.success else None
                for i, r in zip(idx, rows, strict=True):
                    if ok_keys is not None and keys[i] not in ok_keys:
                        continue
                    if buf[r * bs : r * bs + 8] != i.to_bytes(8, "little"):
                        bad_bytes += 1
            free.extend(rows)
    elapsed = perf() - t0
    usr, sys_ = cpu.stop()
    disk1 = disk_requests(args.dir)
    per_chunk = None
    if disk0 is not None and disk1 is not None and ops:
        i = 0 if is_load else 1
        # Block requests the drive completed per chunk moved: above 1 (2 MiB)
        # when the kernel split chunks (scattered pages, max_sectors_kb).
        per_chunk = round((disk1[i] - disk0[i]) / ops, 2)
    mode = getattr(args, "staging_mode", "auto")
    profiled = {"cpu_profile": cprof.report(moved, log)} if cprof is not None else {}
    return PhaseResult(
        level="tier",
        target=tier_target(store.engine_name, mode, getattr(args, "primary_shm_dir", None)),
        phase=phase,
        bs=bs,
        bytes=moved,
        runtime_s=elapsed,
        ops=ops,
        clat_ns=_percentiles(lat),
        cpu_usr_s=usr,
        cpu_sys_s=sys_,
        errors=errors,
        extra={
            "iodepth": args.iodepth,
            "job_chunks": jc,
            "latency_unit": "job",
            "wrong_bytes_loaded": bad_bytes,
            "disk_requests_per_chunk": per_chunk,
            **profiled,
        },
    )
