"""fio-style benchmark of nvmetier at three levels, with fio and vLLM's ``fs`` tier beside it.

Owns: the ``nvmetier bench`` / ``tools/bench`` command. Everything here runs on
the calling thread (plus the threads of the engines and stores it builds) and
blocks for the length of the run; it is a tool, never imported by the tier.

Levels (``--level``):

- ``engine``: a raw ``IoEngine`` over one preallocated file per job; ops of
  ``--bs`` bytes with ``--iodepth`` in flight. The engine computes its XXH3 per
  op as it always does; nothing else is verified.
- ``tier``: the full ``BlockStore`` API (store/load jobs, completions collected by ``poll``,
  index records, checksums verified on load) with a plain anonymous mmap as
  the "primary".
- ``vllm``: vLLM's real ``TieringOffloadingManager`` with a simulated GPU
  worker (``nvmetier.vllm.harness``), once with our ``NvmeTierManager`` and once
  with vLLM's own ``fs`` tier, in the same invocation. Store phase = the
  cascade of N chunks (first store to every cascade job finished); load phase =
  reset the primary, then promote every chunk in batches of the primary's
  capacity (one request per batch, so one big promotion job per batch).
- ``reopen``: time ``BlockStore`` open of a store whose index holds ``--slots``
  valid records (written directly with ``format.pack_record``).

``--rw``: ``write``/``randwrite`` time a write pass; ``read``/``randread`` time a
read pass after an untimed write pass (reading unwritten fallocated extents
would return zeros without touching the disk); ``rw`` times a write pass, then
a read pass. Note this differs from fio, where ``rw`` is a mixed workload.

Latency is completion latency as the submitter sees it (submit to reap), per
op at the engine level and per job at the tier level. CPU is ``os.times()`` of
the whole process (all threads), per 10^9 bytes moved. GB/s is 10^9 bytes/s.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import mmap
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from nvmetier.config import TierConfig, format_size, parse_size

LEVELS = ("engine", "tier", "vllm", "reopen")
RW_MODES = ("read", "write", "randread", "randwrite", "rw")
PCTS = (50.0, 90.0, 99.0, 99.9)
GB = 1e9


# --------------------------------------------------------------------- results
@dataclasses.dataclass
class PhaseResult:
    """One measured phase: a target (ours / fs / fio) moving bytes one way."""

    level: str
    target: str  # "nvmetier-threads", "nvmetier-uring", "fs", "fio"
    phase: str  # "write" (store) or "read" (load)
    bs: int
    bytes: int
    runtime_s: float
    ops: int
    clat_ns: dict[str, float]
    cpu_usr_s: float
    cpu_sys_s: float
    errors: int = 0
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    # vllm level: CPU seconds of the tier alone (see ``_TierClock``).
    tier_cpu_s: float | None = None

    def tier_cpu_per_gb(self) -> float | None:
        gb = self.bytes / GB
        if self.tier_cpu_s is None or gb <= 0:
            return None
        return self.tier_cpu_s / gb

    @property
    def bw_gbps(self) -> float:
        return self.bytes / self.runtime_s / GB if self.runtime_s > 0 else 0.0

    @property
    def iops(self) -> float:
        return self.ops / self.runtime_s if self.runtime_s > 0 else 0.0

    def cpu_per_gb(self) -> tuple[float, float]:
        gb = self.bytes / GB
        if gb <= 0:
            return 0.0, 0.0
        return self.cpu_usr_s / gb, self.cpu_sys_s / gb

    def to_json(self) -> dict[str, Any]:
        usr, sys_ = self.cpu_per_gb()
        return {
            "level": self.level,
            "target": self.target,
            "phase": self.phase,
            "bs": self.bs,
            "bytes": self.bytes,
            "runtime_s": round(self.runtime_s, 6),
            "ops": self.ops,
            "iops": round(self.iops, 1),
            "bw_bytes": round(self.bytes / self.runtime_s) if self.runtime_s > 0 else 0,
            "bw_gbps": round(self.bw_gbps, 4),
            "clat_ns": {k: round(v) for k, v in self.clat_ns.items()},
            "cpu": {
                "usr_s": round(self.cpu_usr_s, 4),
                "sys_s": round(self.cpu_sys_s, 4),
                "usr_s_per_gb": round(usr, 4),
                "sys_s_per_gb": round(sys_, 4),
                **(
                    {
                        "tier_s": round(self.tier_cpu_s, 4),
                        "tier_s_per_gb": round(self.tier_cpu_per_gb() or 0.0, 4),
                    }
                    if self.tier_cpu_s is not None
                    else {}
                ),
            },
            "errors": self.errors,
            **({"extra": self.extra} if self.extra else {}),
        }


def _percentiles(lat_s: Sequence[float] | np.ndarray) -> dict[str, float]:
    arr = np.asarray(lat_s, dtype=np.float64)
    if arr.size == 0:
        return {}
    vals = np.percentile(arr, PCTS)
    return {f"p{p:g}": float(v) * 1e9 for p, v in zip(PCTS, vals, strict=True)}


def _settle_heap() -> None:
    """Collect, then freeze the heap, as vLLM's engine core does after start-up
    (``vllm.utils.gc_utils.freeze_gc_heap``). Without it a gen-2 collection over
    vLLM's and torch's objects lands inside the timed phase (tens of ms each)."""
    import gc

    gc.collect()
    gc.freeze()


class _Cpu:
    """Process CPU time (all threads) between construction and ``stop``, and
    the calling thread's share of it (``thread_s`` after ``stop``)."""

    def __init__(self) -> None:
        self.thread_s = 0.0
        self._thread = time.thread_time()
        self._t = os.times()

    def stop(self) -> tuple[float, float]:
        t = os.times()
        self.thread_s = time.thread_time() - self._thread
        return t.user - self._t.user, t.system - self._t.system


