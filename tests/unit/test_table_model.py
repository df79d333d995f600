"""Model-based test of the native shared slot table (``nvmetier._table``).

Several ``Table`` handles over the same table and index mappings, each with its
own OFD lock (its own open of the lock file, so each is a separate sharer), are
driven in interleaved steps against a pure-Python model of nvt_table.c. The
test is the engine: it turns the packed ops into packed completions by hand
(success, an I/O error, or a wrong checksum), so nothing touches a disk and
nothing runs on another thread.

Besides every return value (ops, missing/evicted keys, pending counts, finished
jobs, KV events, counters, gauges), each step checks the shared slots as
nvt_layout.h lays them out: one copy of a key per set at most, the model's
state, generation and recency order in every way, a lease exactly where the
model has one, and an index record exactly on the READY and BAD slots.

The model is the contract, not a copy of the implementation's choices:
- a finished store job means each of its keys is present (READY) or reported
  failed; a store waiting for another sharer's write of its key succeeds only
  if that write published the key, and fails once the wait's bound passed;
- a lease is one token per grant (each lookup hit, each load): it protects its
  slot until it is released (the step's end, the load's completion) or its
  time runs out, whatever other grants of the same slot do;
- a load of a key object this handle leased since its last release (a lookup
  or lease_many; the newest such grant of that object, once) takes that
  grant over if it still protects the slot it named (same generation,
  READY, not run out): no grant of its own; the load's completion releases
  it, the step's end does not. A grant run out on a slot still holding the
  key is replaced by a new one, and one past half its time is pushed out to
  a full lease; a grant whose slot was freed or rewritten is no grant (the
  key is found again, or missing); one whose slot went BAD is given back;
- an op the engine refused or cancelled (-ECANCELED) changes nothing.
Time moves only through the table's test clock (``_set_clock_offset_ns``): the
``advance_clock`` step jumps past every lease granted so far, so leases (and
waits) run out within a test without waiting.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import pathlib
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from nvmetier import _table  # type: ignore[attr-defined]  # a C extension
from nvmetier.engine.base import COMPLETION_DTYPE, OP_DTYPE, OP_READ, OP_WRITE

N_SETS = 4
WAYS = 2
N_SLOTS = N_SETS * WAYS
ROW_BYTES = 4096
N_ROWS = 16
# A lease lasts LEASE_MS of the table's clock; advance_clock jumps JUMP_MS (all
# leases granted so far run out at once, and none granted later can within a
# test: real time moves far less than LEASE_MS while one runs). A store waits
# for another's write WATCH_MS: it gives up on the third jump after it began.
LEASE_MS = 100_000
JUMP_MS = LEASE_MS + 1
WATCH_MS = 250_000
EIO = 5
ENOSPC = 28
ECANCELED = 125

EMPTY, WRITING, READY, BAD = 0, 1, 2, 3

# nvt_layout.h: header, then sets of a 64-byte mutex head and one array per field
# (tag, state, owner, flags u8; owner_inc, pins u16; last, gen, epoch u32;
# stamp, fp u64), each array 8-byte aligned (nvt_layout).
HEADER_BYTES = 8192
SET_HEAD_BYTES = 64


def _a8(n: int) -> int:
    return (n + 7) // 8 * 8


OFF_STATE = SET_HEAD_BYTES + _a8(WAYS)
OFF_OWNER = OFF_STATE + _a8(WAYS)
OFF_FLAGS = OFF_OWNER + _a8(WAYS)
OFF_INC = OFF_FLAGS + _a8(WAYS)
OFF_PINS = OFF_INC + _a8(2 * WAYS)
OFF_LAST = OFF_PINS + _a8(2 * WAYS)
OFF_GEN = OFF_LAST + _a8(4 * WAYS)
OFF_EPOCH = OFF_GEN + _a8(4 * WAYS)
OFF_STAMP = OFF_EPOCH + _a8(4 * WAYS)
OFF_FP = OFF_STAMP + 8 * WAYS
SET_BYTES = (OFF_FP + 8 * WAYS + 63) // 64 * 64
# format.py's index record: magic u32, state u8, key_len u8, .., payload u64 at 8, key at 32.
REC_BYTES = 128
REC_MAGIC = 0x5254564E
REC_KEY_OFFSET = 32

# Mostly successes, so that keys get READY, are loaded and evicted.
OUTCOMES = ("ok", "ok", "ok", "ok", "eio", "enospc", "cancel", "bad_sum")
RACED = "slot reused by another store while loading"
CHECKSUM = "checksum mismatch"

COUNTER_NAMES = (
    "hits",
    "misses",
    "evictions",
    "checksum_failures",
    "read_errors",
    "write_errors",
    "loads_raced",
    "stores_skipped_present",
    "stores_dropped_set_busy",
    "stores_dropped_queue_full",
    "load_keys_missing",
    "ops_written",
    "ops_read",
    "bytes_written",
    "bytes_read",
    "dead_slots_reclaimed",
    "lock_recoveries",
    "loads_cancelled",
    "stores_dropped_watch_timeout",
    "stores_dropped_watch_failed",
    "set_lock_timeouts",
    "completions_deferred",
    "load_leases_taken",
)


def fingerprint(key: bytes) -> int:
    return xxhash.xxh3_64_intdigest(key, 0)


def set_of(key: bytes) -> int:
    return fingerprint(key) % N_SETS


def _keys_in_set(target: int, n: int) -> list[bytes]:
    out: list[bytes] = []
    i = 0
    while len(out) < n:
        key = b"chunk-%d" % i
        if set_of(key) == target:
            out.append(key)
        i += 1
    return out


# Three keys for each of two sets of two ways: stores collide and evict.
SET0_KEYS = _keys_in_set(0, 3)
SET1_KEYS = _keys_in_set(1, 3)
KEYS = SET0_KEYS + SET1_KEYS


# ------------------------------------------------------------------ fixtures
class Shared:
    """One table and index mapping, and a lock file each handle opens anew."""

    def __init__(self) -> None:
        self.table_map = mmap.mmap(-1, _table.table_bytes(N_SLOTS, WAYS))
        self.index_map = mmap.mmap(-1, N_SLOTS * REC_BYTES)
        _table.format(self.table_map, N_SLOTS, WAYS)
        fd, self.lock_path = tempfile.mkstemp(prefix="nvt-table-model-", suffix=".lock")
        os.close(fd)
        self.fds: list[int] = []

    def handle(self, attach: bool = True) -> tuple[_table.Table, int]:
        """A new sharer: its own open file description, so its own OFD locks."""
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CLOEXEC)
        self.fds.append(fd)
        table = _table.Table(
            self.table_map,
            self.index_map,
            fd,
            n_paths=1,
            slot_bytes=ROW_BYTES,
            row_bytes=ROW_BYTES,
            n_rows=N_ROWS,
            lease_ns=LEASE_MS * 1_000_000,
            watch_timeout_ns=WATCH_MS * 1_000_000,
        )
        if attach:
            table.attach()
        return table, fd

    def close_fd(self, fd: int) -> None:
        self.fds.remove(fd)
        os.close(fd)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        os.unlink(self.lock_path)

    def raw_slot(self, slot: int) -> tuple[int, int, int, int, int, int, int, int]:
        """(fp, last, stamp, gen, state, owner, owner_inc, pins) of ``slot``."""
        set_idx, way = divmod(slot, WAYS)
        base = HEADER_BYTES + set_idx * SET_BYTES
        m = self.table_map

        def get(fmt: str, off: int, size: int) -> int:
            return int(struct.unpack_from(fmt, m, base + off + way * size)[0])

        return (
            get("<Q", OFF_FP, 8),
            get("<I", OFF_LAST, 4),
            get("<Q", OFF_STAMP, 8),
            get("<I", OFF_GEN, 4),
            get("<B", OFF_STATE, 1),
            get("<B", OFF_OWNER, 1),
            get("<H", OFF_INC, 2),
            get("<H", OFF_PINS, 2),
        )

    def raw_record(self, slot: int) -> bytes:
        return bytes(self.index_map[slot * REC_BYTES : (slot + 1) * REC_BYTES])


@pytest.fixture
def shared() -> Iterator[Shared]:
    sh = Shared()
    yield sh
    sh.close()


def _rows(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64)


def _ops(packed: bytes) -> np.ndarray:
    return np.frombuffer(packed, dtype=OP_DTYPE)


def _completions(items: Sequence[tuple[int, int, int]]) -> bytes:
    arr = np.zeros(len(items), dtype=COMPLETION_DTYPE)
    for i, (op_id, result, checksum) in enumerate(items):
        arr[i] = (op_id, result, checksum)
    return arr.tobytes()


def _ok(ops: np.ndarray, checksum: int = 7) -> bytes:
    return _completions([(int(op["op_id"]), int(op["length"]), checksum) for op in ops])


# ------------------------------------------------------------------ the model
@dataclasses.dataclass
class MSlot:
    state: int = EMPTY
    key: bytes | None = None
    gen: int = 0
    last_used: int = 0
    grants: dict[int, int] = dataclasses.field(default_factory=dict)  # token -> end (ms)
    payload: int = 0


@dataclasses.dataclass
class MOp:
    kind: int
    slot: int
    gen: int
    key: bytes
    job_id: int
    pos: int
    lease: int | None = None  # a load's grant token
    expected: int = 0
    verify: bool = False  # a load whose checksum is checked


@dataclasses.dataclass
class MJob:
    is_load: bool
    remaining: int = 0
    moved: int = 0
    failed: list[int] = dataclasses.field(default_factory=list)
    first_error: str | None = None

    def fail(self, pos: int, text: str | None) -> None:
        """A key failed; ``text`` None: quietly (not stored, no error text)."""
        self.failed.append(pos)
        if self.first_error is None:
            self.first_error = text


@dataclasses.dataclass
class MHeld:
    """A grant of this step (lookup, lease_many): release_leases drops it,
    unless a load of the very key object took it over (nvt_leases.c)."""

    slot: int
    token: int
    key: bytes
    gen: int
    taken: bool = False


@dataclasses.dataclass
class MHandle:
    table: _table.Table
    fd: int
    held: list[MHeld] = dataclasses.field(default_factory=list)
    ops: dict[int, MOp] = dataclasses.field(default_factory=dict)
    jobs: dict[int, MJob] = dataclasses.field(default_factory=dict)
    # (slot, gen, job_id, pos, deadline_ms)
    watches: list[tuple[int, int, int, int, int]] = dataclasses.field(default_factory=list)
    done_ids: set[int] = dataclasses.field(default_factory=set)  # op ids once completed
    counters: Counter[str] = dataclasses.field(default_factory=Counter)


def _io_error(prefix: str, err: int) -> str:
    return f"{prefix} failed: {os.strerror(err)} (errno {err})"


class TableModel(RuleBasedStateMachine):
    """Handles of one table against the model of nvt_table.c."""

    def __init__(self) -> None:
        super().__init__()
        self.sh = Shared()
        self.slots = [MSlot() for _ in range(N_SLOTS)]
        self.handles: list[MHandle] = []
        self.clock = 0
        self.lease_tokens = 0
        self.next_job = 1
        self.now_ms = 0  # the model's time: advance_clock's jumps only
        _table._set_clock_offset_ns(0)

    # --- model helpers
    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def grant(self, slot: int) -> int:
        """A lease of its own on ``slot``: its token."""
        self.lease_tokens += 1
        self.slots[slot].grants[self.lease_tokens] = self.now_ms + LEASE_MS
        return self.lease_tokens

    def leased(self, slot: int) -> bool:
        """Some grant on ``slot`` is neither released nor run out."""
        return any(end > self.now_ms for end in self.slots[slot].grants.values())

    def find(self, key: bytes, states: tuple[int, ...]) -> int | None:
        base = set_of(key) * WAYS
        for slot in range(base, base + WAYS):
            s = self.slots[slot]
            if s.state in states and s.key == key:
                return slot
        return None

    def clear(self, slot: int) -> None:
        s = self.slots[slot]
        s.state, s.key, s.grants, s.payload = EMPTY, None, {}, 0
        s.gen += 1

    def claim(self, key: bytes) -> tuple[str, int]:
        """claim_way: ('watch'|'present'|'claim'|'evict'|'busy', slot)."""
        base = set_of(key) * WAYS
        for slot in range(base, base + WAYS):
            s = self.slots[slot]
            if s.state != EMPTY and s.key == key:
                if s.state == WRITING:
                    return "watch", slot
                if s.state == READY:
                    return "present", slot
                return "claim", slot  # BAD: rewritten in place
        for slot in range(base, base + WAYS):
            if self.slots[slot].state == EMPTY:
                return "claim", slot
        victims = [
            slot
            for slot in range(base, base + WAYS)
            if self.slots[slot].state in (READY, BAD) and not self.leased(slot)
        ]
        if not victims:
            return "busy", -1
        # BAD ways first, then the least recently used.
        victim = min(victims, key=lambda v: (self.slots[v].state != BAD, self.slots[v].last_used))
        return "evict", victim

    def finish_if_done(self, h: MHandle, job_id: int, finished: list[tuple[object, ...]]) -> None:
        job = h.jobs[job_id]
        if job.remaining:
            return
        del h.jobs[job_id]
        finished.append((job_id, job.is_load, job.moved, job.failed or None, job.first_error))

    # --- setup
    @initialize(n=st.integers(2, 3))
    def open_handles(self, n: int) -> None:
        for _ in range(n):
            table, fd = self.sh.handle()
            self.handles.append(MHandle(table, fd))
        indexes = {h.table.attach()[0] for h in self.handles}
        assert len(indexes) == n, "each handle is its own sharer"

    def teardown(self) -> None:
        _table._set_clock_offset_ns(0)
        for h in self.handles:
            h.table.detach()
        self.handles = []
        self.sh.close()

    # --- rules
    @rule(
        hi=st.integers(0, 2),
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4),
        max_ops=st.integers(0, 4),
    )
    def store(self, hi: int, keys: list[bytes], max_ops: int) -> None:
        h = self.handles[hi % len(self.handles)]
        job_id = self.next_job
        self.next_job += 1
        want_ops: list[tuple[int, int]] = []
        want_evicted: list[bytes] = []
        want_failed: list[int] = []  # not stored: dropped for lack of resources
        mops: list[MOp] = []
        job: MJob | None = None
        for pos, key in enumerate(keys):
            if len(want_ops) >= max_ops:
                h.counters["stores_dropped_queue_full"] += 1
                want_failed.append(pos)
                continue
            what, slot = self.claim(key)
            if what == "present":
                h.counters["stores_skipped_present"] += 1
                continue
            if what == "busy":
                event("store dropped: set busy")
                h.counters["stores_dropped_set_busy"] += 1
                want_failed.append(pos)
                continue
            if job is None:
                job = h.jobs.setdefault(job_id, MJob(is_load=False))
            job.remaining += 1
            if what == "watch":
                h.counters["stores_skipped_present"] += 1
                h.watches.append((slot, self.slots[slot].gen, job_id, pos, self.now_ms + WATCH_MS))
                event("store waits for another write")
                continue
            s = self.slots[slot]
            if what == "evict":
                h.counters["evictions"] += 1
                want_evicted.append(s.key)  # type: ignore[arg-type]
                event("store evicts" + (" a BAD way" if s.state == BAD else ""))
            s.state, s.key, s.grants, s.payload = WRITING, key, {}, 0
            s.gen += 1
            want_ops.append((pos, slot))
            mops.append(MOp(OP_WRITE, slot, s.gen, key, job_id, pos))

        packed, failed, evicted, pending = h.table.store_ops(
            job_id, keys, _rows(len(keys)), max_ops, True
        )
        ops = _ops(packed)
        got = [
            (int(op["buf_offset"]) // ROW_BYTES, int(op["file_offset"]) // ROW_BYTES) for op in ops
        ]
        assert got == want_ops
        assert (failed or []) == want_failed
        assert (evicted or []) == want_evicted
        assert pending == (job.remaining if job else 0)
        for op, mop in zip(ops, mops, strict=True):
            assert op["kind"] == OP_WRITE and op["checksum"] == 1 and op["length"] == ROW_BYTES
            assert op["file_idx"] == 0
            assert int(op["seed"]) == fingerprint(mop.key)
            assert int(op["op_id"]) not in h.ops
            h.ops[int(op["op_id"])] = mop

    @rule(
        hi=st.integers(0, 2),
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3),
        verify=st.booleans(),
    )
    def load(self, hi: int, keys: list[bytes], verify: bool) -> None:
        h = self.handles[hi % len(self.handles)]
        job_id = self.next_job
        self.next_job += 1
        want_ops: list[tuple[int, int]] = []
        want_missing: list[int] = []
        mops: list[MOp] = []
        # The newest grant of this step to each key object, if no load took
        # it yet, is taken over by the key's first position (nvt_leases.c).
        taken: dict[int, MHeld] = {}
        for pos, key in enumerate(keys):
            newest = next((g for g in reversed(h.held) if g.key is key), None)
            if newest is not None and not newest.taken:
                newest.taken = True
                taken[pos] = newest
        # A load takes its keys last to first (a request's head ends up its
        # most recent chunk, as the finish refresh leaves it); its ops and
        # missing positions come out in the keys' order.
        for pos, key in reversed(list(enumerate(keys))):
            g = taken.get(pos)
            if g is not None:
                s = self.slots[g.slot]
                if s.gen == g.gen and s.state == READY:
                    # Its grant is the op's; one that ran out: a new one; one
                    # past half its time is pushed out to a full lease.
                    token = g.token
                    end = s.grants.get(token, 0)
                    if end <= self.now_ms:
                        s.grants.pop(token, None)
                        token = self.grant(g.slot)
                    elif end - self.now_ms < LEASE_MS // 2:
                        s.grants[token] = self.now_ms + LEASE_MS
                    s.last_used = self.tick()
                    h.counters["load_leases_taken"] += 1
                    want_ops.insert(0, (pos, g.slot))
                    mops.insert(
                        0, MOp(OP_READ, g.slot, s.gen, key, job_id, pos, token, s.payload, verify)
                    )
                    continue
                if s.gen == g.gen:
                    s.grants.pop(g.token, None)  # gone BAD: given back now
            slot = self.find(key, (READY,))
            if slot is None:
                h.counters["load_keys_missing"] += 1
                want_missing.insert(0, pos)
                continue
            s = self.slots[slot]
            token = self.grant(slot)  # every grant is a lease of its own
            s.last_used = self.tick()
            want_ops.insert(0, (pos, slot))
            mops.insert(0, MOp(OP_READ, slot, s.gen, key, job_id, pos, token, s.payload, verify))
        packed, missing = h.table.load_ops(job_id, keys, _rows(len(keys)), verify)
        ops = _ops(packed)
        got = [
            (int(op["buf_offset"]) // ROW_BYTES, int(op["file_offset"]) // ROW_BYTES) for op in ops
        ]
        assert got == want_ops
        assert (missing or []) == want_missing
        if mops:
            h.jobs[job_id] = MJob(is_load=True, remaining=len(mops))
        for op, mop in zip(ops, mops, strict=True):
            assert op["kind"] == OP_READ and op["checksum"] == int(verify)
            assert int(op["seed"]) == fingerprint(mop.key)
            assert int(op["op_id"]) not in h.ops
            h.ops[int(op["op_id"])] = mop

    @rule(hi=st.integers(0, 2), data=st.data())
    def complete(self, hi: int, data: st.DataObject) -> None:
        """The engine reports some of this handle's ops (any order, any outcome),
        maybe with a stale op id; then the handle's waiting stores are checked."""
        self._complete(self.handles[hi % len(self.handles)], data)

    @rule(hi=st.integers(0, 2), data=st.data())
    def complete_again(self, hi: int, data: st.DataObject) -> None:
        """``complete`` again (twice as likely as other steps)."""
        self._complete(self.handles[hi % len(self.handles)], data)

    def _complete(self, h: MHandle, data: st.DataObject) -> None:
        ids = data.draw(st.permutations(sorted(h.ops)))
        if not data.draw(st.booleans()):  # else every op of the handle
            ids = ids[: data.draw(st.integers(0, len(ids)))]
        comps: list[tuple[int, int, int]] = []
        finished: list[tuple[object, ...]] = []
        stored: list[bytes] = []
        removed: list[bytes] = []
        for op_id in ids:
            op = h.ops[op_id]
            outcome = data.draw(st.sampled_from(OUTCOMES))
            if outcome == "eio":
                comps.append((op_id, -EIO, 0))
            elif outcome == "cancel":
                comps.append((op_id, -ECANCELED, 0))
            elif outcome == "enospc":
                comps.append((op_id, -ENOSPC, 0))
            elif op.kind == OP_WRITE:
                comps.append((op_id, ROW_BYTES, data.draw(st.integers(0, 2**64 - 1))))
            elif outcome == "ok":
                comps.append((op_id, ROW_BYTES, op.expected))
            else:
                comps.append((op_id, ROW_BYTES, op.expected ^ 1))
        # A duplicate completion of an op already applied (its id is not live
        # again), or an id past the op slab: both are ignored. (An id inside
        # the slab that was never handed out is not: see the example test
        # test_completion_with_an_op_id_never_handed_out_is_ignored.)
        stale_ids = [*sorted(h.done_ids - set(h.ops)), 1_000_000]
        if data.draw(st.booleans()):
            stale = data.draw(st.sampled_from(stale_ids))
            comps.insert(data.draw(st.integers(0, len(comps))), (stale, ROW_BYTES, 0))

        for op_id, result, checksum in comps:
            if op_id not in h.ops:
                continue  # stale: ignored
            op = h.ops.pop(op_id)
            h.done_ids.add(op_id)
            job = h.jobs[op.job_id]
            s = self.slots[op.slot]
            ok = result == ROW_BYTES
            if op.kind == OP_WRITE:
                ours = s.state == WRITING and s.gen == op.gen
                if ok and ours:
                    s.state, s.grants, s.payload = READY, {}, checksum
                    s.last_used = self.tick()
                    h.counters["ops_written"] += 1
                    h.counters["bytes_written"] += ROW_BYTES
                    job.moved += ROW_BYTES
                    stored.append(op.key)
                else:
                    if ours:
                        self.clear(op.slot)
                    h.counters["write_errors"] += 1
                    job.fail(op.pos, _io_error("write", EIO if ok else -result))
            else:
                same = s.gen == op.gen and s.state == READY
                if s.gen == op.gen:
                    s.grants.pop(op.lease, None)  # this load's own lease ends; others stay
                if not same:
                    h.counters["loads_raced"] += 1
                    event("load raced: " + ("slot reused" if s.state != EMPTY else "slot freed"))
                    job.fail(op.pos, RACED)
                elif result == -ECANCELED:
                    # Refused or cancelled: never read; the slot stays READY.
                    event("load cancelled: slot stays READY")
                    h.counters["loads_cancelled"] += 1
                    job.fail(op.pos, _io_error("read", ECANCELED))
                elif not ok:
                    s.state = BAD
                    event("read error: BAD")
                    h.counters["read_errors"] += 1
                    job.fail(op.pos, _io_error("read", -result))
                elif op.verify and checksum != op.expected:
                    removed.append(s.key)  # type: ignore[arg-type]
                    self.clear(op.slot)
                    h.counters["checksum_failures"] += 1
                    event("checksum failure")
                    job.fail(op.pos, CHECKSUM)
                else:
                    h.counters["ops_read"] += 1
                    h.counters["bytes_read"] += ROW_BYTES
                    job.moved += ROW_BYTES
            job.remaining -= 1
            self.finish_if_done(h, op.job_id, finished)
        keep = []
        for watch in h.watches:
            slot, gen, job_id, pos, deadline = watch
            s = self.slots[slot]
            writing = s.state == WRITING and s.gen == gen
            if writing and self.now_ms < deadline:
                keep.append(watch)
                continue
            if writing:
                event("waiting store timed out")
                h.counters["stores_dropped_watch_timeout"] += 1
                h.jobs[job_id].fail(pos, None)
            elif not (s.state == READY and s.gen == gen):
                event("waited-for write did not land")
                h.counters["stores_dropped_watch_failed"] += 1
                h.jobs[job_id].fail(pos, None)
            else:
                event("waiting store resolved: stored")
            h.jobs[job_id].remaining -= 1
            self.finish_if_done(h, job_id, finished)
        h.watches = keep

        got_finished, got_stored, got_removed = h.table.complete(_completions(comps), True)
        assert got_finished == finished
        assert (got_stored or []) == stored
        assert (got_removed or []) == removed

    @rule(hi=st.integers(0, 2), key=st.sampled_from(KEYS))
    def lookup(self, hi: int, key: bytes) -> None:
        h = self.handles[hi % len(self.handles)]
        slot = self.find(key, (READY,))
        if slot is None:
            h.counters["misses"] += 1
        else:
            s = self.slots[slot]
            h.held.append(MHeld(slot, self.grant(slot), key, s.gen))
            s.last_used = self.tick()
            h.counters["hits"] += 1
        assert h.table.lookup(key) == (slot is not None)

    @rule(hi=st.integers(0, 2), keys=st.lists(st.sampled_from(KEYS), max_size=3))
    def lease_many(self, hi: int, keys: list[bytes]) -> None:
        """lookup's lease of each READY key, in order, counting nothing and
        leaving recency alone (the promotion guard's plan)."""
        h = self.handles[hi % len(self.handles)]
        got = []
        for key in keys:
            slot = self.find(key, (READY,))
            if slot is not None:
                h.held.append(MHeld(slot, self.grant(slot), key, self.slots[slot].gen))
            got.append(slot is not None)
        assert h.table.lease_many(keys) == bytes(got)

    @rule(hi=st.integers(0, 2), keys=st.lists(st.sampled_from(KEYS), max_size=3))
    def states_many(self, hi: int, keys: list[bytes]) -> None:
        """Each key READY (2), being written by any handle (1) or neither (0),
        changing nothing (a purge's removals taken: store.take_events)."""
        got = []
        for key in keys:
            slot = self.find(key, (READY, WRITING))
            got.append(0 if slot is None else self.slots[slot].state)
        assert self.handles[hi % len(self.handles)].table.states_many(keys) == bytes(got)

    @rule()
    def advance_clock(self) -> None:
        """Time jumps past the end of every lease granted so far (the table's
        test clock, not a wait): unreleased leases stop protecting, and stores
        waiting for another write come closer to their bound."""
        self.now_ms += JUMP_MS
        _table._set_clock_offset_ns(self.now_ms * 1_000_000)
        event("clock jumps past every lease")

    @rule(hi=st.integers(0, 2), keys=st.lists(st.sampled_from(KEYS), max_size=3))
    def touch(self, hi: int, keys: list[bytes]) -> None:
        ready = 0
        for key in keys:
            slot = self.find(key, (READY,))
            if slot is not None:
                self.slots[slot].last_used = self.tick()
                ready += 1
        assert self.handles[hi % len(self.handles)].table.touch(keys) == ready

    @rule(hi=st.integers(0, 2))
    def release_leases(self, hi: int) -> None:
        h = self.handles[hi % len(self.handles)]
        for g in h.held:
            if not g.taken:  # a load's completion drops the grant it took
                self.slots[g.slot].grants.pop(g.token, None)  # this lookup's lease only
        h.held = []
        h.table.release_leases()

    @rule(hi=st.integers(0, 2), key=st.sampled_from(KEYS))
    def invalidate(self, hi: int, key: bytes) -> None:
        h = self.handles[hi % len(self.handles)]
        slot = self.find(key, (READY, BAD))
        done = slot is not None and not self.leased(slot)
        if done:
            self.clear(slot)  # type: ignore[arg-type]
        assert h.table.invalidate(key) == done

    # --- invariants
    @invariant()
    def keys_are_hits_iff_ready(self) -> None:
        for h in self.handles:
            ready = []
            for key in KEYS:
                slot = self.find(key, (READY,))
                assert h.table.contains(key) == (slot is not None), key
                assert h.table.slot_of(key) == slot, key
                ready.append(slot is not None)
            # The batch call answers as contains does, key by key, in order.
            assert h.table.contains_many(KEYS) == bytes(ready)

    @invariant()
    def gauges_and_counters_match(self) -> None:
        used = sum(s.state != EMPTY for s in self.slots)
        ready = sum(s.state == READY for s in self.slots)
        for h in self.handles:
            assert h.table.usage() == (used, ready, len(h.watches), len(h.jobs))
            got = h.table.counters()
            assert {k: got[k] for k in COUNTER_NAMES} == {k: h.counters[k] for k in COUNTER_NAMES}

    @invariant()
    def shared_slots_match(self) -> None:
        """The table's own bytes: one copy per key, the model's ways, recency
        order, leases and records."""
        if not self.handles:
            return
        now_ms = (time.monotonic_ns() + self.now_ms * 1_000_000) // 1_000_000 + 1
        for set_idx in range(N_SETS):
            seen: set[bytes] = set()
            raws = []
            for slot in range(set_idx * WAYS, (set_idx + 1) * WAYS):
                fp, last_used, stamp, gen, state, _owner, _inc, pins = self.sh.raw_slot(slot)
                m = self.slots[slot]
                raws.append((last_used, slot))
                assert (state, gen) == (m.state, m.gen & 0xFFFFFFFF), slot
                rec = self.sh.raw_record(slot)
                if state == EMPTY:
                    assert rec == bytes(REC_BYTES)
                    continue
                assert m.key is not None and m.key not in seen, "two copies of one key"
                seen.add(m.key)
                assert fp == fingerprint(m.key)
                if state == WRITING:
                    assert rec == bytes(REC_BYTES), "a WRITING slot has no record"
                    continue
                magic, rec_state, key_len = struct.unpack_from("<IBB", rec)
                assert (magic, rec_state) == (REC_MAGIC, 1)
                assert rec[REC_KEY_OFFSET : REC_KEY_OFFSET + key_len] == m.key
                assert struct.unpack_from("<Q", rec, 8)[0] == m.payload
                leased = pins > 0 and stamp > now_ms
                assert leased == self.leased(slot), slot
            # Recency: the table's last_used orders the held ways as the model's does.
            held = [slot for _, slot in raws if self.slots[slot].state in (READY, BAD)]
            by_table = sorted(held, key=lambda v: self.sh.raw_slot(v)[1])
            by_model = sorted(held, key=lambda v: self.slots[v].last_used)
            assert by_table == by_model


