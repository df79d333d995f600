"""Attacks on a load's take-over of its step's lease grants
(native/nvt_leases.c, nvt_load_loop): every grant is released exactly once
(by release_leases, or by the completion or unwinding of the load that took
it over), a slot that changed between the grant and the load is never read
with the grant's checksum, and Python code run in the middle (a key's
finalizer, a collection) neither corrupts the grants nor crashes.

On the model test's small table (4 sets of 2 ways; no disk): its handles,
clock and raw slot view. ~0.5 s.
"""

from __future__ import annotations

import gc
import os
import struct
import sys
from collections.abc import Callable

import pytest
from test_table_lease_takeover import _copy, _pins, _slot, _taken
from test_table_model import (
    ECANCELED,
    EIO,
    N_ROWS,
    READY,
    ROW_BYTES,
    SET0_KEYS,
    SET1_KEYS,
    Shared,
    _completions,
    _handle,
    _ok,
    _ops,
    _rows,
    _set_clock,
    _store,
    _stored,
    fingerprint,
)
from test_table_model import clock as clock  # a fixture (re-exported)
from test_table_model import shared as shared  # a fixture (re-exported)

from nvmetier import _table  # type: ignore[attr-defined]  # a C extension

EMPTY = 0


def _all_pins(shared: Shared) -> list[int]:
    return [shared.raw_slot(slot)[7] for slot in range(2 * 4)]


# ------------------------------------------------------- a grant not taken
def test_a_grant_past_retention_is_released_and_its_slot_freed(shared: Shared) -> None:
    """The take-over refuses a grant past retention and sends the key down
    the ordinary path, which frees an unleased expired slot. Was a bug: the
    grant stayed marked taken, so its pin was neither the load's nor
    release_leases' to drop: the expired slot stayed pinned (unfreeable,
    unevictable) past the step, until the lease ran out on the clock."""
    a = _handle(shared)
    key = SET0_KEYS[0]
    _stored(a, key)
    slot = _slot(shared, key)
    assert a.lease_many([key]) == b"\x01"
    a.set_retention(10**9)
    _table._set_wall_clock_offset_ns(2 * 10**9)
    try:
        _packed, missing = a.load_ops(2, [key], _rows(1), True)
        assert missing == [0] and _taken(a) == 0
        assert a.counters()["retention_expired"] == 1
        # Freed by the load's ordinary path: the grant no longer pins it.
        assert shared.raw_slot(slot)[4] == EMPTY
        a.release_leases()
        assert _all_pins(shared) == [0] * 8
    finally:
        _table._set_wall_clock_offset_ns(0)
        a.set_retention(0)


def test_a_grant_on_a_slot_gone_bad_is_released_at_the_steps_end(shared: Shared) -> None:
    """Another sharer's read error leaves the slot BAD (same generation, the
    grant's pin still on it): the load misses it, and the plan's grant must
    still be dropped at the step's end, as before the take-over."""
    a, b = _handle(shared), _handle(shared)
    key = SET0_KEYS[0]
    _stored(a, key)
    assert b.lease_many([key]) == b"\x01"
    packed, _ = a.load_ops(2, [key], _rows(1), True)
    (op,) = _ops(packed)
    a.complete(_completions([(int(op["op_id"]), -EIO, 0)]), False)
    assert shared.raw_slot(_slot(shared, key))[4] == 3  # BAD
    assert _pins(shared, key) == 1  # b's grant
    _packed, missing = b.load_ops(3, [key], _rows(1), True)
    assert missing == [0]
    b.release_leases()
    assert _pins(shared, key) == 0


def test_a_grant_that_ran_out_under_anothers_lease_is_not_pinned_twice(
    shared: Shared, clock
) -> None:
    """The grant's end passed, but another sharer's later lease kept the
    slot's lease (same epoch: the grant's pin is still counted). Was a bug:
    the load granted itself a second pin and the first, marked taken, was
    never released: the slot stayed pinned after every holder let go."""
    a, b = _handle(shared, lease_ms=100), _handle(shared, lease_ms=100)
    key = SET0_KEYS[0]
    _stored(a, key)
    assert b.lease_many([key]) == b"\x01"  # until 100
    _set_clock(clock, 60)
    assert a.lookup(key)  # until 160: the slot's lease goes on
    _set_clock(clock, 120)
    packed, missing = b.load_ops(2, [key], _rows(1), True)
    assert missing is None and _taken(b) == 1
    assert _pins(shared, key) == 2  # a's lookup, b's load (the grant it took)
    a.release_leases()
    b.release_leases()
    done, _, _ = b.complete(_ok(_ops(packed), checksum=11), False)
    assert done == [(2, True, ROW_BYTES, None, None)]
    assert _pins(shared, key) == 0
    # Unpinned now, well within the load's lease: the key can be invalidated.
    assert a.invalidate(key)


