"""The slot side of a completion applied by an engine's worker (native/nvt_job_worker.c).

With the io_uring engine's hook installed, the worker that completed an op
writes a store's record and publishes its slot, or releases a verified load's
lease, before it publishes the completion; the scheduler thread's apply only
accounts for it. These tests drive that half on this thread with
``Table._apply_as_worker`` (what the hook runs), then ``complete``: no engine,
no threads, deterministic. Anything but the common cases must be left
untouched for ``complete`` to apply exactly as before: a busy set, a dead
holder, a failure, a checksum mismatch, a purge.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import numpy as np
import pytest

from nvmetier.engine.base import OP_DTYPE
from tests.unit.test_table_model import (
    READY,
    SET0_KEYS,
    WRITING,
    Shared,
    _completions,
    _fork_holder,
    _handle,
    _ok,
    _reap,
    _store,
)


@pytest.fixture
def shared() -> Iterator[Shared]:
    sh = Shared()
    yield sh
    sh.close()


EIO = 5


def _state(shared: Shared, slot: int) -> int:
    return shared.raw_slot(slot)[4]


def _pins(shared: Shared, slot: int) -> int:
    return shared.raw_slot(slot)[7]


def test_a_write_applied_by_the_worker_is_ready_before_its_completion_is_collected(
    shared: Shared,
) -> None:
    a = _handle(shared)
    key = SET0_KEYS[0]
    ops, _ = _store(a, [key], job_id=1)
    slot = int(ops[0]["file_offset"]) // 4096
    comps = _ok(ops, checksum=0x1234)
    a._apply_as_worker(comps)
    assert _state(shared, slot) == READY and a.contains(key)  # visible to every sharer now
    assert a.usage()[1] == 1  # the shared gauge counts it with the slot
    assert a.counters()["ops_written"] == 0  # this process's counters: by the poll
    done, stored, _removed = a.complete(comps, True)
    assert done == [(1, False, 4096, None, None)] and stored == [key]
    got = a.counters()
    assert got["ops_written"] == 1 and got["bytes_written"] == 4096 and got["write_errors"] == 0
    assert a.usage()[1] == 1  # counted once, not again by the scheduler thread's apply
    assert shared.raw_record(slot)[8:16] == (0x1234).to_bytes(
        8, "little"
    )  # the record carries its checksum


def test_a_verified_load_applied_by_the_worker_releases_only_its_own_lease(shared: Shared) -> None:
    a = _handle(shared)
    key = SET0_KEYS[0]
    ops, _ = _store(a, [key])
    a.complete(_ok(ops, checksum=77), False)
    packed, missing = a.load_ops(2, [key], [0], True)
    assert missing is None
    slot = int(ops[0]["file_offset"]) // 4096
    assert _pins(shared, slot) == 1
    loads = _ok(_load_ops(packed), checksum=77)
    a._apply_as_worker(loads)
    assert _pins(shared, slot) == 0
    done, _, _ = a.complete(loads, False)
    assert done == [(2, True, 4096, None, None)]
    got = a.counters()
    assert got["ops_read"] == 1 and got["checksum_failures"] == 0 and got["loads_raced"] == 0


def _load_ops(packed: bytes) -> np.ndarray:
    return np.frombuffer(packed, dtype=OP_DTYPE)


def test_a_load_that_fails_its_checksum_is_left_to_the_scheduler_thread_which_frees_the_slot(
    shared: Shared,
) -> None:
    a = _handle(shared)
    key = SET0_KEYS[0]
    ops, _ = _store(a, [key])
    a.complete(_ok(ops, checksum=77), False)
    packed, _ = a.load_ops(2, [key], [0], True)
    slot = int(ops[0]["file_offset"]) // 4096
    bad = _ok(_load_ops(packed), checksum=78)
    a._apply_as_worker(bad)
    assert _state(shared, slot) == READY and _pins(shared, slot) == 1  # untouched
    done, _, removed = a.complete(bad, True)
    assert done == [(2, True, 0, [0], "checksum mismatch")] and removed == [key]
    assert a.counters()["checksum_failures"] == 1 and not a.contains(key)


def test_failed_writes_and_reads_are_left_to_the_scheduler_thread(shared: Shared) -> None:
    a = _handle(shared)
    key, k2 = SET0_KEYS[0], SET0_KEYS[1]
    ops, _ = _store(a, [key])
    failed = _completions([(int(ops[0]["op_id"]), -EIO, 0)])
    a._apply_as_worker(failed)
    slot = int(ops[0]["file_offset"]) // 4096
    assert _state(shared, slot) == WRITING
    a.complete(failed, False)
    assert a.counters()["write_errors"] == 1 and not a.contains(key)
    ops2, _ = _store(a, [k2], job_id=3)
    a.complete(_ok(ops2), False)
    packed, _ = a.load_ops(4, [k2], [0], True)
    eio = _completions([(int(_load_ops(packed)[0]["op_id"]), -EIO, 0)])
    a._apply_as_worker(eio)
    a.complete(eio, False)
    assert a.counters()["read_errors"] == 1 and not a.contains(k2)  # BAD: a miss until rewritten


def test_a_write_purged_while_in_flight_is_never_published_by_the_worker(shared: Shared) -> None:
    a = _handle(shared)
    key = SET0_KEYS[0]
    ops, _ = _store(a, [key])
    _keys, _cleared, marked, _skipped, busy = a.purge(0, True)
    assert marked == 1 and busy == []
    comps = _ok(ops)
    a._apply_as_worker(comps)
    slot = int(ops[0]["file_offset"]) // 4096
    assert _state(shared, slot) == WRITING  # left for the scheduler thread's apply
    done, _, _ = a.complete(comps, False)
    assert done == [(1, False, 0, [0], None)]
    assert a.counters()["stores_purged"] == 1 and not a.contains(key)


def test_a_write_whose_set_another_sharer_holds_is_applied_later_by_the_scheduler_thread(
    shared: Shared,
) -> None:
    """The worker only tries the set: a holder that is stopped costs it
    nothing. When that holder dies holding the mutex, the worker marks it
    consistent and hands the recovery to the scheduler thread (EOWNERDEAD's
    repair changes per-process state and may wait), which then applies the
    completion."""
    a = _handle(shared)
    key = SET0_KEYS[0]
    ops, _ = _store(a, [key])
    slot = int(ops[0]["file_offset"]) // 4096
    comps = _ok(ops)
    pid, grand = _fork_holder(shared, 0, [], "stop")
    try:
        os.waitpid(pid, os.WUNTRACED)
        a._apply_as_worker(comps)  # a try, no wait: left as it is
        assert _state(shared, slot) == WRITING and a.counters()["set_lock_timeouts"] == 0
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        a._apply_as_worker(comps)  # EOWNERDEAD: made consistent, not applied
        assert _state(shared, slot) == WRITING and a.counters()["lock_recoveries"] == 0
        done, _, _ = a.complete(comps, False)
        assert done == [(1, False, 4096, None, None)]
        assert a.contains(key) and a.counters()["lock_recoveries"] == 1
    finally:
        _reap(pid)
        _reap(grand)


def test_a_write_the_worker_published_is_counted_ready_even_if_its_process_never_collects_it(
    shared: Shared,
) -> None:
    """The shared ``ready`` gauge counts every READY slot. A process that dies
    (SIGKILL) or unbinds between its worker's publish and its next poll
    (close's drain timed out, then the engine's close landed the writes)
    never collects those completions: their slots are READY for every sharer,
    so the gauge must already count them; before, it stayed one short per
    chunk, for as long as the store is shared (only the last closer's sweep
    recounts)."""
    a = _handle(shared)
    b = _handle(shared)  # another sharer, which outlives `a`
    keys = SET0_KEYS[:2]
    ops, _ = _store(a, keys, job_id=1)
    a._apply_as_worker(_ok(ops, checksum=5))
    a.detach()  # gone without collecting (as after a SIGKILL)
    assert all(b.contains(k) for k in keys)
    assert b.usage()[:2] == (2, 2)
    b.invalidate(keys[0])
    assert b.usage()[:2] == (1, 1)


def _exited(pid: int, timeout_s: float = 10.0) -> bool:
    """Whether ``pid`` (not our child) exited, its files closed: a zombie or gone."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.005)
    return False