TableModel.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_table_matches_model = TableModel.TestCase


# ------------------------------------------------------------------ examples
def _store(
    table: _table.Table, keys: list[bytes], job_id: int = 1, dropped: list[int] | None = None
) -> tuple[np.ndarray, int]:
    packed, failed, _evicted, pending = table.store_ops(job_id, keys, _rows(len(keys)), 64, True)
    assert failed == dropped
    return _ops(packed), pending


def test_fingerprint_and_set_match_the_native_hash(shared: Shared) -> None:
    a, _ = shared.handle()
    for i, key in enumerate(KEYS):
        ops, _ = _store(a, [key], job_id=i)
        assert int(ops[0]["seed"]) == fingerprint(key)
        assert int(ops[0]["file_offset"]) // ROW_BYTES // WAYS == set_of(key)
        a.complete(_ok(ops), False)


def test_store_of_a_key_another_sharer_is_writing_waits_for_that_write(shared: Shared) -> None:
    a, _ = shared.handle()
    b, _ = shared.handle()
    key = SET0_KEYS[0]
    a_ops, _ = _store(a, [key], job_id=1)
    b_ops, pending = _store(b, [key], job_id=2)
    assert len(b_ops) == 0 and pending == 1
    assert b.complete(b"", False)[0] == []
    assert b.usage()[2] == 1
    a.complete(_ok(a_ops), False)
    assert b.complete(b"", False)[0] == [(2, False, 0, None, None)]
    assert b.contains(key)


