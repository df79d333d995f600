"""Out of memory anywhere on the table's job path loses no op and no job.

Was a bug: applying a batch of completions appended a KV event key after it
had published the slot but before it released the op and counted its job
down; when that allocation failed, the rest of the batch (already taken off
the engine) was dropped: the job was never reported (``inflight()`` stayed
``(0, 1)``), its other slots stayed WRITING with a live owner, and a drain
looped for good.

``_table._fail_allocs(after, count)`` makes the job path's allocations fail
(the next ``count`` after ``after`` more): each test walks every allocation
point of a scenario in turn, with one failure and with every later
allocation failing, and checks that each job accepted by a submit is
reported exactly once, every slot ends READY or EMPTY (none WRITING), no op
is left, and every key reported stored is there.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
from collections.abc import Iterator

import numpy as np
import pytest

from nvmetier import _table  # type: ignore[attr-defined]  # a C extension
from nvmetier.engine.base import OP_DTYPE

N_SLOTS, WAYS, ROW_BYTES, N_ROWS = 64, 4, 4096, 64
BAD_CHECKSUM = 0xBAD


class Engine:
    """Completes every op at the next wait: writes succeed, reads return the
    checksum the test chose for their key (a wrong one: a checksum failure)."""

    def __init__(self) -> None:
        self.pending: list[bytes] = []

    def submit_raw(self, ops: bytes) -> None:
        for i in range(len(ops) // _table.OP_BYTES):
            (op_id,) = struct.unpack_from("<Q", ops, i * _table.OP_BYTES)
            self.pending.append(struct.pack("<QqQ", op_id, ROW_BYTES, 7))

    def wait_raw(self, _timeout: float) -> bytes:
        out = b"".join(self.pending)
        self.pending.clear()
        return out


def _handle() -> tuple[_table.Table, Engine, int]:
    """A table bound to an Engine, with a second sharer of the same table
    (``table.other``, its own lock file description) that can hold sets."""
    table_map = mmap.mmap(-1, _table.table_bytes(N_SLOTS, WAYS))
    index_map = mmap.mmap(-1, N_SLOTS * 128)
    _table.format(table_map, N_SLOTS, WAYS)
    fd, path = tempfile.mkstemp(prefix="nvt-alloc-", suffix=".lock")
    other_fd = os.open(path, os.O_RDWR)
    os.unlink(path)
    sharers = [
        _table.Table(
            table_map,
            index_map,
            lock_fd,
            n_paths=1,
            slot_bytes=ROW_BYTES,
            row_bytes=ROW_BYTES,
            n_rows=N_ROWS,
            lease_ns=10**9,
            watch_timeout_ns=10**9,
        )
        for lock_fd in (fd, other_fd)
    ]
    for t in sharers:
        t.attach()
    table, other = sharers
    engine = Engine()
    table.bind(engine.submit_raw, engine.wait_raw, 1000, True, True)
    _others[id(table)] = (other, other_fd)
    return table, engine, fd


# The second sharer of each table (kept alive, and its fd closed, with it).
_others: dict[int, tuple[_table.Table, int]] = {}


def _close(table: _table.Table, fd: int) -> None:
    other, other_fd = _others.pop(id(table))
    del other
    os.close(other_fd)
    os.close(fd)


@pytest.fixture(autouse=True)
def _no_injection() -> Iterator[None]:
    _table._fail_allocs(-1, 0)
    yield
    _table._fail_allocs(-1, 0)


def _keys(prefix: bytes, n: int) -> list[bytes]:
    return [prefix + b"-%d" % i for i in range(n)]


STORE_A = _keys(b"a", 70)  # more than 64 keys: the fingerprints are allocated
STORE_B = [*_keys(b"b", 9), b"x" * 100]  # a key too long: fails the job
LOAD = [*STORE_A[:12], b"missing"]


def _scenario(table: _table.Table) -> tuple[set[int], dict[int, list[tuple]]]:
    """Submit and poll a mix of jobs (every completion of a job in one batch,
    KV events on); returns the job ids accepted and every report per id."""
    accepted: set[int] = set()
    reports: dict[int, list[tuple]] = {}

    def submit(job_id: int, load: bool, keys: list[bytes]) -> None:
        call = table.submit_load if load else table.submit_store
        try:
            call(job_id, keys, list(range(len(keys))))
        except MemoryError:
            return  # refused: never reported
        accepted.add(job_id)

    def poll() -> None:
        try:
            done = table.poll()
        except MemoryError:
            return  # nothing was taken from the engine
        for job in done:
            reports.setdefault(job[0], []).append(job)

    submit(1, False, STORE_A)
    submit(2, False, STORE_B)
    submit(3, False, STORE_A[:5])  # present, or being written by job 1
    # Another sharer holds two sets: their completions are deferred,
    # then applied once it lets go.
    other = _others[id(table)][0]
    held = [s for s in (0, 5) if other._hold_set(s)]
    poll()
    for s in held:
        other._release_set(s)
    poll()
    submit(4, True, LOAD)
    poll()
    submit(5, False, _keys(b"c", 40))  # evicts: KV events of removed keys
    poll()
    return accepted, reports


def _finish(table: _table.Table, reports: dict[int, list[tuple]]) -> None:
    """Injection off: poll until nothing is in flight (bounded)."""
    _table._fail_allocs(-1, 0)
    for _ in range(100):
        for job in table.poll():
            reports.setdefault(job[0], []).append(job)
        if table.inflight() == (0, 0):
            return
    raise AssertionError(f"still in flight: {table.inflight()}")


def _check(table: _table.Table, accepted: set[int], reports: dict[int, list[tuple]]) -> None:
    assert {j: len(r) for j, r in reports.items()} == dict.fromkeys(accepted, 1)
    assert table.inflight() == (0, 0)
    used, ready, watches, jobs = table.usage()
    assert (used, watches, jobs) == (ready, 0, 0), "a slot was left WRITING"
    for job_id, ((_, success, ok_keys, *_rest, is_load),) in reports.items():
        if is_load:
            continue
        stored = {1: STORE_A, 2: STORE_B, 3: STORE_A[:5], 5: _keys(b"c", 40)}[job_id]
        said = stored if success else ok_keys or []
        assert set(said) <= set(stored)
        assert not success or job_id != 2  # the long key always fails job 2


def _points() -> int:
    table, _engine, fd = _handle()
    _table._fail_allocs(-1, 0)
    accepted, reports = _scenario(table)
    n = _table._fail_allocs(-1, 0)
    _finish(table, reports)
    _check(table, accepted, reports)
    _close(table, fd)
    return n


def test_the_scenario_passes_allocation_points() -> None:
    assert _points() > 20


@pytest.mark.parametrize("count", [1, 10**9], ids=["one_failure", "every_later_allocation"])
def test_an_allocation_failure_at_any_point_loses_no_job_and_no_slot(count: int) -> None:
    for after in range(_points()):
        table, _engine, fd = _handle()
        try:
            _table._fail_allocs(after, count)
            accepted, reports = _scenario(table)
            _finish(table, reports)
            _check(table, accepted, reports)
        except AssertionError as exc:
            raise AssertionError(f"allocation point {after}: {exc}") from exc
        finally:
            _close(table, fd)


def test_a_report_that_cannot_be_built_comes_at_a_later_poll() -> None:
    table, _engine, fd = _handle()
    try:
        table.submit_store(1, STORE_A[:3], [0, 1, 2])
        _table._fail_allocs(0, 10**9)  # the poll's report fails, and every retry
        assert table.poll() == ()
        assert table.poll() == ()
        assert table.inflight() == (0, 1)  # done, not yet reported
        _table._fail_allocs(-1, 0)
        (job,) = table.poll()
        assert job[:3] == (1, True, None)
        assert table.inflight() == (0, 0)
        assert table.poll() == ()
    finally:
        _close(table, fd)


def test_a_lost_kv_event_is_counted_and_its_store_still_lands() -> None:
    table, _engine, fd = _handle()
    try:
        table.submit_store(1, STORE_A[:3], [0, 1, 2])
        _table._fail_allocs(0, 1)  # the first allocation of the poll: an event key
        (job,) = table.poll()
        assert job[1] is True
        assert all(table.contains(k) for k in STORE_A[:3])
        assert table.counters()["kv_events_lost"] == 1
        assert [ev for _removed, keys in table.take_events() for ev in keys] == STORE_A[1:3]
    finally:
        _close(table, fd)


def test_a_primitive_job_whose_report_fails_comes_at_a_later_complete() -> None:
    """store_ops/complete (the model test's primitives): the same rule."""
    table, _engine, fd = _handle()
    try:
        packed, failed, _evicted, _pending = table.store_ops(7, STORE_A[:2], [0, 1], 64, False)
        assert failed is None
        op_ids = [
            struct.unpack_from("<Q", packed, i * _table.OP_BYTES)[0]
            for i in range(len(packed) // _table.OP_BYTES)
        ]
        comps = b"".join(struct.pack("<QqQ", op_id, ROW_BYTES, 7) for op_id in op_ids)
        _table._fail_allocs(0, 1)  # no room to defer: refused before anything is applied
        with pytest.raises(MemoryError):
            table.complete(comps, False)
        assert not table.contains(STORE_A[0])
        _table._fail_allocs(1, 10**9)  # the room, then no report
        finished, _stored, _removed = table.complete(comps, False)
        assert finished == []
        assert table.usage()[3] == 1  # done, not yet reported
        _table._fail_allocs(-1, 0)
        finished, _stored, _removed = table.complete(b"", False)
        assert [f[0] for f in finished] == [7]
        assert table.usage()[3] == 0
        assert all(table.contains(k) for k in STORE_A[:2])
    finally:
        _close(table, fd)


def _load_mix(held: list[bytes]) -> tuple[list[bytes], list[int], list[int], list[int]]:
    """100 keys (the fingerprints allocated): absent, held with a row out of
    range, one held key many times, other held keys. Returns the keys, rows,
    the missing positions and the positions with an op, in the keys' order."""
    keys, rows = [], []
    for i in range(100):
        kind = i % 5
        key = b"absent-%d" % i if kind == 0 else held[0] if kind == 2 else held[i % len(held)]
        keys.append(key)
        rows.append(N_ROWS + 3 if kind == 1 else i % N_ROWS)
    missing = [i for i in range(100) if i % 5 in (0, 1)]
    return keys, rows, missing, [i for i in range(100) if i % 5 not in (0, 1)]


def test_load_ops_unwinds_at_any_allocation_point_and_keeps_the_keys_order() -> None:
    """load_ops takes its keys last to first and builds its ops from the end
    of its buffer down: whatever allocation fails, the call raises and leaves
    nothing in flight, or returns the ops and missing positions in key order."""
    table, _engine, fd = _handle()
    try:
        packed, *_rest = table.store_ops(1, STORE_A[:40], list(range(40)), 64, False)
        n_ops = len(packed) // _table.OP_BYTES
        op_ids = [struct.unpack_from("<Q", packed, i * _table.OP_BYTES)[0] for i in range(n_ops)]
        table.complete(b"".join(struct.pack("<QqQ", o, ROW_BYTES, 7) for o in op_ids), False)
        held = [k for k in STORE_A[:40] if table.contains(k)]
        keys, rows, missing, loaded = _load_mix(held)

        def load(after: int = -1, count: int = 0) -> None:
            _table._fail_allocs(after, count)
            try:
                packed, got_missing = table.load_ops(2, keys, rows, False)
            finally:
                _table._fail_allocs(-1, 0)
            ops = np.frombuffer(packed, dtype=OP_DTYPE)
            assert got_missing == missing
            assert [int(op["buf_offset"]) // ROW_BYTES for op in ops] == [rows[i] for i in loaded]
            comps = b"".join(struct.pack("<QqQ", int(op["op_id"]), ROW_BYTES, 7) for op in ops)
            finished, _s, _r = table.complete(comps, False)
            assert [f[0] for f in finished] == [2]

        _table._fail_allocs(-1, 0)
        packed, _missing = table.load_ops(2, keys, rows, False)
        points = _table._fail_allocs(-1, 0)
        table.complete(
            b"".join(
                struct.pack("<QqQ", int(op["op_id"]), ROW_BYTES, 7)
                for op in np.frombuffer(packed, dtype=OP_DTYPE)
            ),
            False,
        )
        assert points > 3
        refused = 0
        for count in (1, 10**9):
            for after in range(points):
                try:
                    load(after, count)
                except MemoryError:
                    refused += 1
                assert table.usage()[2:] == (0, 0), f"allocation point {after}"
                assert table.inflight() == (0, 0), f"allocation point {after}"
                load()  # whole again
        assert refused >= points
    finally:
        _close(table, fd)