class _TierClock:
    """CPU time a secondary tier costs, apart from vLLM's and the harness's.

    Every method of the ``SecondaryTierManager`` interface is wrapped on the
    instance (the orchestrator calls them through the instance) to add up the
    scheduler thread's CPU time spent inside them. The tier's own threads (our
    engine's I/O thread or pool, the ``fs`` tier's workers) are the process's
    other threads: in this benchmark every thread but the scheduler's belongs
    to the tier. So the tier's CPU = time inside its methods + (process CPU -
    scheduler-thread CPU). Scheduler thread only.
    """

    METHODS = (
        "lookup",
        "touch",
        "on_new_request",
        "on_request_finished",
        "on_schedule_end",
        "submit_store",
        "submit_load",
        "get_finished_jobs",
        "has_pending_work",
        "take_events",
        "drain_jobs",
        "serve_external_requests",
    )

    def __init__(self, tier: Any) -> None:
        self.inside_ns = 0
        self._tier = tier
        self._wrapped: list[str] = []
        for name in self.METHODS:
            method = getattr(tier, name, None)
            if callable(method) and name not in vars(tier):
                setattr(tier, name, self._wrap(method))
                self._wrapped.append(name)

    def remove(self) -> None:
        """Unwrap the methods (before timing one of them directly)."""
        for name in self._wrapped:
            delattr(self._tier, name)
        self._wrapped = []

    def _wrap(self, method: Callable) -> Callable:
        clock = time.thread_time_ns

        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return method(*args, **kwargs)
            finally:
                self.inside_ns += clock() - t0

        return timed

    def start(self) -> _Cpu:
        self.inside_ns = 0
        return _Cpu()

    def tier_s(self, cpu: _Cpu, usr: float, sys_: float) -> float:
        """The tier's CPU seconds since ``start`` (call after ``cpu.stop``)."""
        other_threads = max(0.0, usr + sys_ - cpu.thread_s)
        return other_threads + self.inside_ns / 1e9


# ------------------------------------------------------------------ machine
def drop_caches() -> tuple[bool, str]:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``. Never raises."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True, "dropped"
    except OSError as exc:
        return False, f"could not drop the page cache ({exc}); buffered reads may be inflated"


def _fs_of(path: str) -> str:
    """``"ext4 on /dev/vda"`` for the mount holding ``path``."""
    path = os.path.realpath(path)
    best = ("", "?", "?")
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best[0]):
                best = (mnt, fstype, dev)
    return f"{best[1]} on {best[2]} (mounted at {best[0]})"


def machine_info(directory: str) -> dict[str, Any]:
    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = 0
    with contextlib.suppress(OSError, ValueError):
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host_cpus": os.cpu_count(),
        "cpu_model": cpu,
        "memory": format_size(mem) if mem else "?",
        "kernel": platform.release(),
        "python": platform.python_version(),
        "filesystem": _fs_of(directory),
        "free_bytes": shutil.disk_usage(directory).free,
    }


# ------------------------------------------------------------------ engine level
def _offsets(n: int, bs: int, rand: bool, seed: int) -> np.ndarray:
    idx = np.arange(n, dtype=np.int64)
    if rand:
        np.random.default_rng(seed).shuffle(idx)
    return idx * bs


def _prealloc(path: str, size: int) -> None:
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


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


def _phases(rw: str) -> list[tuple[str, bool]]:
    """``(phase, timed)`` in order for an ``--rw`` mode."""
    if rw in ("write", "randwrite"):
        return [("write", True)]
    if rw in ("read", "randread"):
        return [("write", False), ("read", True)]
    return [("write", True), ("read", True)]


def _note_drop(args: argparse.Namespace, log: Callable) -> None:
    if args.no_drop_caches:
        return
    ok, why = drop_caches()
    if not ok and why not in args._notes:
        args._notes.append(why)
        log("note: " + why)


# -------------------------------------------------------------------- tier level
def _tier_config(args: argparse.Namespace, root: str, bs: int, n_chunks: int) -> TierConfig:
    # 2x the data: a set-associative index with 16 ways then overflows a set for
    # well under 1% of keys (Poisson mean 8 per set), so little is evicted.
    cap = 2 * n_chunks * (bs + 128) + (64 << 20)
    return TierConfig.from_dict(
        {
            "root_dir": root,
            "capacity_bytes": cap,
            "io_threads": args.iodepth,
            "queue_depth": args.iodepth,
            "max_inflight_bytes": args.iodepth * bs,
            "max_queued_bytes": max(1 << 30, 2 * args.iodepth * bs),
            "o_direct": bool(args.direct),
            "persist": False,
        }
    )


def run_tier_level(
    args: argparse.Namespace, bs: int, engine_name: str, log: Callable
) -> list[PhaseResult]:
    from nvmetier.store import BlockStore

    n = args.size // bs
    jc = max(1, min(args.job_chunks, args.iodepth))
    rows = args.iodepth
    root = os.path.join(args.dir, f"tier-{engine_name}-{bs}")
    cfg = _tier_config(args, root, bs, n)
    buf = mmap.mmap(-1, rows * bs)
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
            res = _tier_phase(store, buf, bs, keys, order, phase, jc, args, timed)
            if timed:
                log(_phase_line(res))
                results.append(res)
        stats = store.stats()
        for phase_res in results:
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
            shutil.rmtree(root, ignore_errors=True)
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
            time.sleep(50e-6)
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
    return PhaseResult(
        level="tier",
        target=f"nvmetier-{store.engine_name}",
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
        },
    )