def test_dead_writers_slot_is_reclaimed_by_a_store_into_its_set(shared: Shared) -> None:
    a, a_fd = shared.handle()
    b, _ = shared.handle()
    key, other = SET0_KEYS[0], SET0_KEYS[1]
    a_ops, _ = _store(a, [key], job_id=1)
    assert len(a_ops) == 1
    _b_ops, pending = _store(b, [key], job_id=2)
    assert pending == 1  # waits for A's write
    a.detach()
    shared.close_fd(a_fd)  # A is gone: its OFD lock with it
    time.sleep(0.25)  # past DEAD_CHECK_AGE_NS
    before = b.counters()["dead_slots_reclaimed"]
    # Fill both ways of the set: one is free, the other is the dead claim.
    ops, _ = _store(b, [other, SET0_KEYS[2]], job_id=3)
    assert len(ops) == 2
    assert b.counters()["dead_slots_reclaimed"] == before + 1
    finished, _, _ = b.complete(b"", False)
    assert finished == [(2, False, 0, [0], None)]  # the waited-for write never landed: not stored
    assert b.counters()["stores_dropped_watch_failed"] == 1
    assert b.usage()[2] == 0
    finished, _, _ = b.complete(_ok(ops), False)
    assert finished == [(3, False, 2 * ROW_BYTES, None, None)]
    assert b.contains(other) and b.contains(SET0_KEYS[2]) and not b.contains(key)
    assert b.usage()[:2] == (2, 2)