def test_a_grant_that_ran_out_is_protected_for_the_whole_load(shared: Shared, clock) -> None:
    """A grant reused late in its life has its end pushed out: the load is
    covered for half a lease at least."""
    a, b = _handle(shared, lease_ms=100), _handle(shared, lease_ms=100)
    key = SET0_KEYS[0]
    _stored(a, key)
    assert b.lease_many([key]) == b"\x01"  # until 100
    _set_clock(clock, 90)
    packed, _ = b.load_ops(2, [key], _rows(1), True)
    assert _taken(b) == 1
    _set_clock(clock, 130)
    assert not a.invalidate(key)  # still pinned by the load
    b.release_leases()
    b.complete(_ok(_ops(packed), checksum=11), False)
    assert _pins(shared, key) == 0


# -------------------------------------------------- slot changed meanwhile
def test_a_purged_and_restored_key_is_read_with_the_new_checksum(shared: Shared) -> None:
    """A purge clears the slot whatever leases it (a new generation), and the
    key is stored again with other bytes: the load must check the new
    checksum, never the grant's."""
    a, b = _handle(shared), _handle(shared)
    key = SET0_KEYS[0]
    _stored(a, key, job_id=1, checksum=11)
    assert b.lease_many([key]) == b"\x01"
    assert a.purge(0, True)[1] == 1
    _stored(a, key, job_id=2, checksum=22)
    packed, missing = b.load_ops(3, [key], _rows(1), True)
    assert missing is None and _taken(b) == 0
    assert _pins(shared, key) == 1  # the load's own: the purge dropped the grant's
    ops = _ops(packed)
    done, _, _ = b.complete(_ok(ops, checksum=11), False)
    ((_j, _l, _m, failed, error),) = done
    assert failed == [0] and "checksum" in error
    b.release_leases()
    assert _all_pins(shared) == [0] * 8


def test_a_purged_key_is_missing_and_no_pin_of_the_new_slot_is_dropped(shared: Shared) -> None:
    """After a purge, another key takes the grant's way (its new generation):
    the stale grant must not be taken over, nor released against the new
    slot's pins."""
    a, b = _handle(shared), _handle(shared)
    key, other = SET0_KEYS[0], SET0_KEYS[1]
    _stored(a, key)
    slot = _slot(shared, key)
    assert b.lease_many([key]) == b"\x01"
    assert a.purge(0, True)[1] == 1
    _stored(a, other, job_id=2)
    assert a.lookup(other)  # a's pin on the new slot
    pins_other = _pins(shared, other)
    _packed, missing = b.load_ops(3, [key], _rows(1), True)
    assert missing == [0] and _taken(b) == 0
    b.release_leases()
    assert _pins(shared, other) == pins_other == 1
    assert shared.raw_slot(slot)[4] in (EMPTY, READY)
    a.release_leases()
    assert _all_pins(shared) == [0] * 8


def test_another_process_rewrites_the_slot_between_plan_and_load(shared: Shared, clock) -> None:
    """A real second process (the mapping shared through fork) lets the
    grant run out, invalidates the key and stores it again with other bytes:
    the load never trusts the grant's checksum."""
    a = _handle(shared, lease_ms=100)
    key = SET0_KEYS[0]
    _stored(a, key, job_id=1, checksum=11)
    assert a.lease_many([key]) == b"\x01"
    _set_clock(clock, 200)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            c = _handle(shared, lease_ms=100)
            if c.invalidate(key):
                ops, _ = _store(c, [key], job_id=7)
                c.complete(_ok(ops, checksum=22), False)
                code = 0 if c.contains(key) else 2
            c.detach()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    packed, missing = a.load_ops(2, [key], _rows(1), True)
    assert missing is None and _taken(a) == 0
    done, _, _ = a.complete(_ok(_ops(packed), checksum=11), False)
    ((_j, _l, _m, failed, error),) = done
    assert failed == [0] and "checksum" in error
    a.release_leases()
    assert _all_pins(shared) == [0] * 8