# -------------------------------------------------------------------- vllm level
@dataclasses.dataclass
class LookupStats:
    hit_ns: dict[str, float]
    miss_ns: dict[str, float]
    results: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return {
            "hit_ns": {k: round(v) for k, v in self.hit_ns.items()},
            "miss_ns": {k: round(v) for k, v in self.miss_ns.items()},
            "results": self.results,
        }


def _vllm_tier_dict(args: argparse.Namespace, which: str, root: str, bs: int, n: int) -> dict:
    if which == "fs":
        return {"type": "fs", "root_dir": root}
    cap = 2 * n * (bs + 128) + (64 << 20)
    return {
        "type": "NvmeTierManager",
        "module_path": "nvmetier.vllm",
        "root_dir": root,
        "capacity_bytes": cap,
        "io_engine": which.removeprefix("nvmetier-"),
        "io_threads": args.iodepth,
        "queue_depth": args.iodepth,
        "o_direct": bool(args.direct),
        "persist": False,
    }


def run_vllm_level(
    args: argparse.Namespace, bs: int, which: str, log: Callable
) -> tuple[list[PhaseResult], LookupStats | None]:
    """Store then load ``--size`` bytes of ``bs`` chunks through vLLM's orchestrator."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

    from nvmetier.vllm.harness import SimulatedEngine, key_of, make_config

    n = args.size // bs
    cpu_chunks = max(1, args.primary // bs)
    root = os.path.join(args.dir, f"vllm-{which}-{bs}")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root, exist_ok=True)
    tier = _vllm_tier_dict(args, which, root, bs, n)
    eng = SimulatedEngine(make_config([tier], chunk_bytes=bs, cpu_chunks=cpu_chunks))
    m = eng.manager
    clock = _TierClock(eng.tiers[0])
    keys = [key_of(i) for i in range(n)]
    index_of = {k: i for i, k in enumerate(keys)}
    base = np.frombuffer(os.urandom(bs), dtype=np.uint8)
    end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    step_s = args.step_ms / 1000.0
    results: list[PhaseResult] = []
    lookups: LookupStats | None = None

    def wait_idle(timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with m.lock:
                m.on_schedule_end(end)
                if not m.has_pending_work():
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{which}: tiers still busy after {timeout_s:.0f}s")
            time.sleep(step_s)

    try:
        _note_drop(args, log)
        # ---- store: GPU -> primary, cascaded by the orchestrator to the tier.
        batch = max(1, min(args.store_batch, cpu_chunks))
        # In a deployment the GPU's copy engine fills a row, not a CPU: write
        # the pattern into every row now, untimed, and only each chunk's 8-byte
        # stamp inside the timed phase, so the CPU figures are the tier's and
        # the orchestrator's rather than a simulated memcpy's.
        eng.rows[:] = base
        _settle_heap()
        cpu = clock.start()
        t0 = time.perf_counter()
        i = 0
        req = 0
        full_waits = 0
        while i < n:
            part = keys[i : i + batch]
            ctx = ReqContext(req_id=f"store-{req}")
            req += 1
            with m.lock:
                m.on_new_request(ctx)
                out = m.prepare_store(part, ctx)
                if out is None:
                    m.on_request_finished(ctx)
                    m.on_schedule_end(end)
            if out is None:  # primary full of chunks still being cascaded
                full_waits += 1
                time.sleep(step_s)
                continue
            for key, cid in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
                eng.rows[int(cid), :8] = np.frombuffer(
                    index_of[key].to_bytes(8, "little"), dtype=np.uint8
                )
            with m.lock:
                if out.keys_to_store:
                    m.complete_store(out.keys_to_store, ctx)
                m.on_request_finished(ctx)
                m.on_schedule_end(end)
            i += batch
        wait_idle()
        elapsed = time.perf_counter() - t0
        usr, sys_ = cpu.stop()
        tier_s = clock.tier_s(cpu, usr, sys_)
        stored_bytes = n * bs
        extra: dict[str, Any] = {
            "tier_cpu_on_scheduler_s": round(clock.inside_ns / 1e9, 4),
            "chunks": n,
            "store_batch": batch,
            "primary_full_waits": full_waits,
        }
        if which != "fs":
            st = eng.tiers[0].store.stats()
            stored_bytes = int(st.get("bytes_written", 0))
            extra["dropped"] = {
                k: st.get(k, 0)
                for k in ("stores_dropped_set_busy", "stores_dropped_queue_full", "evictions")
            }
        res = PhaseResult(
            "vllm",
            which,
            "write",
            bs,
            stored_bytes,
            elapsed,
            stored_bytes // bs,
            {},
            usr,
            sys_,
            extra=extra,
            tier_cpu_s=tier_s,
        )
        log(_phase_line(res))
        results.append(res)

        # ---- load: empty the primary, then promote in batches of its capacity.
        _note_drop(args, log)
        eng.reset_primary()
        # Zero the rows (untimed) so that a verified row proves its load.
        eng.rows[:] = 0
        _settle_heap()
        per_req = cpu_chunks
        loaded = misses = retries = 0
        job_lat: list[float] = []
        lookup_s = 0.0
        retry_s = args.retry_ms / 1000.0
        cpu = clock.start()
        busy = 0.0
        last: list[bytes] = []
        for b in range(0, n, per_req):
            part = keys[b : b + per_req]
            ctx = ReqContext(req_id=f"load-{b}")
            t0 = time.perf_counter()
            with m.lock:
                m.on_new_request(ctx)
            pending = part
            promoted = []
            while pending:
                still = []
                with m.lock:
                    for key in pending:
                        r = m.lookup(key, ctx)
                        if r is LookupResult.RETRY:
                            still.append(key)
                        elif r is LookupResult.MISS:
                            misses += 1
                        else:
                            promoted.append(key)
                    m.on_schedule_end(ScheduleEndContext((ctx.req_id,), ()))
                retries += len(still)
                pending = still
                if pending:
                    # A real scheduler re-scans a deferred request once per
                    # step; re-scanning every 0.2 ms would starve the tier's
                    # lookup thread of the GIL.
                    time.sleep(retry_s)
            lookup_s += time.perf_counter() - t0
            wait_idle()
            dt = time.perf_counter() - t0
            busy += dt
            job_lat.append(dt)
            # Not timed: which promoted keys actually landed in the primary.
            probe = ReqContext(req_id=f"probe-{b}")
            with m.lock:
                landed = sum(m.primary_tier.lookup(k, probe) is LookupResult.HIT for k in promoted)
                m.on_request_finished(ctx)
            loaded += landed
            last = [k for k in promoted[:: max(1, len(promoted) // 32)]][:32]
        usr, sys_ = cpu.stop()
        tier_s = clock.tier_s(cpu, usr, sys_)
        verified = _vllm_verify(eng, last, index_of, base)
        res = PhaseResult(
            "vllm",
            which,
            "read",
            bs,
            loaded * bs,
            busy,
            loaded,
            _percentiles(job_lat),
            usr,
            sys_,
            errors=n - loaded,
            extra={
                "tier_cpu_on_scheduler_s": round(clock.inside_ns / 1e9, 4),
                "chunks": n,
                "chunks_per_request": per_req,
                "lookup_misses": misses,
                "lookup_retries": retries,
                "lookup_and_submit_s": round(lookup_s, 4),
                "verified_sample": f"{verified}/{len(last)}",
                "latency_unit": "promotion batch",
            },
            tier_cpu_s=tier_s,
        )
        log(_phase_line(res))
        results.append(res)
        clock.remove()
        if which != "fs":
            lookups = _lookup_latency(eng, keys, n, args.lookups)
            log(
                f"  lookup {which} bs={_bs(bs)}: "
                f"hit p50 {lookups.hit_ns.get('p50', 0) / 1e3:.2f} us"
                f" p99 {lookups.hit_ns.get('p99', 0) / 1e3:.2f} us; miss p50 "
                f"{lookups.miss_ns.get('p50', 0) / 1e3:.2f} us p99 "
                f"{lookups.miss_ns.get('p99', 0) / 1e3:.2f} us; {lookups.results}"
            )
    finally:
        eng.shutdown()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return results, lookups


def _vllm_verify(
    eng: Any, sample: list[bytes], index_of: dict[bytes, int], base: np.ndarray
) -> int:
    """Count sample keys whose primary bytes are the ones stored."""
    if not sample:
        return 0
    got = eng.read_primary(sample)
    ok = 0
    for key, row in zip(sample, got, strict=True):
        want = base.copy()
        want[:8] = np.frombuffer(index_of[key].to_bytes(8, "little"), dtype=np.uint8)
        ok += bool(np.array_equal(row, want))
    return ok


def _lookup_latency(eng: Any, keys: list[bytes], n: int, count: int) -> LookupStats:
    """Time ``NvmeTierManager.lookup`` directly: stored keys (hits) and absent ones."""
    from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext

    from nvmetier.vllm.harness import key_of

    tier = eng.tiers[0]
    ctx = ReqContext(req_id="lookup-bench")
    rng = np.random.default_rng(7)
    hits = [keys[int(i)] for i in rng.integers(0, n, size=count)]
    misses = [key_of(n + 1_000_000 + i) for i in range(count)]
    outcomes: dict[str, int] = {}
    perf = time.perf_counter_ns
    out: list[list[float]] = []
    with eng.manager.lock:
        for sample in (hits, misses):
            lat = []
            for key in sample:
                t = perf()
                r = tier.lookup(key, ctx)
                lat.append((perf() - t) / 1e9)
                outcomes[r.name] = outcomes.get(r.name, 0) + 1
            out.append(lat)
            tier.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
    return LookupStats(_percentiles(out[0]), _percentiles(out[1]), outcomes)


# --------------------------------------------------------------------- reopen
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


# ------------------------------------------------------------------------ fio
def fio_engine(directory: str) -> tuple[str | None, list[str], str]:
    """The best fio ioengine that works here: io_uring+fixedbufs, libaio, psync."""
    if shutil.which("fio") is None:
        return None, [], "fio is not installed"
    probe = os.path.join(directory, "fio-probe.dat")
    try:
        for engine, extra in (
            ("io_uring", ["--fixedbufs=1"]),
            ("io_uring", []),
            ("libaio", []),
            ("psync", []),
        ):
            cmd = [
                "fio",
                "--name=probe",
                f"--ioengine={engine}",
                *extra,
                f"--filename={probe}",
                "--size=1m",
                "--bs=64k",
                "--rw=write",
                "--direct=1",
                "--output-format=json",
            ]
            r = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if r.returncode == 0:
                return engine, extra, " ".join([f"--ioengine={engine}", *extra])
        return None, [], "fio failed with io_uring, libaio and psync"
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(probe)


def run_fio(
    args: argparse.Namespace,
    bs: int,
    rw: str,
    rand_pattern: bool,
    engine: str,
    extra: list[str],
    log: Callable,
    level: str,
) -> list[PhaseResult]:
    """fio on a fresh fallocated file in ``--dir``, same bs/iodepth/size/direct/numjobs."""
    size = args.size // bs * bs
    paths = [os.path.join(args.dir, f"fiobench.{j}.0") for j in range(args.numjobs)]
    rand = "rand" if rand_pattern else ""
    results: list[PhaseResult] = []
    try:
        for p in paths:
            _prealloc(p, size)
        for phase, timed in _phases(rw):
            if phase == "read" and timed:
                _note_drop(args, log)
            fio_rw = rand + ("write" if phase == "write" else "read")
            cmd = [
                "fio",
                "--name=fiobench",
                f"--directory={args.dir}",
                f"--ioengine={engine}",
                *extra,
                f"--rw={fio_rw}",
                f"--bs={bs}",
                f"--iodepth={args.iodepth}",
                f"--size={size}",
                f"--direct={args.direct}",
                f"--numjobs={args.numjobs}",
                "--group_reporting",
                "--percentile_list=50:90:99:99.9",
                "--output-format=json",
                "--randrepeat=0",
            ]
            if args.runtime > 0:
                cmd.append(f"--runtime={args.runtime}")
            r = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if r.returncode != 0:
                raise RuntimeError(f"fio failed ({r.returncode}): {r.stderr.strip()[:500]}")
            job = json.loads(r.stdout[r.stdout.index("{") :])["jobs"][0]
            if not timed:
                continue
            side = job["write" if phase == "write" else "read"]
            runtime_s = job["job_runtime"] / 1000.0 / max(1, args.numjobs)
            runtime_s = side["io_bytes"] / side["bw_bytes"] if side["bw_bytes"] else runtime_s
            pct = side.get("clat_ns", {}).get("percentile", {})
            clat: dict[str, float] = {}
            for pc in PCTS:
                v = pct.get(f"{pc:.6f}")
                if v is not None:
                    clat[f"p{pc:g}"] = float(v)
            cpu_total = job["job_runtime"] / 1000.0
            res = PhaseResult(
                level=level,
                target="fio",
                phase=phase,
                bs=bs,
                bytes=int(side["io_bytes"]),
                runtime_s=runtime_s,
                ops=int(side["total_ios"]),
                clat_ns=clat,
                cpu_usr_s=job["usr_cpu"] / 100.0 * cpu_total,
                cpu_sys_s=job["sys_cpu"] / 100.0 * cpu_total,
                errors=int(job.get("error", 0)),
                extra={"cmd": " ".join(cmd), "rw": fio_rw},
            )
            log(_phase_line(res))
            results.append(res)
    finally:
        if not args.keep:
            for p in paths:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
    return results


# --------------------------------------------------------------------- output
def _bs(bs: int) -> str:
    if bs % (1 << 20) == 0:
        return f"{bs >> 20}MiB"
    return f"{bs >> 10}KiB" if bs % 1024 == 0 else f"{bs}B"


def _phase_name(level: str, phase: str) -> str:
    """``store``/``load`` at the vllm level (vLLM's words), else ``write``/``read``."""
    if level == "vllm":
        return "store" if phase == "write" else "load"
    return phase


def _phase_line(r: PhaseResult) -> str:
    usr, sys_ = r.cpu_per_gb()
    c = r.clat_ns
    lat = ""
    if c:
        lat = "clat " + " ".join(f"{k}={_ns(v)}" for k, v in c.items())
    name = _phase_name(r.level, r.phase)
    return (
        f"{r.level:>6} {r.target:<17} {name:<5} bs={_bs(r.bs):<7} "
        f"bw={r.bw_gbps:6.3f}GB/s iops={r.iops:9.0f} {_bytes(r.bytes)} in {r.runtime_s:.2f}s "
        f"cpu usr={usr:.3f} sys={sys_:.3f} s/GB "
        + (f"tier={tier:.3f} s/GB " if (tier := r.tier_cpu_per_gb()) is not None else "")
        + lat
        + (f" errors={r.errors}" if r.errors else "")
    )


def _ns(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:.2f}ms"
    if v >= 1e3:
        return f"{v / 1e3:.0f}us"
    return f"{v:.0f}ns"


def _bytes(n: int) -> str:
    return format_size(n).replace(" ", "")


def _find(results: list[PhaseResult], target: str, phase: str, bs: int) -> PhaseResult | None:
    for r in results:
        if r.target == target and r.phase == phase and r.bs == bs:
            return r
    return None


def summary_table(results: list[PhaseResult], bss: list[int]) -> tuple[list[str], list[dict]]:
    """Side-by-side GB/s per chunk size, with ratios to fio and to the fs tier."""
    targets = []
    for r in results:
        if r.target not in targets:
            targets.append(r.target)
    ours = [t for t in targets if t.startswith("nvmetier")]
    lines = []
    rows: list[dict] = []
    head = "| phase | bs | " + " | ".join(f"{t} GB/s" for t in targets)
    ratios = []
    for o in ours:
        if "fio" in targets:
            ratios.append((o, "fio"))
        if "fs" in targets:
            ratios.append((o, "fs"))
    head += "".join(f" | {a}/{b}" for a, b in ratios) + " |"
    lines.append(head)
    lines.append("|" + "---|" * (2 + len(targets) + len(ratios)))
    for phase in ("write", "read"):
        for bs in bss:
            cells = []
            row: dict[str, Any] = {"phase": phase, "bs": bs}
            have = False
            for t in targets:
                found = _find(results, t, phase, bs)
                cells.append(f"{found.bw_gbps:.3f}" if found else "-")
                if found:
                    row[t] = round(found.bw_gbps, 4)
                    have = True
            if not have:
                continue
            for a, b in ratios:
                ra, rb = _find(results, a, phase, bs), _find(results, b, phase, bs)
                if ra and rb and rb.bw_gbps > 0:
                    q = ra.bw_gbps / rb.bw_gbps
                    cells.append(f"{q:.2f}")
                    row[f"{a}/{b}"] = round(q, 3)
                else:
                    cells.append("-")
            pname = _phase_name(results[0].level, phase)
            lines.append(f"| {pname} | {_bs(bs)} | " + " | ".join(cells) + " |")
            rows.append(row)
    return lines, rows


def cpu_table(results: list[PhaseResult]) -> list[str]:
    lines = [
        "| target | phase | bs | GB/s | IOPS | clat p50 | p90 | p99 | p99.9 "
        "| CPU usr+sys s/GB | tier CPU s/GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        usr, sys_ = r.cpu_per_gb()
        c = r.clat_ns
        tier = r.tier_cpu_per_gb()
        lines.append(
            f"| {r.target} | {r.phase} | {_bs(r.bs)} | {r.bw_gbps:.3f} | {r.iops:.0f} | "
            + " | ".join(_ns(c[k]) if k in c else "-" for k in ("p50", "p90", "p99", "p99.9"))
            + f" | {usr:.3f}+{sys_:.3f} | "
            + ("-" if tier is None else f"{tier:.3f}")
            + " |"
        )
    return lines


def plot(results: list[PhaseResult], path: str, title: str) -> str:
    """Throughput vs chunk size, store and load panels. Returns a message."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"matplotlib is not installed; skipped the plot {path} (pip install matplotlib)"
    targets = []
    for r in results:
        if r.target not in targets:
            targets.append(r.target)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    level = results[0].level if results else ""
    for ax, phase in zip(axes, ("write", "read"), strict=True):
        for t in targets:
            pts = sorted((r.bs, r.bw_gbps) for r in results if r.target == t and r.phase == phase)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=t)
        ax.set_xscale("log", base=2)
        bss = sorted({r.bs for r in results})
        ax.set_xticks(bss)
        ax.set_xticklabels([_bs(b) for b in bss])
        ax.set_xlabel("chunk size (bs)")
        name = _phase_name(level, phase)
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[0].legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


# ----------------------------------------------------------------------- main
def _parse_bs_list(value: str) -> list[int]:
    return [parse_size(v.strip(), "--bs") for v in value.split(",") if v.strip()]


# ------------------------------------------------------------- summarize
def _result_from_json(d: dict[str, Any]) -> PhaseResult:
    cpu = d.get("cpu", {})
    return PhaseResult(
        level=d["level"],
        target=d["target"],
        phase=d["phase"],
        bs=int(d["bs"]),
        bytes=int(d["bytes"]),
        runtime_s=float(d["runtime_s"]),
        ops=int(d["ops"]),
        clat_ns=dict(d.get("clat_ns", {})),
        cpu_usr_s=float(cpu.get("usr_s", 0.0)),
        cpu_sys_s=float(cpu.get("sys_s", 0.0)),
        errors=int(d.get("errors", 0)),
        extra=dict(d.get("extra", {})),
        tier_cpu_s=cpu.get("tier_s"),
    )


def summarize(paths: Sequence[str], plot_path: str | None = None) -> tuple[list[str], int]:
    """Median tables over several ``--output-format json`` reports.

    For each (target, phase, bs): the median GB/s with (min-max), the ratios
    of the medians (each of our engines to fio, to the fs tier, and uring to
    threads), and the median CPU per GB (whole process, and the tier's own at
    the vllm level). With ``plot_path``, the medians are plotted.

    Returns the report lines and an exit code (2: a file is unreadable).
    """
    import statistics

    runs: dict[tuple[str, str, int], list[PhaseResult]] = {}
    order: list[str] = []
    level = ""
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                report = json.load(f)
            results = [_result_from_json(r) for r in report["results"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return [f"nvmetier bench: cannot read {path}: {exc}"], 2
        for r in results:
            level = r.level
            if r.target not in order:
                order.append(r.target)
            runs.setdefault((r.target, r.phase, r.bs), []).append(r)
    bss = sorted({bs for _, _, bs in runs})
    med: dict[tuple[str, str, int], float] = {
        k: statistics.median(r.bw_gbps for r in v) for k, v in runs.items()
    }
    ours = [t for t in order if t.startswith("nvmetier")]
    pairs: list[tuple[str, str]] = [(o, ref) for o in ours for ref in ("fio", "fs") if ref in order]
    if "nvmetier-uring" in order and "nvmetier-threads" in order:
        pairs.append(("nvmetier-uring", "nvmetier-threads"))
    short = {t: t.removeprefix("nvmetier-") for t in order}
    lines = [f"{len(paths)} reports; GB/s median (min-max); ratios divide the medians", ""]
    lines.append(
        "| phase | bs | "
        + " | ".join(short[t] for t in order)
        + "".join(f" | {short[a]}/{short[b]}" for a, b in pairs)
        + " |"
    )
    lines.append("|" + "---|" * (2 + len(order) + len(pairs)))
    for phase in ("write", "read"):
        for bs in bss:
            if not any((t, phase, bs) in runs for t in order):
                continue
            cells = []
            for t in order:
                v = runs.get((t, phase, bs))
                if not v:
                    cells.append("-")
                    continue
                bws = [r.bw_gbps for r in v]
                cells.append(f"{med[(t, phase, bs)]:.3f} ({min(bws):.2f}-{max(bws):.2f})")
            for a, b in pairs:
                ma, mb = med.get((a, phase, bs)), med.get((b, phase, bs))
                cells.append(f"{ma / mb:.2f}" if ma and mb else "-")
            lines.append(f"| {_phase_name(level, phase)} | {_bs(bs)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "CPU s/GB (usr+sys), median: whole process, and (vllm level) the tier's own",
        "",
    ]
    both = ("nvmetier-uring", "nvmetier-threads")
    with_ratio = all(t in order for t in both)
    lines.append(
        "| phase | bs | "
        + " | ".join(f"{short[t]}" for t in order)
        + (" | uring/threads |" if with_ratio else " |")
    )
    lines.append("|" + "---|" * (2 + len(order) + with_ratio))

    def cpu_of(v: list[PhaseResult]) -> tuple[float, float | None]:
        proc = statistics.median(sum(r.cpu_per_gb()) for r in v)
        tiers = [x for r in v if (x := r.tier_cpu_per_gb()) is not None]
        return proc, statistics.median(tiers) if tiers else None

    for phase in ("write", "read"):
        for bs in bss:
            cells = []
            cpu: dict[str, tuple[float, float | None]] = {}
            for t in order:
                v = runs.get((t, phase, bs))
                if not v:
                    cells.append("-")
                    continue
                cpu[t] = proc, tier = cpu_of(v)
                cells.append(f"{proc:.2f}" + (f" (tier {tier:.2f})" if tier is not None else ""))
            if with_ratio and all(t in cpu for t in both):
                (pu, tu), (pt, tt) = cpu[both[0]], cpu[both[1]]
                q = f"{pu / pt:.2f}" if pt else "-"
                if tu is not None and tt:
                    q += f" (tier {tu / tt:.2f})"
                cells.append(q)
            elif with_ratio:
                cells.append("-")
            if any(c != "-" for c in cells):
                lines.append(
                    f"| {_phase_name(level, phase)} | {_bs(bs)} | " + " | ".join(cells) + " |"
                )
    if plot_path:
        medians = [
            dataclasses.replace(v[0], bytes=round(med[k] * GB), runtime_s=1.0)
            for k, v in runs.items()
        ]
        lines += ["", plot(medians, plot_path, f"median of {len(paths)} runs")]
    return lines, 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nvmetier bench",
        description="fio-style benchmark of nvmetier (engine, tier, through vLLM) "
        "with vLLM's fs tier and fio beside it.",
    )
    p.add_argument("--level", choices=LEVELS, default="tier")
    p.add_argument(
        "--summarize",
        nargs="+",
        metavar="JSON",
        help="print median tables of earlier --output-format json reports (with --plot: "
        "plot the medians) and exit",
    )
    p.add_argument(
        "--rw",
        choices=RW_MODES,
        default="rw",
        help="rw = a write pass then a read pass (not fio's mixed rw)",
    )
    p.add_argument("--bs", default="64k,256k,2m", help="block/chunk sizes, comma-separated")
    p.add_argument("--iodepth", type=int, default=32)
    p.add_argument("--size", default="1g", help="bytes per size, per target (per job)")
    p.add_argument("--runtime", type=float, default=0.0, help="cap per phase in seconds (0: none)")
    p.add_argument("--numjobs", type=int, default=1, help="engine/tier levels: parallel jobs")
    p.add_argument(
        "--engine",
        default="threads",
        help="threads, uring, or a comma-separated list (uring is skipped if unusable)",
    )
    p.add_argument("--direct", type=int, choices=(0, 1), default=1)
    p.add_argument(
        "--checksum",
        type=int,
        choices=(0, 1),
        default=1,
        help="engine level: 0 skips the per-op XXH3 (the raw I/O cost, as fio)",
    )
    p.add_argument("--dir", default=None, help="folder for the files (default: a temp dir under .)")
    p.add_argument("--output-format", choices=("normal", "json"), default="normal")
    p.add_argument("--compare-fio", action="store_true", help="run fio with the same parameters")
    p.add_argument("--no-fs-tier", action="store_true", help="vllm level: skip vLLM's fs tier")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of GB/s vs bs")
    p.add_argument("--keep", action="store_true", help="keep the files it created")
    p.add_argument("--no-drop-caches", action="store_true")
    p.add_argument("--primary", default="512m", help="vllm level: CPU primary tier size")
    p.add_argument(
        "--store-batch",
        type=int,
        default=16,
        help="vllm level: chunks per store request (one cascade job each)",
    )
    p.add_argument(
        "--step-ms",
        type=float,
        default=0.2,
        help="vllm level: pause between simulated engine steps",
    )
    p.add_argument(
        "--retry-ms",
        type=float,
        default=5.0,
        help="vllm level: pause before re-scanning keys a tier answered RETRY (a step)",
    )
    p.add_argument("--job-chunks", type=int, default=1, help="tier level: chunks per job")
    p.add_argument("--lookups", type=int, default=20000, help="vllm level: lookups timed")
    p.add_argument("--slots", default="1m", help="reopen level: slots in the store (1m = 2^20)")
    p.add_argument("--profile", action="store_true", help="reopen level: cProfile the open")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.summarize:
        lines, rc = summarize(args.summarize, args.plot)
        print("\n".join(lines), file=sys.stderr if rc else sys.stdout)
        return rc
    try:
        args.size = parse_size(args.size, "--size")
        args.primary = parse_size(args.primary, "--primary")
        args.slots = parse_size(args.slots, "--slots")
        bss = _parse_bs_list(args.bs)
    except ValueError as exc:
        print(f"nvmetier bench: {exc}", file=sys.stderr)
        return 2
    if args.iodepth < 1 or args.numjobs < 1:
        print("nvmetier bench: --iodepth and --numjobs must be >= 1", file=sys.stderr)
        return 2
    if args.level == "vllm" and args.numjobs != 1:
        print(
            "nvmetier bench: the vllm level drives one orchestrator; use --numjobs 1",
            file=sys.stderr,
        )
        return 2
    for bs in bss:
        if bs % 4096:
            print(f"nvmetier bench: --bs {bs} is not a multiple of 4096", file=sys.stderr)
            return 2
    quiet = args.output_format == "json"

    def log(msg: str) -> None:
        print(msg, file=sys.stderr if quiet else sys.stdout, flush=True)

    made_dir = args.dir is None
    if made_dir:
        args.dir = tempfile.mkdtemp(prefix="nvmetier-bench-", dir=os.getcwd())
    else:
        os.makedirs(args.dir, exist_ok=True)
    args._notes = []
    report: dict[str, Any] = {
        "command": "nvmetier bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "level": args.level,
        "params": {
            "rw": args.rw,
            "bs": bss,
            "iodepth": args.iodepth,
            "size": args.size,
            "runtime": args.runtime,
            "numjobs": args.numjobs,
            "direct": args.direct,
            "dir": args.dir,
        },
        "machine": machine_info(args.dir),
    }
    try:
        rc = _run(args, bss, report, log)
    finally:
        import gc

        gc.unfreeze()  # let extension objects die normally at exit
        if made_dir and not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    report["notes"] = args._notes
    if quiet:
        print(json.dumps(report, indent=2, default=str))
    else:
        for n in args._notes:
            print("note:", n)
    return rc


def _engines(args: argparse.Namespace, log: Callable) -> list[str]:
    from nvmetier.engine import uring_status

    out = []
    for e in (x.strip() for x in args.engine.split(",") if x.strip()):
        if e not in ("threads", "uring"):
            raise ValueError(f"--engine {e!r}: use threads or uring")
        if e == "uring":
            ok, why = uring_status()
            if not ok:
                msg = f"skipping --engine uring: io_uring engine unusable here ({why})"
                args._notes.append(msg)
                log("note: " + msg)
                continue
        out.append(e)
    return out


def _run(args: argparse.Namespace, bss: list[int], report: dict[str, Any], log: Callable) -> int:
    m = report["machine"]
    log(
        f"nvmetier bench: level={args.level} rw={args.rw} bs={','.join(_bs(b) for b in bss)} "
        f"iodepth={args.iodepth} size={_bytes(args.size)} direct={args.direct} dir={args.dir}"
    )
    log(
        f"machine: {m['host_cpus']} CPUs ({m['cpu_model']}), {m['memory']} RAM, "
        f"kernel {m['kernel']}, {m['filesystem']}"
    )
    if args.level == "reopen":
        report["reopen"] = run_reopen(args, log)
        return 0
    try:
        engines = _engines(args, log)
    except ValueError as exc:
        print(f"nvmetier bench: {exc}", file=sys.stderr)
        return 2
    fio = None
    if args.compare_fio:
        engine, extra, desc = fio_engine(args.dir)
        if engine is None:
            args._notes.append(f"--compare-fio skipped: {desc}")
            log("note: " + args._notes[-1])
        else:
            fio = (engine, extra)
            report["fio_engine"] = desc
            log(f"fio: {desc}")
    results: list[PhaseResult] = []
    lookups: dict[str, Any] = {}
    for bs in bss:
        for e in engines:
            if args.level == "engine":
                results += run_engine_level(args, bs, e, log)
            elif args.level == "tier":
                results += run_tier_level(args, bs, e, log)
            else:
                res, lk = run_vllm_level(args, bs, f"nvmetier-{e}", log)
                results += res
                if lk is not None:
                    lookups[f"nvmetier-{e}/{_bs(bs)}"] = lk.to_json()
        if args.level == "vllm" and not args.no_fs_tier:
            res, _ = run_vllm_level(args, bs, "fs", log)
            results += res
        if fio is not None:
            # Our tiers place chunks by key hash: compare with fio's random pattern.
            rand = args.rw.startswith("rand") or args.level in ("tier", "vllm")
            results += run_fio(args, bs, args.rw, rand, fio[0], fio[1], log, args.level)
    report["results"] = [r.to_json() for r in results]
    table, rows = summary_table(results, bss)
    report["summary"] = rows
    if lookups:
        report["lookup_latency"] = lookups
    if args.output_format != "json":
        print()
        print("\n".join(table))
        print()
        print("\n".join(cpu_table(results)))
        for name, lk in lookups.items():
            print(f"lookup {name}: hit {lk['hit_ns']} miss {lk['miss_ns']} results {lk['results']}")
    if args.plot:
        title = (
            f"nvmetier bench --level {args.level}, iodepth {args.iodepth}, "
            f"{_bytes(args.size)} per size, direct={args.direct}"
        )
        msg = plot(results, args.plot, title)
        log(msg)
        if msg.startswith("matplotlib"):
            args._notes.append(msg)
    return 0