def test_waiting_store_fails_when_its_dead_writer_is_reclaimed(shared: Shared) -> None:
    """Was a bug: the waiting store reported success for a key nobody stored."""
    a, a_fd = shared.handle()
    b, _ = shared.handle()
    key = SET1_KEYS[0]
    _store(a, [key], job_id=1)
    _b_ops, pending = _store(b, [key], job_id=2)
    assert pending == 1
    a.detach()
    shared.close_fd(a_fd)
    time.sleep(0.25)
    finished, _, _ = b.complete(b"", False)
    assert finished == [(2, False, 0, [0], None)]
    assert b.counters()["dead_slots_reclaimed"] == 1
    assert b.counters()["stores_dropped_watch_failed"] == 1
    assert b.usage()[:2] == (0, 0)


def test_live_writers_slot_is_never_reclaimed(shared: Shared) -> None:
    a, _ = shared.handle()
    b, _ = shared.handle()
    a_ops, _ = _store(a, [SET0_KEYS[0]], job_id=1)
    time.sleep(0.25)  # old enough to be checked, but A still holds its lock
    ops, _ = _store(b, [SET0_KEYS[1], SET0_KEYS[2]], job_id=2, dropped=[1])
    assert len(ops) == 1  # one free way; the other is A's, busy: that key is not stored
    assert b.counters()["dead_slots_reclaimed"] == 0
    assert b.counters()["stores_dropped_set_busy"] == 1
    finished, _, _ = a.complete(_ok(a_ops), False)
    assert finished == [(1, False, ROW_BYTES, None, None)]
    assert b.contains(SET0_KEYS[0])


