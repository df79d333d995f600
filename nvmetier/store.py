"""BlockStore: the tier's data path — index + files + engine + completions.

Owns: one store (its ``StoreFiles``, ``SlotIndex``, ``IoEngine``) and one
completion thread.

Threads and locks:

- The *scheduler thread* (any single thread at a time; vLLM calls us under its
  manager lock) calls ``lookup``, ``submit_store``, ``submit_load``, ``poll``,
  ``touch``, ``release_holds``, ``invalidate``, ``stats``. None of them blocks
  on I/O. All index state (``SlotIndex``) is touched only here.
- The *completion thread* reaps engine completions. For a finished write it
  writes the slot's index record (the slot is WRITING, so the scheduler never
  touches that record meanwhile), then hands the completion to the scheduler
  through a deque; it also feeds queued ops to the engine.
- ``_lock`` guards the op queue, the bytes-in-flight count and the count of
  outstanding ops; ``_idle`` (a condition on it) wakes ``wait_idle``.
- ``wait_idle`` and ``close`` block (they are the only methods that do).

Crash protocol: an overwritten slot's record is zeroed (in the shared mapping
of the index, so a killed process cannot lose it) before its data write is
submitted; the new record is written only after the data write completed. A
load verifies the payload checksum, seeded with the key, before it reports
success.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from nvmetier import format as fmt
from nvmetier import recovery
from nvmetier.config import TierConfig
from nvmetier.engine import (
    OP_READ,
    OP_WRITE,
    Completion,
    IoEngine,
    Op,
    make_engine,
    resolve_engine_name,
)
from nvmetier.files import StoreFiles
from nvmetier.index import SlotIndex, SlotState

logger = logging.getLogger(__name__)

_MAX_LOOKUP_COUNTS = 1 << 20
_MAX_LOGGED_DROPS = 20

# Every counter ``stats()`` reports (zero until it happens).
COUNTERS = (
    "bytes_written",
    "bytes_read",
    "ops_written",
    "ops_read",
    "hits",
    "misses",
    "evictions",
    "checksum_failures",
    "read_errors",
    "write_errors",
    "load_keys_missing",
    "load_jobs_failed",
    "store_jobs_failed",
    "stores_skipped_present",
    "stores_dropped_queue_full",
    "stores_dropped_set_busy",
    "stores_not_admitted",
    "records_dropped_at_open",
)


@dataclasses.dataclass(slots=True)
class JobOutcome:
    """A finished job, as ``poll`` returns it.

    Attributes:
        job_id: the caller's job id.
        is_load: True for a load (disk -> buffer), False for a store.
        success: every key of the job succeeded.
        successful_keys: for a partly failed job, the keys that succeeded.
        transfer_time_s: submit to last completion.
        transfer_bytes: bytes actually moved.
    """

    job_id: int
    is_load: bool
    success: bool
    successful_keys: list[bytes] | None
    transfer_time_s: float
    transfer_bytes: int


@dataclasses.dataclass(slots=True)
class _Job:
    job_id: int
    is_load: bool
    keys: list[bytes]
    start: float
    remaining: int = 0
    failed: set[bytes] = dataclasses.field(default_factory=set)
    moved_bytes: int = 0
    first_error: str = ""


@dataclasses.dataclass(slots=True)
class _OpInfo:
    job: _Job
    key: bytes
    slot: int
    kind: int
    length: int
    expected: int = 0


class BlockStore:
    """A persistent, bounded, checksummed store of fixed-size chunks.

    Args:
        config: validated tier configuration.
        store_name: directory name of this store under each root.
        identity: layout identity (JSON-able); decides which data is served.
        buffer: the memory ops read from and write into (the primary view);
            row ``i`` starts at ``i * row_bytes``.
        row_bytes: bytes of one row = one chunk.
        engine: force an engine name (``threads``/``uring``) instead of
            resolving ``config.io_engine`` (tests, benchmarks).
        engine_wrapper: wraps the engine once built (fault injection in
            tests: an engine that fails ops on command).

    Raises:
        ConfigError, StoreLockedError, StoreSpaceError, FormatError,
        EngineUnavailableError: at construction, with a message naming the fix.
    """

    def __init__(
        self,
        config: TierConfig,
        *,
        store_name: str,
        identity: dict[str, Any],
        buffer: memoryview,
        row_bytes: int,
        engine: str | None = None,
        engine_wrapper: Callable[[IoEngine], IoEngine] | None = None,
    ) -> None:
        self.config = config
        self.row_bytes = row_bytes
        self._buf = memoryview(buffer).cast("B")
        self._n_rows = len(self._buf) // row_bytes
        engine_name, self.engine_reason = (
            (engine, "forced") if engine else resolve_engine_name(config.io_engine)
        )
        t0 = time.monotonic()
        self.files = StoreFiles.open(
            config.root_dir,
            store_name,
            capacity_bytes=config.capacity_bytes,
            chunk_bytes=row_bytes,
            ways=config.ways,
            identity=identity,
            o_direct=config.o_direct,
            capacity_per_path=config.capacity_per_path,
        )
        self.sb = self.files.sb
        self.index = SlotIndex(self.sb.n_slots, self.sb.ways)
        self._checksums = np.zeros(self.sb.n_slots, dtype=np.uint64)
        self._stats: collections.Counter[str] = collections.Counter()
        self._events: list[tuple[bool, list[bytes]]] = []
        self._stored: list[bytes] = []
        try:
            self._recover()
            self.open_time_s = time.monotonic() - t0
            self.engine: IoEngine = make_engine(
                engine_name,
                self._buf,
                self.files.data_fds,
                io_threads=config.io_threads,
                queue_depth=config.queue_depth,
                max_inflight_bytes=config.max_inflight_bytes,
            )
            if engine_wrapper is not None:
                self.engine = engine_wrapper(self.engine)
        except BaseException:
            self.files.close(clean=False)
            raise
        self.engine_name = engine_name
        logger.info(
            "nvmetier: opened store %s (%d slots of %d bytes, %d ready, engine %s: %s, "
            "O_DIRECT %s) in %.3fs",
            self.files.dirs[0],
            self.sb.n_slots,
            self.sb.slot_bytes,
            len(self.index),
            engine_name,
            self.engine_reason,
            self.files.o_direct,
            self.open_time_s,
        )
        # Scheduler-thread state.
        self._jobs: dict[int, _Job] = {}
        self._finished: list[JobOutcome] = []
        self._holds: dict[bytes, int] = {}
        self._lookup_counts: dict[bytes, int] = {}
        self._next_op_id = 0
        self._ops: dict[int, _OpInfo] = {}
        # Shared with the completion thread (guarded by _lock).
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending: collections.deque[Op] = collections.deque()
        self._pending_bytes = 0
        self._inflight_bytes = 0
        self._outstanding = 0
        self._done: collections.deque[tuple[_OpInfo, Completion]] = collections.deque()
        self._stop = False
        self._closed = False
        self._thread = threading.Thread(
            target=self._completion_loop, name="nvmetier-completions", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------ open
    def _recover(self) -> None:
        """Rebuild the index from the record table; drop what does not verify.

        ``recovery.scan_index`` checks every record (native batch when built);
        records that fail are zeroed here so they are never trusted again.
        """
        mm = self.files.index
        scan = recovery.scan_index(mm, self.sb.n_slots, self.sb.ways)
        rb = fmt.RECORD_BYTES
        for slot, _reason in scan.bad:
            mm[slot * rb : (slot + 1) * rb] = fmt.EMPTY_RECORD
        for slot, reason in scan.bad[:_MAX_LOGGED_DROPS]:
            logger.warning("nvmetier: dropping index record of slot %d: %s", slot, reason)
        if len(scan.bad) > _MAX_LOGGED_DROPS:
            logger.warning("nvmetier: dropped %d index records at open in all", len(scan.bad))
        self.index.load_many(scan.slots, scan.keys, scan.stored_ns)
        self._checksums[scan.slots] = scan.payload_checksums
        self.index.advance_clock(max(scan.newest_ns, time.time_ns()))
        self._stats["records_dropped_at_open"] += len(scan.bad)

    # ------------------------------------------------------------- scheduler
    def lookup(self, key: bytes) -> bool:
        """Whether ``key`` is READY. A hit is held (not evictable) until
        ``submit_load`` takes it or ``release_holds`` is called. Never blocks."""
        slot = self.index.find(key)
        if slot is not None and self.index.state[slot] == SlotState.READY:
            self.index.pins[slot] += 1
            self._holds[key] = self._holds.get(key, 0) + 1
            self._stats["hits"] += 1
            return True
        self._stats["misses"] += 1
        if self.config.admit_after_lookups:
            counts = self._lookup_counts
            counts[key] = counts.get(key, 0) + 1
            if len(counts) > _MAX_LOOKUP_COUNTS:
                counts.pop(next(iter(counts)))
        return False

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is READY, without holding it or counting."""
        return self.index.is_ready(key)

    def release_holds(self) -> None:
        """Release every lookup hold not taken by a load (end of a step)."""
        for key, n in self._holds.items():
            slot = self.index.find(key)
            if slot is not None:
                for _ in range(n):
                    self.index.unpin(slot)
        self._holds.clear()

    def _take_hold(self, key: bytes, slot: int) -> bool:
        n = self._holds.get(key)
        if not n:
            return False
        if n == 1:
            del self._holds[key]
        else:
            self._holds[key] = n - 1
        return True

    def touch(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            slot = self.index.find(key)
            if slot is not None:
                self.index.touch(slot)

    def submit_store(self, job_id: int, keys: Sequence[bytes], rows: Sequence[int]) -> None:
        """Write the chunks of ``rows`` under ``keys``. Never blocks.

        Keys already present are skipped (success). Keys that cannot be
        admitted (queue over ``max_queued_bytes``, all ways of the set busy,
        not yet looked up ``admit_after_lookups`` times) are dropped, counted,
        and do not fail the job.
        """
        job = _Job(job_id, False, list(keys), time.monotonic())
        ops: list[Op] = []
        removed: list[bytes] = []
        now_queued = self._pending_bytes_estimate()
        admit_n = self.config.admit_after_lookups
        for key, row in zip(job.keys, rows, strict=True):
            slot = self.index.find(key)
            if slot is not None and self.index.state[slot] != SlotState.BAD:
                self._stats["stores_skipped_present"] += 1
                continue
            if len(key) > fmt.KEY_MAX_BYTES or not 0 <= row < self._n_rows:
                job.failed.add(key)
                job.first_error = job.first_error or f"bad key length {len(key)} or row {row}"
                continue
            if admit_n and self._lookup_counts.get(key, 0) < admit_n:
                self._stats["stores_not_admitted"] += 1
                continue
            if now_queued + self.row_bytes > self.config.max_queued_bytes:
                self._stats["stores_dropped_queue_full"] += 1
                continue
            seed = fmt.key_seed(key)
            claimed = self.index.allocate(key, seed)
            if claimed is None:
                self._stats["stores_dropped_set_busy"] += 1
                continue
            slot, evicted = claimed
            if evicted is not None:
                removed.append(evicted)
                self._stats["evictions"] += 1
            # The old record stops being visible before the data changes.
            self._write_record(slot, fmt.EMPTY_RECORD)
            ops.append(self._new_op(job, key, slot, OP_WRITE, row, seed))
            now_queued += self.row_bytes
        if removed and self.config.enable_kv_events:
            self._events.append((True, removed))
        self._start(job, ops)

    def submit_load(self, job_id: int, keys: Sequence[bytes], rows: Sequence[int]) -> None:
        """Read ``keys`` into ``rows``. Never blocks. A key that is not READY
        fails at once (reported in ``successful_keys`` of the outcome)."""
        job = _Job(job_id, True, list(keys), time.monotonic())
        ops: list[Op] = []
        for key, row in zip(job.keys, rows, strict=True):
            slot = self.index.find(key)
            held = slot is not None and self._take_hold(key, slot)
            if (
                slot is None
                or self.index.state[slot] != SlotState.READY
                or not (0 <= row < self._n_rows)
            ):
                if held and slot is not None:
                    self.index.unpin(slot)
                job.failed.add(key)
                job.first_error = job.first_error or "key not present"
                self._stats["load_keys_missing"] += 1
                continue
            if not held:
                self.index.pin(slot)
            self.index.touch(slot)
            op = self._new_op(job, key, slot, OP_READ, row, fmt.key_seed(key))
            self._ops[op.op_id].expected = int(self._checksums[slot])
            ops.append(op)
        self._start(job, ops)

    def invalidate(self, key: bytes) -> bool:
        """Remove ``key`` (its record first). False when absent or busy."""
        slot = self.index.find(key)
        if slot is None or self.index.state[slot] == SlotState.WRITING or self.index.pins[slot]:
            return False
        self._write_record(slot, fmt.EMPTY_RECORD)
        self.index.clear(slot)
        if self.config.enable_kv_events:
            self._events.append((True, [key]))
        return True

    def poll(self) -> list[JobOutcome]:
        """Apply finished ops and return the jobs that finished. Never blocks."""
        done = self._done
        while done:
            info, comp = done.popleft()
            self._apply(info, comp)
        if self._stored:
            # Evictions are recorded by submit_store on this same thread, so
            # appending here keeps stored(k) ahead of any later removed(k).
            self._events.append((False, self._stored))
            self._stored = []
        out, self._finished = self._finished, []
        return out

    def take_events(self) -> list[tuple[bool, list[bytes]]]:
        """``(removed, keys)`` pairs since the last call (if events enabled)."""
        out, self._events = self._events, []
        return out

    def has_pending_work(self) -> bool:
        return bool(self._jobs) or bool(self._done)

    # ---------------------------------------------------------------- ops
    def _new_op(self, job: _Job, key: bytes, slot: int, kind: int, row: int, seed: int) -> Op:
        op_id = self._next_op_id
        self._next_op_id += 1
        file_idx, offset = self.sb.slot_location(slot)
        self._ops[op_id] = _OpInfo(job, key, slot, kind, self.row_bytes)
        return Op(op_id, kind, file_idx, offset, row * self.row_bytes, self.row_bytes, seed)

    def _start(self, job: _Job, ops: list[Op]) -> None:
        job.remaining = len(ops)
        if not ops:
            self._finish(job)
            return
        self._jobs[job.job_id] = job
        with self._lock:
            if self._closed:
                raise RuntimeError("submit on a closed BlockStore")
            self._pending.extend(ops)
            self._pending_bytes += len(ops) * self.row_bytes
            self._outstanding += len(ops)
        self._dispatch()

    def _pending_bytes_estimate(self) -> int:
        return self._pending_bytes + self._inflight_bytes

    def _dispatch(self) -> None:
        """Hand queued ops to the engine while under ``max_inflight_bytes``."""
        cap = self.config.max_inflight_bytes
        with self._lock:
            batch: list[Op] = []
            pending = self._pending
            while pending and (
                self._inflight_bytes == 0 or self._inflight_bytes + pending[0].length <= cap
            ):
                op = pending.popleft()
                self._pending_bytes -= op.length
                self._inflight_bytes += op.length
                batch.append(op)
        if batch:
            self.engine.submit(batch)

    def _write_record(self, slot: int, record: bytes) -> None:
        off = slot * fmt.RECORD_BYTES
        self.files.index[off : off + fmt.RECORD_BYTES] = record

    def _completion_loop(self) -> None:
        ops = self._ops
        while True:
            comps = self.engine.wait_completions(0.05)
            if comps:
                freed = 0
                for c in comps:
                    info = ops[c.op_id]
                    if info.kind == OP_WRITE and c.result == info.length:
                        self._write_record(
                            info.slot,
                            fmt.pack_record(info.slot, info.key, c.checksum, time.time_ns()),
                        )
                    freed += info.length
                    self._done.append((info, c))
                with self._lock:
                    self._inflight_bytes -= freed
                    self._outstanding -= len(comps)
                    if self._outstanding == 0:
                        self._idle.notify_all()
                self._dispatch()
            elif self._stop:
                with self._lock:
                    if self._outstanding == 0:
                        return

    def _apply(self, info: _OpInfo, comp: Completion) -> None:
        """Apply one completion to the index (scheduler thread)."""
        del self._ops[comp.op_id]
        job, key, slot = info.job, info.key, info.slot
        ok = comp.result == info.length
        if info.kind == OP_WRITE:
            if ok:
                self.index.commit(slot)
                self._checksums[slot] = comp.checksum
                if self.config.enable_kv_events:
                    self._stored.append(key)
                self._stats["bytes_written"] += info.length
                self._stats["ops_written"] += 1
                job.moved_bytes += info.length
            else:
                # The record was zeroed before the write: nothing to undo on disk.
                self.index.abort(slot)
                self._fail(job, key, comp, "write")
                self._stats["write_errors"] += 1
        else:
            self.index.unpin(slot)
            if ok and (not self.config.verify_checksums or comp.checksum == info.expected):
                self._stats["bytes_read"] += info.length
                self._stats["ops_read"] += 1
                job.moved_bytes += info.length
            elif ok:
                # Proven corruption: a miss, and the slot is invalidated.
                self._stats["checksum_failures"] += 1
                job.failed.add(key)
                job.first_error = job.first_error or "checksum mismatch"
                if self.index.keys[slot] == key:
                    self._write_record(slot, fmt.EMPTY_RECORD)
                    self.index.clear(slot)
                    if self.config.enable_kv_events:
                        self._events.append((True, [key]))
            else:
                # A transient error is not corruption: keep the record, serve
                # it as a miss until it is rewritten (no re-promotion loop).
                self._stats["read_errors"] += 1
                if self.index.keys[slot] == key:
                    self.index.mark_bad(slot)
                self._fail(job, key, comp, "read")
        job.remaining -= 1
        if job.remaining == 0:
            del self._jobs[job.job_id]
            self._finish(job)

    def _fail(self, job: _Job, key: bytes, comp: Completion, what: str) -> None:
        job.failed.add(key)
        if not job.first_error:
            err = -comp.result
            job.first_error = f"{what} failed: {os.strerror(err)} ({errno.errorcode.get(err, err)})"

    def _finish(self, job: _Job) -> None:
        elapsed = time.monotonic() - job.start
        success = not job.failed
        successful: list[bytes] | None = None
        if not success:
            successful = [k for k in job.keys if k not in job.failed]
            self._stats["load_jobs_failed" if job.is_load else "store_jobs_failed"] += 1
            if job.first_error != "key not present":
                logger.warning(
                    "nvmetier: %s job %d failed for %d of %d keys: %s",
                    "load" if job.is_load else "store",
                    job.job_id,
                    len(job.failed),
                    len(job.keys),
                    job.first_error,
                )
        self._finished.append(
            JobOutcome(job.job_id, job.is_load, success, successful, elapsed, job.moved_bytes)
        )

    # ----------------------------------------------------------- blocking
    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until no op is queued or in flight. True if idle."""
        with self._idle:
            return self._idle.wait_for(lambda: self._outstanding == 0, timeout_s)

    def close(self, persist: bool | None = None) -> None:
        """Finish in-flight ops, stop threads, mark the store clean, unlock.

        With ``persist=False`` (default: ``config.persist``) the store's
        directories are removed afterwards. Idempotent.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.wait_idle()
        self._stop = True
        self._thread.join()
        self.poll()
        self.release_holds()
        self.engine.close()
        self.files.close(clean=True)
        # Drop our export of the primary region so its owner can unmap it.
        self._buf.release()
        keep = self.config.persist if persist is None else persist
        if not keep:
            self.files.remove()

    # --------------------------------------------------------------- stats
    def stats(self) -> dict[str, int]:
        """Cumulative counters and current gauges."""
        out = {name: 0 for name in COUNTERS}
        out.update(self._stats)
        with self._lock:
            out["bytes_in_flight"] = self._inflight_bytes
            out["bytes_queued"] = self._pending_bytes
            out["ops_outstanding"] = self._outstanding
        out["slots_total"] = self.sb.n_slots
        out["slots_used"] = len(self.index)
        out["slots_ready"] = self.index.count(SlotState.READY)
        out["capacity_bytes"] = self.sb.n_slots * self.sb.slot_bytes
        out["bytes_used"] = len(self.index) * self.sb.slot_bytes
        out["jobs_in_flight"] = len(self._jobs)
        return out

    def describe(self) -> dict[str, Any]:
        return {
            "store_dir": self.files.dirs[0],
            "data_dirs": list(self.files.dirs),
            "slots": self.sb.n_slots,
            "ways": self.sb.ways,
            "slot_bytes": self.sb.slot_bytes,
            "o_direct": self.files.o_direct,
            "o_direct_reason": self.files.o_direct_reason,
            "engine_reason": self.engine_reason,
            **self.engine.describe(),
        }