# ------------------------------------------------ failures in the load loop
def _walk_alloc_failures(scenario: Callable[[Shared, int, int], bool]) -> int:
    """Run `scenario` on a fresh table once per allocation point of its
    load, each failing in turn (once, then every later one too), until it
    succeeds. Returns how many runs there were."""
    walked = 0
    for count in (1, 10**6):
        after, failed = 0, True
        while failed:
            sh = Shared()
            try:
                failed = scenario(sh, after, count)
            finally:
                _table._fail_allocs(-1, 0)
                sh.close()
            walked += 1
            after += 1
    return walked


def _load_under_failure(sh: Shared, after: int, count: int) -> bool:
    """70 grants of one key (more than the local arrays hold) and one
    missing key: the load fails at allocation point `after`, or succeeds.
    Either way every pin is gone once the step ends and the load's ops
    (if any) complete. True when the load failed."""
    a = _handle(sh)
    key = SET0_KEYS[0]
    _stored(a, key)
    objs = [_copy(key) for _ in range(70)]
    assert a.lease_many(objs) == b"\x01" * 70
    keys = [*objs, SET1_KEYS[2]]
    rows = _rows(len(keys)) % N_ROWS
    _table._fail_allocs(after, count)
    try:
        packed, missing = a.load_ops(2, keys, rows, True)
    except MemoryError:
        _table._fail_allocs(-1, 0)
        a.release_leases()
        assert _pins(sh, key) == 0, (
            f"a pin left after a load failed at point {after} (count {count})"
        )
        a.detach()
        return True
    _table._fail_allocs(-1, 0)
    assert missing == [70]
    a.release_leases()
    a.complete(_ok(_ops(packed), checksum=11), False)
    assert _pins(sh, key) == 0
    a.detach()
    return False


def test_a_load_that_fails_anywhere_leaves_no_pin() -> None:
    """Out of memory at any point of a load that took grants over: the keys
    not reached yet, the key being built and the ops already built (unwound)
    all give their grant back. Was a bug: they stayed marked taken, and
    nothing released them before the clock."""
    assert _walk_alloc_failures(_load_under_failure) > 3


def test_a_bad_key_after_taken_keys_leaves_every_grant_released(shared: Shared) -> None:
    a = _handle(shared)
    key = SET0_KEYS[0]
    _stored(a, key)
    objs = [_copy(key) for _ in range(80)]
    assert a.lease_many(objs) == b"\x01" * 80
    with pytest.raises(TypeError):
        a.load_ops(2, [*objs, 5], _rows(81) % N_ROWS, True)
    a.release_leases()
    assert _pins(shared, key) == 0


# -------------------------------------------------------- duplicates, twice
def test_a_key_leased_twice_in_one_lease_many_and_loaded_twice(shared: Shared) -> None:
    a = _handle(shared)
    key = SET0_KEYS[0]
    _stored(a, key)
    assert a.lease_many([key, key, key]) == b"\x01\x01\x01"
    packed, missing = a.load_ops(2, [key, key], _rows(2), True)
    assert missing is None and _taken(a) == 1
    assert _pins(shared, key) == 4  # three grants (one the load's) and one own lease
    a.release_leases()
    assert _pins(shared, key) == 2
    done, _, _ = a.complete(_ok(_ops(packed), checksum=11), False)
    assert done == [(2, True, 2 * ROW_BYTES, None, None)]
    assert _pins(shared, key) == 0


def test_lookup_then_lease_many_of_one_key_then_two_loads(shared: Shared) -> None:
    a = _handle(shared)
    key = SET0_KEYS[0]
    _stored(a, key)
    assert a.lookup(key)
    assert a.lease_many([key]) == b"\x01"
    first, _ = a.load_ops(2, [key], _rows(1), True)
    second, _ = a.load_ops(3, [key], _rows(1), True)
    assert _taken(a) == 1 and _pins(shared, key) == 3
    a.release_leases()
    assert _pins(shared, key) == 2
    a.complete(_ok(_ops(second), checksum=11), False)
    a.complete(_ok(_ops(first), checksum=11), False)
    assert _pins(shared, key) == 0