def test_load_in_flight_stays_leased_after_another_lookup_is_released(shared: Shared) -> None:
    """A load in flight protects its slot from eviction (nvt_table.c's
    claim_way: "leased: a lookup hit or a load in flight"). Was a bug, now fixed:
    the slot has one lease stamp, so a later lookup of the same key (any
    sharer, or the loader itself in a later step) replaces the load's stamp,
    and that lookup's release_leases() then sets it to 0 while the load is
    still in flight; the slot is evicted and the load fails as raced."""
    a, _ = shared.handle()
    b, _ = shared.handle()
    key, k2, k3 = SET0_KEYS
    ops, _ = _store(a, [key], job_id=1)
    a.complete(_ok(ops, checksum=11), False)
    load_packed, missing = a.load_ops(2, [key], _rows(1), True)
    assert missing is None
    assert b.lookup(key)
    b.release_leases()  # end of B's step: drops only B's lookup lease
    ops2, _ = _store(b, [k2], job_id=3)  # the free way
    ops3, _ = _store(b, [k3], job_id=4, dropped=[0])  # the set is full: the loading key must stay
    b.complete(_ok(np.concatenate([ops2, ops3])), False)
    finished, _, _ = a.complete(_ok(_ops(load_packed), checksum=11), False)
    assert len(ops3) == 0, "a slot being loaded was evicted after another lookup's lease ended"
    assert finished == [(2, True, ROW_BYTES, None, None)]


