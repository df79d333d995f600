"""The ``engine`` level: a raw ``IoEngine`` over one preallocated file per job.

Owns: ``run_engine_level`` and the per-job driver ``_engine_job`` (one Python
thread per job, each keeping ``--iodepth`` ops in flight). Blocks for the
length of the run.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from nvmetier.bench.common import _note_drop, _offsets, _phases, _prealloc
from nvmetier.bench.machine import _Cpu, _settle_heap
from nvmetier.bench.report import PhaseResult, _percentiles, _phase_line


def _engine_job(
    engine_name: str,
    fd: int,
    buf: memoryview,
    bs: int,
    offsets: np.ndarray,
    kind: int,
    iodepth: int,
    deadline: float,
    out: dict[str, Any],
    checksum: bool = True,
) -> None:
    """Drive one engine over one file: keep ``iodepth`` ops in flight."""
    from nvmetier.engine import Op, make_engine

    eng = make_engine(engine_name, buf, [fd], io_threads=iodepth, queue_depth=iodepth)
    n = len(offsets)
    lat = np.empty(n, dtype=np.float64)
    started = np.zeros(n, dtype=np.float64)
    free = list(range(iodepth))
    slot_of: dict[int, int] = {}
    issued = done = moved = errors = 0
    perf = time.perf_counter
    t0 = perf()
    try:
        while True:
            batch = []
            if perf() < deadline:
                while free and issued < n:
                    slot = free.pop()
                    batch.append(
                        Op(issued, kind, 0, int(offsets[issued]), slot * bs, bs, 0, checksum)
                    )
                    slot_of[issued] = slot
                    issued += 1
            if batch:
                now = perf()
                for op in batch:
                    started[op.op_id] = now
                eng.submit(batch)
            if done == issued:
                break
            comps = eng.wait_completions(1.0)
            now = perf()
            for c in comps:
                lat[done] = now - started[c.op_id]
                done += 1
                free.append(slot_of.pop(c.op_id))
                if c.result == bs:
                    moved += bs
                else:
                    errors += 1
        out["elapsed"] = perf() - t0
    finally:
        eng.close()
    out.update(lat=lat[:done], moved=moved, ops=done, errors=errors)


def run_engine_level(
    args: argparse.Namespace, bs: int, engine_name: str, log: Callable
) -> list[PhaseResult]:
    from nvmetier.engine import OP_READ, OP_WRITE
    from nvmetier.files import O_DIRECT

    size = args.size // bs * bs
    n = size // bs
    rand = args.rw.startswith("rand")
    bufs = [mmap.mmap(-1, args.iodepth * bs) for _ in range(args.numjobs)]
    pattern = os.urandom(min(bs, 1 << 20))
    for b in bufs:
        for off in range(0, len(b), len(pattern)):
            b[off : off + len(pattern)] = pattern[: len(b) - off]
    paths = [
        os.path.join(args.dir, f"engine-{engine_name}-{bs}-{j}.dat") for j in range(args.numjobs)
    ]
    results: list[PhaseResult] = []
    fds: list[int] = []
    try:
        for p in paths:
            _prealloc(p, size)
            fds.append(os.open(p, os.O_RDWR | (O_DIRECT if args.direct else 0)))
        phases = _phases(args.rw)
        for phase, timed in phases:
            if phase == "read" and timed:
                _note_drop(args, log)
            kind = OP_WRITE if phase == "write" else OP_READ
            deadline = time.perf_counter() + (args.runtime if args.runtime > 0 else 1e12)
            outs: list[dict[str, Any]] = [{} for _ in fds]
            _settle_heap()
            cpu = _Cpu()
            t0 = time.perf_counter()
            threads = [
                threading.Thread(
                    target=_engine_job,
                    args=(
                        engine_name,
                        fd,
                        memoryview(bufs[j]),
                        bs,
                        _offsets(n, bs, rand, j),
                        kind,
                        args.iodepth,
                        deadline if timed else 1e12,
                        outs[j],
                        bool(args.checksum),
                    ),
                )
                for j, fd in enumerate(fds)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.perf_counter() - t0
            usr, sys_ = cpu.stop()
            if any("lat" not in o for o in outs):
                raise RuntimeError("an engine job failed; see the traceback above")
            if not timed:
                continue
            res = PhaseResult(
                level="engine",
                target=f"nvmetier-{engine_name}",
                phase=phase,
                bs=bs,
                bytes=sum(o["moved"] for o in outs),
                runtime_s=elapsed,
                ops=sum(o["ops"] for o in outs),
                clat_ns=_percentiles(np.concatenate([o["lat"] for o in outs])),
                cpu_usr_s=usr,
                cpu_sys_s=sys_,
                errors=sum(o["errors"] for o in outs),
                extra={
                    "iodepth": args.iodepth,
                    "numjobs": args.numjobs,
                    "direct": args.direct,
                    "checksum": bool(args.checksum),
                },
            )
            log(_phase_line(res))
            results.append(res)
    finally:
        for fd in fds:
            os.close(fd)
        for b in bufs:
            b.close()
        if not args.keep:
            for p in paths:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
    return results