def test_a_dead_holders_writing_slot_stays_while_its_lock_file_is_open_after_the_worker_found_it(
    shared: Shared,
) -> None:
    """The worker that finds a set's holder dead only makes the mutex
    consistent and releases it; the repair is the scheduler thread's, later.
    In between, and after it, the dead sharer's WRITING slot (whose write may
    still land while its lock file is open) is reclaimed by nobody: not by
    another sharer's store into the full set, not by the repair (which waits,
    bounded, for the lock file); once the lock file closes it goes."""
    a = _handle(shared)
    b = _handle(shared)
    k1, k2, k3 = SET0_KEYS
    ops, _ = _store(a, [k1])
    comps = _ok(ops)
    pid, grand = _fork_holder(shared, 0, [k2], "die")  # k2 WRITING, set 0 held, then killed
    try:
        os.waitpid(pid, 0)
        a._apply_as_worker(comps)  # EOWNERDEAD: consistent and released, not applied
        slot = int(ops[0]["file_offset"]) // 4096
        assert _state(shared, slot) == WRITING
        _store(b, [k3], job_id=7, dropped=[0])  # the set is full: the dead's slot stays
        assert b.counters()["dead_slots_reclaimed"] == 0
        done, _, _ = a.complete(comps, False)  # the repair, then the write applied
        assert done == [(1, False, 4096, None, None)] and a.contains(k1)
        got = a.counters()
        assert got["lock_recoveries"] == 1 and got["dead_slots_reclaimed"] == 0
        assert not a.contains(k2) and not b.contains(k2)
        os.kill(grand, 9)  # the lock file closes (the grandchild is init's to reap)
        assert _exited(grand)
        a.store_ops(8, [k3], np.arange(1, dtype=np.int64), 64, False)
        assert a.counters()["dead_slots_reclaimed"] == 1
    finally:
        _reap(pid)
        _reap(grand)