_NEVER_HANDED_OUT = """
import mmap, tempfile
import numpy as np
import nvmetier._table as T
from nvmetier.engine.base import COMPLETION_DTYPE
tm = mmap.mmap(-1, T.table_bytes(8, 2))
im = mmap.mmap(-1, 8 * 128)
T.format(tm, 8, 2)
fd, _ = tempfile.mkstemp()
t = T.Table(tm, im, fd, n_paths=1, slot_bytes=4096, row_bytes=4096, n_rows=4,
            lease_ns=10**9, watch_timeout_ns=10**9)
t.attach()
t.store_ops(1, [b"k"], np.arange(1, dtype=np.int64), 8, False)  # op 0; the slab has 1024
for op_id in range(1, 1024):  # inside the slab, never handed out
    c = np.zeros(1, COMPLETION_DTYPE)
    c[0] = (op_id, 4096, 0)
    assert t.complete(c.tobytes(), False) == ([], None, None), op_id
"""


def test_completion_with_an_op_id_never_handed_out_is_ignored(tmp_path: pathlib.Path) -> None:
    """nvt_apply_one ignores a completion whose op is not in use ("a stale
    completion"). Was a bug, now fixed: nvt_op_alloc grows the op slab with PyMem_Realloc
    and never clears `in_use` of the new entries, so an id inside the slab that
    was never handed out reads uninitialized memory: a wild set index
    (SIGSEGV in set_lock), or a garbage op applied to a real slot and job.
    Run in a child process, since the failure is a crash."""
    proc = subprocess.run(
        [sys.executable, "-c", _NEVER_HANDED_OUT],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, (
        f"complete() with an op id never handed out: exit {proc.returncode}\n{proc.stderr[-2000:]}"
    )


# ------------------------------------------------ leases, bounds, dead owners
@pytest.fixture
def clock() -> Iterator[list[int]]:
    """The table's test clock (``_set_clock``), back at real time afterwards."""
    now = [0]
    yield now
    _table._set_clock_offset_ns(0)


def _set_clock(now: list[int], ms: int) -> None:
    now[0] = ms
    _table._set_clock_offset_ns(ms * 1_000_000)


def _handle(shared: Shared, lease_ms: int = 1000, watch_ms: int = 2000) -> _table.Table:
    fd = os.open(shared.lock_path, os.O_RDWR | os.O_CLOEXEC)
    shared.fds.append(fd)
    table = _table.Table(
        shared.table_map,
        shared.index_map,
        fd,
        n_paths=1,
        slot_bytes=ROW_BYTES,
        row_bytes=ROW_BYTES,
        n_rows=N_ROWS,
        lease_ns=lease_ms * 1_000_000,
        watch_timeout_ns=watch_ms * 1_000_000,
    )
    table.attach()
    return table


def _stored(table: _table.Table, key: bytes, job_id: int = 100, checksum: int = 11) -> None:
    ops, _ = _store(table, [key], job_id=job_id)
    table.complete(_ok(ops, checksum=checksum), False)
    assert table.contains(key)


def test_two_overlapping_loads_each_keep_their_own_lease(shared: Shared, clock) -> None:
    """Was a bug: the later load's completion cleared the slot's one stamp, and
    the earlier load, still in flight, lost its protection (its slot could be
    evicted and the load fail as raced)."""
    a, b = _handle(shared), _handle(shared)
    key, k2, k3 = SET0_KEYS
    _stored(a, key)
    first, _ = a.load_ops(2, [key], _rows(1), True)
    second, _ = b.load_ops(3, [key], _rows(1), True)
    done, _, _ = b.complete(_ok(_ops(second), checksum=11), False)
    assert done == [(3, True, ROW_BYTES, None, None)]
    _stored(b, k2, job_id=4)  # the free way
    assert b.lookup(k2)  # leased too: the set's only victim would be the loading key
    ops3, _ = _store(b, [k3], job_id=5, dropped=[0])  # the loading key must stay
    assert len(ops3) == 0
    done, _, _ = a.complete(_ok(_ops(first), checksum=11), False)
    assert done == [(2, True, ROW_BYTES, None, None)]
    ops3, _ = _store(b, [k3], job_id=6)  # both loads done: now evictable
    assert len(ops3) == 1


def test_a_load_marks_its_keys_used_last_to_first(shared: Shared, clock) -> None:
    """A load job lists a request's chunks head first; its recency leaves the
    head the more recent of two in one set (as the refresh of a finished
    request does, tail first): a store into the full set evicts the tail. The
    ops stay in the keys' order."""
    a = _handle(shared)
    head, tail, new = SET0_KEYS
    _stored(a, head, job_id=1)
    _stored(a, tail, job_id=2)
    assert a.touch([tail, head]) == 2  # as a refresh would leave them: head the more recent
    assert a.touch([head, tail]) == 2  # now the tail: the load must turn it round
    packed, missing = a.load_ops(3, [head, tail], _rows(2), True)
    assert missing is None
    ops = _ops(packed)
    assert [int(op["buf_offset"]) // ROW_BYTES for op in ops] == [0, 1]
    a.complete(_ok(ops, checksum=11), False)
    ops3, _ = _store(a, [new], job_id=4)
    assert len(ops3) == 1
    assert a.contains(head) and not a.contains(tail)


def test_a_load_lists_missing_positions_in_the_keys_order(shared: Shared) -> None:
    a = _handle(shared)
    held = SET0_KEYS[0]
    _stored(a, held)
    packed, missing = a.load_ops(2, [b"gone-1", held, b"gone-2", b"gone-3"], _rows(4), True)
    assert missing == [0, 2, 3]
    assert [int(op["buf_offset"]) // ROW_BYTES for op in _ops(packed)] == [1]


def test_a_lease_protects_until_it_runs_out_on_the_clock(shared: Shared, clock) -> None:
    a = _handle(shared, lease_ms=1000)
    key = SET0_KEYS[0]
    _stored(a, key)
    assert a.lookup(key)  # leased, and not released (a step that never ends)
    _set_clock(clock, 500)
    assert not a.invalidate(key)
    _set_clock(clock, 1001)
    assert a.invalidate(key)
    a.release_leases()  # a late release of the expired grant changes nothing


@pytest.mark.parametrize("days", [24.8, 24.9, 25.0, 49.7, 50.0, 400.0])
def test_no_stamp_wraps_however_long_the_clock_has_run(shared: Shared, clock, days: float) -> None:
    """Was a bug: stamps were milliseconds modulo 2^32, so once the clock passed
    24.9 days a stale stamp (A loads, B looks up: the load's completion left
    B's later stamp) read as a lease tens of days long, and invalidate()
    refused the key."""
    base = int(days * 86_400_000)
    _set_clock(clock, base)
    a, b = _handle(shared, lease_ms=5000), _handle(shared, lease_ms=5000)
    key, k2, k3 = SET0_KEYS
    _stored(a, key)
    load, _ = a.load_ops(2, [key], _rows(1), True)
    assert b.lookup(key)
    a.complete(_ok(_ops(load), checksum=11), False)
    b.release_leases()
    assert a.invalidate(key), "no lease is left once its load and lookup ended"
    _stored(a, key, job_id=3)
    assert b.lookup(key)  # a lease never released: it runs out after 5 s, not 24.9 days
    _set_clock(clock, base + 5001)
    _stored(a, k2, job_id=4)
    ops, _ = _store(a, [k3], job_id=5)
    assert len(ops) == 1, "the expired lease still pinned the slot"


def test_a_store_waiting_for_a_stopped_writer_fails_after_its_bound(shared: Shared, clock) -> None:
    a, b = _handle(shared), _handle(shared, watch_ms=2000)
    key = SET0_KEYS[0]
    a_ops, _ = _store(a, [key], job_id=1)  # A never completes (stopped)
    _ops_b, pending = _store(b, [key], job_id=2)
    assert pending == 1
    _set_clock(clock, 1500)  # real time moves too (a loaded machine): well before the bound
    assert b.complete(b"", False)[0] == []
    _set_clock(clock, 2000)
    assert b.complete(b"", False)[0] == [(2, False, 0, [0], None)]  # not stored: quiet
    assert b.counters()["stores_dropped_watch_timeout"] == 1
    assert b.usage()[2:] == (0, 0)
    a.complete(_ok(a_ops), False)  # A resumes: its own store still lands
    assert b.contains(key)


@pytest.mark.parametrize("result", [-EIO, -ECANCELED])
def test_a_store_waiting_for_a_write_that_fails_is_not_reported_stored(
    shared: Shared, clock, result: int
) -> None:
    """Was a bug: the waiting store reported success for a key nobody stored."""
    a, b = _handle(shared), _handle(shared)
    key = SET1_KEYS[0]
    a_ops, _ = _store(a, [key], job_id=1)
    _store(b, [key], job_id=2)
    a.complete(_completions([(int(a_ops[0]["op_id"]), result, 0)]), False)
    assert b.complete(b"", False)[0] == [(2, False, 0, [0], None)]
    assert b.counters()["stores_dropped_watch_failed"] == 1
    assert not b.contains(key)


def _fork_holder(shared: Shared, set_idx: int, keys: Sequence[bytes], then: str) -> tuple[int, int]:
    """A child sharer (its own lock file description) that stores ``keys``
    (left WRITING), forks a grandchild that keeps its lock file open (its OFD
    lock stays held), takes set ``set_idx``'s mutex, then ``then``: 'stop'
    (SIGSTOP) or 'die' (SIGKILL). Returns (child pid, grandchild pid)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        try:
            os.close(r)
            c = _handle(shared)
            if keys:
                c.store_ops(1, list(keys), _rows(len(keys)), 64, False)
            grand = os.fork()
            if grand == 0:
                time.sleep(600)
                os._exit(0)
            assert c._hold_set(set_idx)
            os.write(w, b"%d\n" % grand)
            os.kill(os.getpid(), 19 if then == "stop" else 9)
            time.sleep(600)
        finally:
            os._exit(1)
    os.close(w)
    with os.fdopen(r) as f:
        grand = int(f.readline())
    return pid, grand


def _reap(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def test_a_set_lock_held_by_a_stopped_sharer_costs_a_bounded_time(shared: Shared, clock) -> None:
    """Was a bug: set mutexes were waited for without bound (GIL held): a
    sharer stopped inside a critical section froze every other sharer's
    scheduler thread on its first key in that set. A completion into that set
    waits for it the watch timeout at most: then its job fails the key, and
    the completion is applied once the set is free."""
    a = _handle(shared, watch_ms=2000)
    key, k2 = SET0_KEYS[0], SET0_KEYS[1]
    a_ops, _ = _store(a, [key], job_id=1)
    pid, grand = _fork_holder(shared, 0, [], "stop")
    try:
        os.waitpid(pid, os.WUNTRACED)
        t0 = time.monotonic()
        assert not a.lookup(k2)  # a miss, after one bounded wait
        first = time.monotonic() - t0
        t0 = time.monotonic()
        ops, _ = _store(a, [k2], job_id=2, dropped=[0])  # a dropped store, no second wait
        _packed, missing = a.load_ops(3, [k2], _rows(1), True)
        done, _, _ = a.complete(_ok(a_ops), False)  # deferred: the set is held
        later = time.monotonic() - t0
        assert first < 0.5 and later < 0.05, (first, later)
        assert len(ops) == 0 and missing == [0] and done == []
        got = a.counters()
        assert got["set_lock_timeouts"] >= 4 and got["completions_deferred"] == 1
        assert got["stores_dropped_set_busy"] == 1
        _set_clock(clock, 1500)
        assert a.complete(b"", False)[0] == []
        _set_clock(clock, 2000)  # past the bound: the job gives up on its key
        assert a.complete(b"", False)[0] == [(1, False, 0, [0], None)]
        assert a.counters()["completions_abandoned"] == 1 and a.usage()[3] == 0
    finally:
        _reap(pid)  # dies holding the mutex: the next locker recovers it
        _reap(grand)
    _set_clock(clock, 4000)  # past the stall mark: the set is waited for again
    assert a.complete(b"", False)[0] == []  # the jobless completion applies
    assert a.contains(key) and a.counters()["lock_recoveries"] == 1


def _kill_once_waiting(table: _table.Table, pid: int, seen: list[bool]) -> None:
    """Kill ``pid`` once ``table``'s caller is inside a wait for another
    process (its calls from this thread are then refused as "two threads");
    ``seen`` records that the kill came during such a wait."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            table.usage()
        except RuntimeError as exc:
            if "two threads" in str(exc):
                seen.append(True)
                break
            raise
        time.sleep(0.0005)
    os.kill(pid, 9)


def test_a_dead_lock_holders_slots_are_reclaimed_once_its_lock_file_closes(
    shared: Shared,
) -> None:
    """Was a bug: the kernel hands EOWNERDEAD to the next locker before it
    closes the dead process's files, so the survivor saw the dead writer's
    OFD lock still held, reclaimed nothing, and dropped its store as "set
    busy". Its writes may still be in flight until that lock goes, so the
    survivor waits for it (bounded) instead of concluding. Here a grandchild
    keeps the dead child's lock file open until the survivor is waiting, then
    dies. The wait's bound is lengthened (it is 50 ms: a loaded machine may
    take longer than that to run the killing thread), so the lock file closes
    within it however slowly the test runs; a wait that ended without it
    would reclaim nothing (the next test)."""
    b = _handle(shared)
    k1, k2, k3 = SET0_KEYS
    pid, grand = _fork_holder(shared, 0, [k1, k2], "die")
    before = _table._set_dying_wait_ms(60_000)
    try:
        os.waitpid(pid, 0)
        seen: list[bool] = []
        killer = threading.Thread(target=_kill_once_waiting, args=(b, grand, seen))
        killer.start()
        ops, _ = _store(b, [k3], job_id=5)
        killer.join()
        assert seen, "the survivor reclaimed without waiting for the dead writer's lock file"
        assert len(ops) == 1, "the survivor's store was dropped: the dead writer's slots stayed"
        got = b.counters()
        assert got["lock_recoveries"] == 1 and got["dead_slots_reclaimed"] == 2
        b.complete(_ok(ops), False)
        assert b.contains(k3) and b.usage()[:2] == (1, 1)
    finally:
        _table._set_dying_wait_ms(before)
        _reap(pid)
        _reap(grand)


def test_a_dead_lock_holders_slots_stay_while_its_lock_file_is_open_then_go(
    shared: Shared,
) -> None:
    """Stopped is not dead, and an open lock file may mean writes in flight:
    while the dead child's lock file stays open (a grandchild holds it), its
    WRITING slots are not reclaimed (a bounded wait, then a dropped store);
    once it closes, the next store into the set reclaims them."""
    b = _handle(shared)
    k1, k2, k3 = SET0_KEYS
    pid, grand = _fork_holder(shared, 0, [k1, k2], "die")
    try:
        os.waitpid(pid, 0)
        t0 = time.monotonic()
        dropped, _ = _store(b, [k3], job_id=5, dropped=[0])
        assert time.monotonic() - t0 < 0.5 and len(dropped) == 0
        assert b.counters()["dead_slots_reclaimed"] == 0
        os.kill(grand, 9)
        deadline = time.monotonic() + 5
        n_ops = 0
        while not n_ops and time.monotonic() < deadline:
            time.sleep(0.01)
            packed, _failed, _ev, _pending = b.store_ops(6, [k3], _rows(1), 64, False)
            n_ops = len(_ops(packed))
        assert n_ops == 1 and b.counters()["dead_slots_reclaimed"] >= 1
    finally:
        _reap(pid)
        _reap(grand)


def test_a_slot_reclaimed_from_a_dead_writer_is_verified_once_whatever_the_config(
    shared: Shared,
) -> None:
    """A dead writer's queued write may land after its slot was reclaimed: the
    slot's next loads check the checksum even when verification is off,
    until one check passes; a failed check is a miss, never its bytes."""
    a = _handle(shared)
    b = _handle(shared)
    key, other = SET0_KEYS[0], SET0_KEYS[1]
    _store(a, [key], job_id=1)
    a.detach()  # A is gone (its OFD lock with it) with its slot WRITING
    time.sleep(0.25)
    b.sweep()
    assert b.counters()["dead_slots_reclaimed"] == 1
    ops, _ = _store(b, [key, other], job_id=2)
    b.complete(_ok(ops, checksum=5), False)
    packed, _ = b.load_ops(3, [key, other], _rows(2), False)
    loads = _ops(packed)
    assert [int(op["checksum"]) for op in loads] == [1, 0]  # only the reclaimed slot
    # A late write of the dead writer landed: the check fails, the key is a miss.
    done, _, _ = b.complete(_ok(loads[:1], checksum=6), False)
    assert done == []
    b.complete(_ok(loads[1:], checksum=5), False)
    assert not b.contains(key) and b.counters()["checksum_failures"] == 1
    ops, _ = _store(b, [key], job_id=4)
    b.complete(_ok(ops, checksum=5), False)
    packed, _ = b.load_ops(5, [key], _rows(1), False)
    b.complete(_ok(_ops(packed), checksum=5), False)  # verified once: trusted now
    assert b.counters()["loads_verified_unverified"] == 1
    packed, _ = b.load_ops(6, [key], _rows(1), False)
    assert int(_ops(packed)[0]["checksum"]) == 0


def test_a_second_thread_is_refused_while_a_call_waits_for_a_set_lock(shared: Shared) -> None:
    """Was a bug (adversarial review, R02): a call that waits for a set held
    briefly by another process releases the GIL; a second thread that applied
    the same completion meanwhile applied it twice, freed its op twice and
    made two later ops share one id. A Table belongs to one thread at a time:
    the second thread's call is refused, and nothing is applied twice."""
    a = _handle(shared)
    (key,) = SET0_KEYS[:1]
    ops, _ = _store(a, [key], job_id=1)
    go_r, go_w = os.pipe()
    held_r, held_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a sharer that holds set 0 for 8 ms when told
        try:
            os.close(go_w)
            os.close(held_r)
            c = _handle(shared)
            os.read(go_r, 1)
            assert c._hold_set(0)
            os.write(held_w, b"x")
            time.sleep(0.008)
            c._release_set(0)
        finally:
            os._exit(0)
    os.close(go_r)
    os.close(held_w)
    results: list[object] = []

    def apply() -> None:
        try:
            results.append(a.complete(_ok(ops), False))
        except RuntimeError as exc:
            results.append(exc)

    try:
        os.write(go_w, b"x")
        os.read(held_r, 1)  # the set is held now: both calls wait for it
        threads = [threading.Thread(target=apply) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        os.waitpid(pid, 0)
    assert len(results) == 2
    refused = [r for r in results if isinstance(r, RuntimeError)]
    assert all("two threads" in str(r) for r in refused)
    # Whatever ran, the op was applied once: later ops each get an id of
    # their own (keys of other sets).
    others = [k for k in KEYS if set_of(k) != 0][:2]
    ids = [int(op["op_id"]) for k in others for op in _store(a, [k], job_id=9)[0]]
    assert len(set(ids)) == len(ids) == 2


def test_a_lease_stamped_by_a_clock_days_ahead_does_not_pin_its_slot(shared: Shared) -> None:
    """Was a bug (adversarial review, R06): a sharer whose CLOCK_MONOTONIC
    runs ahead (a time namespace) looked keys up and died; every other sharer
    then saw those slots leased for the whole offset (30 days): invalidate()
    refused them and eviction skipped them. A stamp further ahead than any
    lease lasts is not trusted."""
    a = _handle(shared, lease_ms=100)
    k1, k2 = SET0_KEYS[:2]
    ops, _ = _store(a, [k1, k2], job_id=1)
    a.complete(_ok(ops), False)
    pid = os.fork()
    if pid == 0:
        try:
            _table._set_clock_offset_ns(30 * 86400 * 10**9)
            c = _handle(shared, lease_ms=100)
            c.lookup(k1)
            c.lookup(k2)
            os.kill(os.getpid(), 9)
        finally:
            os._exit(1)
    os.waitpid(pid, 0)
    time.sleep(0.3)  # three times the lease
    assert a.invalidate(k1)
    assert a.invalidate(k2)


def test_a_table_inherited_through_fork_is_refused_in_the_child(shared: Shared) -> None:
    """Was a bug (adversarial review, R11): a forked child that used the
    parent's Table wrote slots as the parent's sharer (its registry entry and
    OFD lock); if it died mid-write, nobody could ever reclaim the slot. The
    child's calls are refused; a Table it opens itself works."""
    a = _handle(shared)
    k1, k2 = SET0_KEYS[:2]
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            try:
                a.store_ops(1, [k1], _rows(1), 64, False)
            except RuntimeError as exc:
                if "fork" in str(exc):
                    own = _handle(shared)
                    ops, _ = _store(own, [k2], job_id=2)
                    own.complete(_ok(ops), False)
                    code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert a.contains(k2) and not a.contains(k1)
    ops, _ = _store(a, [k1], job_id=3)  # the parent's own Table still works
    assert len(ops) == 1


def test_a_bad_key_in_a_batch_raises_before_any_key_is_touched(shared: Shared, clock) -> None:
    """contains_many and touch parse every key first: a key that is not
    bytes names its type, and no key of the batch was marked used."""
    table = _handle(shared)
    first, second, third = SET0_KEYS  # one set of WAYS = 2
    _stored(table, first, job_id=200)
    _stored(table, second, job_id=201)
    assert table.contains_many([first, third, second]) == b"\x01\x00\x01"
    assert table.touch([second, first]) == 2  # first is now the more recent
    with pytest.raises(TypeError, match="a key must be bytes, not int"):
        table.contains_many([first, 7])
    with pytest.raises(TypeError, match="a key must be bytes, not str"):
        table.touch([second, "k"])  # second would have become the more recent
    _stored(table, third, job_id=202)  # evicts the set's least recent: second
    assert table.contains_many([first, second, third]) == b"\x01\x00\x01"