# ----------------------------------------------------------- re-entrancy
class _Finalized(bytes):
    """A key whose last reference runs `hook` (Python code in the middle of
    release_leases' reference drops)."""

    hook: Callable[[], None] | None = None

    def __del__(self) -> None:
        if self.hook is not None:
            self.hook()


def test_a_keys_finalizer_leases_loads_and_releases_during_release_leases(shared: Shared) -> None:
    a = _handle(shared)
    key, other = SET0_KEYS[0], SET1_KEYS[0]
    _stored(a, key)
    _stored(a, other, job_id=2)
    loads: list[bytes] = []
    calls = [0]

    def hook() -> None:
        calls[0] += 1
        assert a.lookup(other)
        assert a.lease_many([other] * 300) == b"\x01" * 300  # grows the map
        packed, missing = a.load_ops(50 + calls[0], [other], _rows(1), True)
        assert missing is None
        loads.append(packed)
        if calls[0] % 2:
            a.release_leases()  # nested, while the outer one drops keys

    objs = []
    for _ in range(5):
        k = _Finalized(key)
        k.hook = hook
        objs.append(k)
    assert a.lease_many(objs) == b"\x01" * 5
    del k
    objs.clear()  # the grants hold the only references now
    a.release_leases()
    assert calls[0] == 5
    assert _pins(shared, key) == 0
    a.release_leases()
    for packed in loads:
        a.complete(_ok(_ops(packed), checksum=11), False)
    assert _all_pins(shared) == [0] * 8
    assert _taken(a) == 5


class _Cycle:
    """Cyclic garbage whose finalizer runs Python code against the Table
    when a collection happens inside load_ops."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.me = self
        self.fn = fn

    def __del__(self) -> None:
        self.fn()


def test_a_collection_inside_load_ops_releases_and_leases_again(shared: Shared) -> None:
    a = _handle(shared)
    key, missing_key = SET0_KEYS[0], SET1_KEYS[2]
    _stored(a, key)
    objs = [_copy(key) for _ in range(100)]
    refs = [sys.getrefcount(o) for o in objs]
    assert a.lease_many(objs) == b"\x01" * 100
    ran = []

    def fn() -> None:
        ran.append(1)
        a.release_leases()  # the grants the load took stay the load's
        assert a.lease_many(objs[:10]) == b"\x01" * 10

    keys, rows = [*objs, missing_key], _rows(101) % N_ROWS
    old = gc.get_threshold()
    gc.disable()
    try:
        for _ in range(50):
            _Cycle(fn)
        gc.set_threshold(1)
        gc.enable()
        # The missing key's list is the first object the call allocates
        # that the collector tracks: a collection in the loop.
        packed, missing = a.load_ops(2, keys, rows, True)
        ran_inside = len(ran)
    finally:
        gc.set_threshold(*old)
        gc.enable()
    gc.collect()
    assert ran_inside, "no finalizer ran inside load_ops"
    assert missing == [100]
    a.release_leases()
    a.complete(_ok(_ops(packed), checksum=11), False)
    assert _pins(shared, key) == 0
    del keys
    assert [sys.getrefcount(o) for o in objs] == refs


# ------------------------------------------------------------- semantics
def test_a_taken_over_load_marks_recency_last_to_first(shared: Shared) -> None:
    """Head most recent: the same marks whether a key's grant was taken over
    or it was found the ordinary way."""
    a = _handle(shared)
    k0, k1 = SET0_KEYS[0], SET0_KEYS[1]
    _stored(a, k0)
    _stored(a, k1, job_id=2)
    for keys in ([k0, k1], [k0, _copy(k1)], [_copy(k0), k1]):
        assert a.lease_many(keys) == b"\x01\x01"
        packed, _ = a.load_ops(3, keys, _rows(2), True)
        last0, last1 = shared.raw_slot(_slot(shared, k0))[1], shared.raw_slot(_slot(shared, k1))[1]
        assert last0 > last1, keys
        a.release_leases()
        a.complete(_ok(_ops(packed), checksum=11), False)
    assert _all_pins(shared) == [0] * 8


def test_counters_of_a_mixed_load(shared: Shared, clock) -> None:
    a, b = _handle(shared, lease_ms=100), _handle(shared, lease_ms=100)
    k0, k1, gone = SET0_KEYS[0], SET1_KEYS[0], SET1_KEYS[1]
    _stored(a, k0)
    _stored(a, k1, job_id=2)
    _stored(a, gone, job_id=3)
    assert b.lease_many([k0, k1, gone]) == b"\x01\x01\x01"
    _set_clock(clock, 200)
    assert a.invalidate(gone)
    before = b.counters()
    packed, missing = b.load_ops(4, [k0, k1, gone], _rows(3), True)
    after = b.counters()
    assert missing == [2]
    assert after["load_keys_missing"] - before["load_keys_missing"] == 1
    assert after["load_leases_taken"] - before["load_leases_taken"] == 2
    ops = _ops(packed)
    assert [int(op["seed"]) for op in ops] == [fingerprint(k0), fingerprint(k1)]
    b.release_leases()
    b.complete(_ok(ops, checksum=11), False)
    assert b.counters()["loads_raced"] == 0
    assert _all_pins(shared) == [0] * 8


def test_a_collection_while_a_bad_key_raises_leaves_no_pin(shared: Shared) -> None:
    """A bad key raises after the job's grants were marked taken; raised
    while another exception is handled, the exception object is made at
    once, and a collection then may run a finalizer that ends the step
    (release_leases, which leaves taken grants alone). The grants must still
    be released, by the load's unwinding or by that release_leases. The
    collection is moved through the call's allocations one at a time."""
    a = _handle(shared)
    key = SET0_KEYS[0]
    _stored(a, key)
    objs = [_copy(key) for _ in range(10)]
    keys, rows = [*objs, "not bytes"], _rows(11)
    ran: list[int] = []

    def fn() -> None:
        ran.append(1)
        a.release_leases()

    old = gc.get_threshold()
    inside = []
    try:
        for j in range(12):
            assert a.lease_many(objs) == b"\x01" * 10
            ran.clear()
            gc.disable()
            try:
                raise ValueError("handled")
            except ValueError:
                for _ in range(5):
                    _Cycle(fn)
                gc.set_threshold(gc.get_count()[0] + j)
                gc.enable()
                with pytest.raises(TypeError):
                    a.load_ops(2, keys, rows, True)
                inside.append(len(ran))
            gc.set_threshold(*old)
            gc.collect()
            a.release_leases()
            assert _pins(shared, key) == 0, f"a pin left, the collection at allocation {j}"
    finally:
        gc.set_threshold(*old)
        gc.enable()
    assert any(inside), "no collection ran inside load_ops"


