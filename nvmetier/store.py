"""BlockStore: the tier's data path — index + files + engine + completions.

Owns: one store (its ``StoreFiles``, ``SlotIndex``, ``IoEngine``).

Threads: one. Every method is called by the *scheduler thread* (any single
thread at a time; vLLM calls us under its manager lock), and all index state,
the record table and the job table are touched only there, so the store needs
no lock of its own. The engine's threads (Python workers, or the native
io_uring thread) move bytes and compute checksums; their completions wait in
the engine until ``poll`` collects them without blocking. Only ``wait_idle``
and ``close`` block (they wait for the engine).

Crash protocol: an overwritten slot's record is zeroed (in the shared mapping
of the index, so a killed process cannot lose it) before its data write is
submitted; the new record is written only after the data write completed
(when ``poll`` collects it, before the store is reported to vLLM). A load
verifies the payload checksum, seeded with the key, before it reports
success.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import os
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, NamedTuple

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


class _OpInfo(NamedTuple):
    """What the store remembers of one op (a tuple: built once per chunk)."""

    job: _Job
    key: bytes
    slot: int
    kind: int
    length: int
    expected: int  # payload checksum a read must reproduce


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
        self._n_paths, self._slot_bytes = self.sb.n_paths, self.sb.slot_bytes
        self.index = SlotIndex(self.sb.n_slots, self.sb.ways)
        # Payload checksum per slot (a list: scalar access on the hot path).
        self._checksums: list[int] = [0] * self.sb.n_slots
        self._stats: collections.Counter[str] = collections.Counter()
        self._events: list[tuple[bool, list[bytes]]] = []
        self._stored: list[bytes] = []
        try:
            if not config.persist and not self.files.created:
                # An ephemeral store left behind by a crash: serve none of it.
                self._wipe_index()
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
            engine_built = getattr(self, "engine", None)
            if engine_built is not None:
                engine_built.close()
            self.files.close(clean=False)
            self._buf.release()
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
        self._outstanding = 0  # ops submitted to the engine, not yet collected
        self._closed = False

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
        sums = np.zeros(self.sb.n_slots, dtype=np.uint64)
        sums[scan.slots] = scan.payload_checksums
        self._checksums = sums.tolist()
        self.index.advance_clock(max(scan.newest_ns, time.time_ns()))
        self._stats["records_dropped_at_open"] += len(scan.bad)

    def _wipe_index(self) -> None:
        logger.info(
            "nvmetier: persist is false; forgetting the chunks a previous run left in %s",
            self.files.dirs[0],
        )
        mm = self.files.index
        zeros = bytes(1 << 20)
        for off in range(0, len(mm), len(zeros)):
            n = min(len(zeros), len(mm) - off)
            mm[off : off + n] = zeros[:n]

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

    def touch(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            slot = self.index.find(key)
            if slot is not None:
                self.index.touch(slot)

    def submit_store(self, job_id: int, keys: Collection[bytes], rows: Sequence[int]) -> None:
        """Write the chunks of ``rows`` under ``keys``. Never blocks.

        Keys already present are skipped (success). Keys that cannot be
        admitted (queue over ``max_queued_bytes``, all ways of the set busy,
        not yet looked up ``admit_after_lookups`` times) are dropped, counted,
        and do not fail the job.
        """
        job = _Job(job_id, False, list(keys), time.monotonic())
        ops: list[Op] = []
        removed: list[bytes] = []
        row_bytes, n_rows = self.row_bytes, self._n_rows
        now_queued = self._outstanding * row_bytes
        max_queued = self.config.max_queued_bytes
        admit_n = self.config.admit_after_lookups
        stats = self._stats
        # Locals: this loop runs once per chunk on the scheduler thread.
        find, state, allocate = self.index.find, self.index.state, self.index.allocate
        seed_of, write_record, new_op = fmt.key_seed, self._write_record, self._new_op
        for key, row in zip(job.keys, rows, strict=True):
            slot = find(key)
            if slot is not None and state[slot] != SlotState.BAD:
                stats["stores_skipped_present"] += 1
                continue
            if len(key) > fmt.KEY_MAX_BYTES or not 0 <= row < n_rows:
                job.failed.add(key)
                job.first_error = job.first_error or f"bad key length {len(key)} or row {row}"
                continue
            if admit_n and self._lookup_counts.get(key, 0) < admit_n:
                stats["stores_not_admitted"] += 1
                continue
            if now_queued + row_bytes > max_queued:
                stats["stores_dropped_queue_full"] += 1
                continue
            seed = seed_of(key)
            claimed = allocate(key, seed)
            if claimed is None:
                stats["stores_dropped_set_busy"] += 1
                continue
            slot, evicted = claimed
            if evicted is not None:
                removed.append(evicted)
                stats["evictions"] += 1
            # The old record stops being visible before the data changes.
            write_record(slot, fmt.EMPTY_RECORD)
            ops.append(new_op(job, key, slot, OP_WRITE, row, seed))
            now_queued += row_bytes
        if removed and self.config.enable_kv_events:
            self._events.append((True, removed))
        self._start(job, ops)

    def submit_load(self, job_id: int, keys: Collection[bytes], rows: Sequence[int]) -> None:
        """Read ``keys`` into ``rows``. Never blocks. A key that is not READY
        fails at once (reported in ``successful_keys`` of the outcome)."""
        job = _Job(job_id, True, list(keys), time.monotonic())
        ops: list[Op] = []
        index, holds, n_rows = self.index, self._holds, self._n_rows
        find, state, pins, checksums = index.find, index.state, index.pins, self._checksums
        new_op, seed_of = self._new_op, fmt.key_seed
        # Unverified loads skip the engine's hash: nobody reads the bytes.
        verify = self.config.verify_checksums
        for key, row in zip(job.keys, rows, strict=True):
            slot = find(key)
            if slot is None:
                self._fail_missing(job, key)
                continue
            held = holds.get(key, 0)
            if held:  # the lookup's hold becomes this load's pin
                if held == 1:
                    del holds[key]
                else:
                    holds[key] = held - 1
            if state[slot] != SlotState.READY or not 0 <= row < n_rows:
                if held:
                    index.unpin(slot)
                self._fail_missing(job, key)
                continue
            if not held:
                pins[slot] += 1
            index.touch(slot)
            ops.append(new_op(job, key, slot, OP_READ, row, seed_of(key), checksums[slot], verify))
        self._start(job, ops)

    def _fail_missing(self, job: _Job, key: bytes) -> None:
        job.failed.add(key)
        job.first_error = job.first_error or "key not present"
        self._stats["load_keys_missing"] += 1

    def invalidate(self, key: bytes) -> bool:
        """Remove ``key`` (its record first). False when absent or busy."""
        slot = self.index.find(key)
        if slot is None or self.index.state[slot] == SlotState.WRITING or self.index.pins[slot]:
            return False
        self._forget(slot, key)
        return True

    def _forget(self, slot: int, key: bytes) -> None:
        """Zero ``slot``'s record, free it and report ``key`` removed."""
        self._write_record(slot, fmt.EMPTY_RECORD)
        self.index.clear(slot)
        if self.config.enable_kv_events:
            self._events.append((True, [key]))

    def poll(self) -> list[JobOutcome]:
        """Apply finished ops and return the jobs that finished. Never blocks."""
        if self._outstanding:
            self._collect(self.engine.wait_completions(0))
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
        return bool(self._jobs)

    # ---------------------------------------------------------------- ops
    def _new_op(
        self,
        job: _Job,
        key: bytes,
        slot: int,
        kind: int,
        row: int,
        seed: int,
        expected: int = 0,
        checksum: bool = True,
    ) -> Op:
        op_id = self._next_op_id
        self._next_op_id = op_id + 1
        n_paths, length = self._n_paths, self.row_bytes
        self._ops[op_id] = _OpInfo(job, key, slot, kind, length, expected)
        return Op(
            op_id,
            kind,
            slot % n_paths,
            (slot // n_paths) * self._slot_bytes,
            row * length,
            length,
            seed,
            checksum,
        )

    def _start(self, job: _Job, ops: list[Op]) -> None:
        job.remaining = len(ops)
        if not ops:
            self._finish(job)
            return
        self._jobs[job.job_id] = job
        if self._closed:
            raise RuntimeError("submit on a closed BlockStore")
        self._outstanding += len(ops)
        self.engine.submit(ops)

    def _write_record(self, slot: int, record: bytes) -> None:
        off = slot * fmt.RECORD_BYTES
        self.files.index[off : off + fmt.RECORD_BYTES] = record

    def _collect(self, comps: list[Completion]) -> None:
        """Apply engine completions (scheduler thread).

        The common cases, a verified read (a promotion) and a successful
        write (a cascade), are applied inline with counters added once per
        batch; errors and mismatches go through ``_apply``.
        """
        self._outstanding -= len(comps)
        ops, index, pins = self._ops, self.index, self.index.pins
        verify = self.config.verify_checksums
        events = self.config.enable_kv_events
        checksums, stored = self._checksums, self._stored
        write_record, pack_record, commit = self._write_record, fmt.pack_record, index.commit
        reads = read_bytes = writes = written_bytes = 0
        now_ns = time.time_ns()
        for comp in comps:
            info = ops.pop(comp.op_id)
            length = info.length
            if comp.result != length:
                self._apply(info, comp)
                continue
            if info.kind == OP_READ:
                if verify and comp.checksum != info.expected:
                    self._apply(info, comp)
                    continue
                pins[info.slot] -= 1
                reads += 1
                read_bytes += length
            else:
                # The data is written: only now does the new record appear.
                slot = info.slot
                write_record(slot, pack_record(slot, info.key, comp.checksum, now_ns))
                commit(slot)
                checksums[slot] = comp.checksum
                if events:
                    stored.append(info.key)
                writes += 1
                written_bytes += length
            job = info.job
            job.moved_bytes += length
            job.remaining -= 1
            if job.remaining == 0:
                del self._jobs[job.job_id]
                self._finish(job)
        if reads:
            self._stats["ops_read"] += reads
            self._stats["bytes_read"] += read_bytes
        if writes:
            self._stats["ops_written"] += writes
            self._stats["bytes_written"] += written_bytes

    def _apply(self, info: _OpInfo, comp: Completion) -> None:
        """Apply a failed op or a read whose checksum did not verify
        (scheduler thread; ``_collect`` applies the successes)."""
        job, key, slot = info.job, info.key, info.slot
        if info.kind == OP_WRITE:
            # The record was zeroed before the write: nothing to undo on disk.
            self.index.abort(slot)
            self._fail(job, key, comp, "write")
            self._stats["write_errors"] += 1
        else:
            self.index.unpin(slot)
            if comp.result == info.length:
                # Proven corruption: a miss, and the slot is invalidated.
                self._stats["checksum_failures"] += 1
                job.failed.add(key)
                job.first_error = job.first_error or "checksum mismatch"
                if self.index.keys[slot] == key:
                    self._forget(slot, key)
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
        """Block until every submitted op completed and was collected.

        Results are then waiting for the next ``poll``. Scheduler thread only.
        Returns False if ops are still outstanding after ``timeout_s``.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._outstanding:
            wait_s = 0.1
            if deadline is not None:
                wait_s = min(wait_s, deadline - time.monotonic())
                if wait_s <= 0:
                    return False
            self._collect(self.engine.wait_completions(wait_s))
        return True

    def close(self, persist: bool | None = None) -> None:
        """Finish in-flight ops, stop the engine, mark the store clean, unlock.

        With ``persist=False`` (default: ``config.persist``) the store's
        directories are removed afterwards. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        self.wait_idle()
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
        outstanding_bytes = self._outstanding * self.row_bytes
        out["bytes_in_flight"] = outstanding_bytes
        out["bytes_queued"] = max(0, outstanding_bytes - self.config.max_inflight_bytes)
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