# ------------------------------------------- submit_load, engine, worker
class _Engine:
    """Completes each op at the next wait with `result` (the row's size:
    read) and checksum 11; `refuse`: submit_raw queues nothing (closed)."""

    def __init__(self, result: int = ROW_BYTES, refuse: bool = False) -> None:
        self.result, self.refuse = result, refuse
        self.pending: list[bytes] = []

    def submit_raw(self, ops: bytes) -> bool | None:
        if self.refuse:
            return False
        for i in range(len(ops) // _table.OP_BYTES):
            (op_id,) = struct.unpack_from("<Q", ops, i * _table.OP_BYTES)
            self.pending.append(struct.pack("<QqQ", op_id, self.result, 11))
        return None

    def wait_raw(self, _timeout: float) -> bytes:
        out = b"".join(self.pending)
        self.pending.clear()
        return out


def _bound(shared: Shared, engine: _Engine):
    a = _handle(shared)
    a.bind(engine.submit_raw, engine.wait_raw, 1000, True, True)
    return a


def _poll_all(t) -> list[tuple]:
    done: list[tuple] = []
    for _ in range(20):
        done += list(t.poll())
        if t.inflight() == (0, 0):
            return done
    raise AssertionError(f"still in flight: {t.inflight()}")


@pytest.mark.parametrize(
    "engine",
    [_Engine(), _Engine(result=-ECANCELED), _Engine(result=-EIO), _Engine(refuse=True)],
    ids=["read", "cancelled", "read_error", "refused"],
)
def test_submit_load_of_taken_grants_releases_each_once(shared: Shared, engine: _Engine) -> None:
    """Through the engine: a completed, cancelled, failed or refused load of
    taken grants leaves only the other sharer's pin, then none."""
    a = _bound(shared, engine)
    b = _handle(shared)
    k0, k1 = SET0_KEYS[0], SET1_KEYS[0]
    _stored(b, k0)
    _stored(b, k1, job_id=2)
    assert b.lease_many([k0, k1]) == b"\x01\x01"  # another sharer's pins
    assert a.lease_many([k0, k1]) == b"\x01\x01"
    a.submit_load(3, [k0, k1], [0, 1])
    assert _taken(a) == 2
    a.release_leases()
    ((job_id, *_rest),) = _poll_all(a)
    assert job_id == 3
    assert _pins(shared, k0) == _pins(shared, k1) == 1
    b.release_leases()
    assert _all_pins(shared) == [0] * 8


def test_submit_load_failing_anywhere_leaves_no_pin() -> None:
    """submit_load's allocation points (its job, its ops, the deferral
    room after the loop, which unwinds a built load) walked in turn."""

    def scenario(sh: Shared, after: int, count: int) -> bool:
        engine = _Engine()
        a = _bound(sh, engine)
        key = SET0_KEYS[0]
        _stored(a, key)
        objs = [_copy(key) for _ in range(70)]
        assert a.lease_many(objs) == b"\x01" * 70
        _table._fail_allocs(after, count)
        try:
            a.submit_load(2, objs, [i % N_ROWS for i in range(70)])
            failed = False
        except MemoryError:
            failed = True
        _table._fail_allocs(-1, 0)
        a.release_leases()
        _poll_all(a)
        left = _pins(sh, key)
        assert left == 0, f"{left} pins left, allocation point {after} failing (count {count})"
        a.detach()
        return failed

    assert _walk_alloc_failures(scenario) > 3


def test_a_worker_applied_load_releases_the_taken_grant_once(shared: Shared) -> None:
    a, b = _handle(shared), _handle(shared)
    key = SET0_KEYS[0]
    _stored(a, key)
    assert b.lookup(key)
    assert a.lease_many([key]) == b"\x01"
    packed, _ = a.load_ops(2, [key], _rows(1), True)
    assert _taken(a) == 1 and _pins(shared, key) == 2
    comps = _ok(_ops(packed), checksum=11)
    a._apply_as_worker(comps)
    assert _pins(shared, key) == 1  # b's
    a.release_leases()
    done, _, _ = a.complete(comps, False)
    assert done == [(2, True, ROW_BYTES, None, None)]
    assert _pins(shared, key) == 1
    b.release_leases()
    assert _pins(shared, key) == 0


def test_lease_many_out_of_memory_for_its_grants_or_map_leaves_no_pin() -> None:
    """The grants' array or the key map cannot grow while lease_many leases
    (each allocation point in turn): a grant not remembered runs out on its
    own, one without the map is only released at the step's end; loads of
    those keys take the ordinary path or a grant still mapped, and nothing
    is released twice."""

    def scenario(sh: Shared, after: int, count: int) -> bool:
        a, b = _handle(sh), _handle(sh)
        key = SET0_KEYS[0]
        _stored(a, key)
        assert b.lookup(key)  # another sharer's pin, which must stay
        objs = [_copy(key) for _ in range(300)]
        _table._fail_allocs(after, count)
        try:
            got = a.lease_many(objs)
        except MemoryError:  # its keys' fingerprints: nothing leased
            _table._fail_allocs(-1, 0)
            a.release_leases()
            assert _pins(sh, key) == 1
            b.release_leases()
            a.detach()
            return True
        points = _table._fail_allocs(-1, 0)
        assert got == b"\x01" * 300
        packed, missing = a.load_ops(2, objs[::3], _rows(100) % N_ROWS, True)
        assert missing is None
        a.release_leases()
        a.complete(_ok(_ops(packed), checksum=11), False)
        left = _pins(sh, key)
        assert left >= 1, "the other sharer's pin was released"
        assert left == 1 or after < points, "a remembered grant left pinned"
        b.release_leases()
        # Grants not remembered end on the clock, and nothing else pins.
        _table._set_clock_offset_ns(2 * 10**9)
        try:
            assert a.invalidate(key)
        finally:
            _table._set_clock_offset_ns(0)
        a.detach()
        return after < points

    assert _walk_alloc_failures(scenario) >= 4
