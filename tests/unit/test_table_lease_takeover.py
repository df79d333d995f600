"""A load takes over the lease its step's plan (``lease_many``) or lookup
granted to the very key object it loads (native/nvt_leases.c): one pin, not
two; released at the load's completion, never by ``release_leases``; and
anything that changed in between (the slot freed or rewritten, the lease run
out, retention past) sends the key down the load's ordinary path, which finds
it again or fails it. Never a read of a slot that no longer holds the key
with the checksum it had.

On the model test's small table (2 ways a set; no disk); its handles,
clock and raw slot view.
"""

from __future__ import annotations

import gc
import sys

import pytest
from test_table_model import (
    ROW_BYTES,
    SET0_KEYS,
    SET1_KEYS,
    Shared,
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


def _copy(key: bytes) -> bytes:
    """An equal key that is another object (vLLM's keys of another request)."""
    return bytes(bytearray(key))


def _slot(shared: Shared, key: bytes) -> int:
    for slot in range(2 * 4):
        rec = shared.raw_record(slot)
        if key in rec:
            return slot
    raise AssertionError(f"{key!r} not in the index")


def _pins(shared: Shared, key: bytes) -> int:
    return shared.raw_slot(_slot(shared, key))[7]


def _taken(t) -> int:
    return int(t.counters()["load_leases_taken"])


def test_a_load_takes_over_the_plans_lease_of_the_same_key_object(shared: Shared) -> None:
    """lease_many then load_ops of the same objects: each key's grant is the
    load's (one pin, not two), release_leases leaves it to the load, and the
    load's completion drops it. The ops are the ones a load of equal keys
    that nobody leased builds (slot, row, checksum seed)."""
    a, b = _handle(shared), _handle(shared)
    k0, k1 = SET0_KEYS[0], SET1_KEYS[0]
    _stored(a, k0, job_id=1)
    _stored(a, k1, job_id=2)
    keys = [k0, k1]
    assert b.lease_many(keys) == b"\x01\x01"
    assert _pins(shared, k0) == 1 and _pins(shared, k1) == 1
    packed, missing = b.load_ops(3, keys, _rows(2), True)
    assert missing is None and _taken(b) == 2
    assert _pins(shared, k0) == 1 and _pins(shared, k1) == 1  # the plan's grants, now the load's
    ops = _ops(packed)
    assert [int(op["seed"]) for op in ops] == [fingerprint(k0), fingerprint(k1)]
    # An equal key nobody leased: the same op but its id.
    plain, _ = a.load_ops(4, [_copy(k0), _copy(k1)], _rows(2), True)
    assert _taken(a) == 0
    strip = ("file_idx", "file_offset", "buf_offset", "length", "seed", "kind", "checksum")
    assert [tuple(int(op[f]) for f in strip) for op in ops] == [
        tuple(int(op[f]) for f in strip) for op in _ops(plain)
    ]
    a.complete(_ok(_ops(plain), checksum=11), False)
    b.release_leases()  # the step ends: the load still holds its keys
    assert _pins(shared, k0) == 1
    assert not a.invalidate(k0) and not a.invalidate(k1)
    done, _, _ = b.complete(_ok(ops, checksum=11), False)
    assert done == [(3, True, 2 * ROW_BYTES, None, None)]
    assert _pins(shared, k0) == 0 and _pins(shared, k1) == 0
    assert a.invalidate(k0) and a.invalidate(k1)


def test_a_lookup_hits_lease_is_taken_over_too(shared: Shared) -> None:
    a = _handle(shared)
    key = SET0_KEYS[0]
    _stored(a, key)
    assert a.lookup(key)
    packed, _ = a.load_ops(2, [key], _rows(1), True)
    assert _taken(a) == 1 and _pins(shared, key) == 1
    a.release_leases()
    assert _pins(shared, key) == 1
    a.complete(_ok(_ops(packed), checksum=11), False)
    assert _pins(shared, key) == 0


def test_an_equal_key_of_another_object_is_not_taken_over(shared: Shared) -> None:
    """Identity, not equality: another object's load leases on its own (two
    pins), and each grant goes its own way."""
    a = _handle(shared)
    key = SET0_KEYS[0]
    _stored(a, key)
    assert a.lease_many([key]) == b"\x01"
    packed, _ = a.load_ops(2, [_copy(key)], _rows(1), True)
    assert _taken(a) == 0 and _pins(shared, key) == 2
    a.release_leases()
    assert _pins(shared, key) == 1
    a.complete(_ok(_ops(packed), checksum=11), False)
    assert _pins(shared, key) == 0


def test_a_second_load_of_a_taken_key_leases_on_its_own(shared: Shared) -> None:
    a = _handle(shared)
    key = SET0_KEYS[0]
    _stored(a, key)
    assert a.lease_many([key]) == b"\x01"
    first, _ = a.load_ops(2, [key], _rows(1), True)
    second, _ = a.load_ops(3, [key], _rows(1), True)
    assert _taken(a) == 1 and _pins(shared, key) == 2
    a.release_leases()
    a.complete(_ok(_ops(first), checksum=11), False)
    a.complete(_ok(_ops(second), checksum=11), False)
    assert _pins(shared, key) == 0


def test_a_rewritten_slot_is_never_read_with_the_leased_checksum(shared: Shared, clock) -> None:
    """The lease runs out, another sharer frees the slot and stores the key
    again with other bytes (a new generation, maybe the same way): the load
    must not take the grant over; it finds the new copy, whose checksum its
    completion checks, and the old checksum fails it."""
    a, b = _handle(shared, lease_ms=100), _handle(shared, lease_ms=100)
    key = SET0_KEYS[0]
    _stored(a, key, job_id=1, checksum=11)
    assert b.lease_many([key]) == b"\x01"
    _set_clock(clock, 200)  # the grant ran out
    assert a.invalidate(key)
    _stored(a, key, job_id=2, checksum=22)
    packed, missing = b.load_ops(3, [key], _rows(1), True)
    assert missing is None and _taken(b) == 0
    done, _, _ = b.complete(_ok(_ops(packed), checksum=11), False)
    ((_job, _is_load, _moved, failed, error),) = done
    assert failed == [0] and "checksum" in error  # the stale checksum is caught, not served
    b.release_leases()


def test_a_freed_slot_fails_the_load_as_missing(shared: Shared, clock) -> None:
    a, b = _handle(shared, lease_ms=100), _handle(shared, lease_ms=100)
    key = SET0_KEYS[0]
    _stored(a, key)
    assert b.lease_many([key]) == b"\x01"
    _set_clock(clock, 200)
    assert a.invalidate(key)
    packed, missing = b.load_ops(2, [key], _rows(1), True)
    assert missing == [0] and len(_ops(packed)) == 0 and _taken(b) == 0
    b.release_leases()


def test_a_grant_that_ran_out_is_renewed_not_trusted(shared: Shared, clock) -> None:
    """The slot is untouched but the grant's end passed: the load takes a
    fresh lease (its pin protects the read), which its completion drops."""
    a, b = _handle(shared, lease_ms=100), _handle(shared, lease_ms=100)
    key, k2, k3 = SET0_KEYS
    _stored(a, key)
    assert b.lease_many([key]) == b"\x01"
    _set_clock(clock, 150)
    packed, _ = b.load_ops(2, [key], _rows(1), True)
    assert _taken(b) == 1
    _set_clock(clock, 200)  # within the new grant: the slot stays
    _stored(a, k2, job_id=3)
    assert a.lookup(k2)  # leased too: the set's only victim would be the loading key
    ops3, _ = _store(a, [k3], job_id=4, dropped=[0])  # the loading key must stay
    assert len(ops3) == 0
    b.release_leases()
    done, _, _ = b.complete(_ok(_ops(packed), checksum=11), False)
    assert done == [(2, True, ROW_BYTES, None, None)]
    assert _pins(shared, key) == 0


def test_a_taken_over_load_past_retention_is_not_served(shared: Shared, clock) -> None:
    a = _handle(shared)
    key = SET0_KEYS[0]
    _stored(a, key)
    assert a.lease_many([key]) == b"\x01"
    a.set_retention(10**9)
    _table._set_wall_clock_offset_ns(2 * 10**9)
    try:
        _packed, missing = a.load_ops(2, [key], _rows(1), True)
    finally:
        _table._set_wall_clock_offset_ns(0)
        a.set_retention(0)
    assert missing == [0] and _taken(a) == 0
    assert a.counters()["retention_expired"] >= 1
    a.release_leases()


def test_a_bad_key_in_the_load_leaves_the_grants_to_release_leases(shared: Shared) -> None:
    """The job's keys are checked before any grant is taken: a bad one
    raises, and release_leases then drops the plan's grants."""
    a = _handle(shared)
    key = SET0_KEYS[0]
    _stored(a, key)
    assert a.lease_many([key]) == b"\x01"
    with pytest.raises(TypeError, match="a key must be bytes"):
        a.load_ops(2, [key, "str"], _rows(2), True)
    assert _taken(a) == 0 and _pins(shared, key) == 1
    a.release_leases()
    assert _pins(shared, key) == 0
    assert a.invalidate(key)


def test_a_grant_keeps_its_key_object_alive_until_release_leases(shared: Shared) -> None:
    """The grant names the key by its address: it holds a reference, so the
    address cannot become another key's before the step's end."""
    a = _handle(shared)
    key = _copy(SET0_KEYS[0])
    _stored(a, key)
    before = sys.getrefcount(key)
    assert a.lease_many([key]) == b"\x01"
    assert sys.getrefcount(key) == before + 1
    a.release_leases()
    assert sys.getrefcount(key) == before


def test_many_grants_and_keys_released_at_the_steps_end(shared: Shared) -> None:
    """More grants than the first map holds (it grows), some taken over, the
    rest released: no pin left, every key reference dropped."""
    a = _handle(shared)
    key = SET0_KEYS[0]
    _stored(a, key)
    objs = [_copy(key) for _ in range(1500)]
    refs = [sys.getrefcount(o) for o in objs]
    got = a.lease_many(objs)
    assert got == b"\x01" * len(objs)
    assert _pins(shared, key) == len(objs)
    taken = objs[::7]
    packed, missing = a.load_ops(2, taken, _rows(len(taken)) % 4, True)
    assert missing is None and _taken(a) == len(taken)
    assert _pins(shared, key) == len(objs)
    a.release_leases()
    assert _pins(shared, key) == len(taken)
    a.complete(_ok(_ops(packed), checksum=11), False)
    assert _pins(shared, key) == 0
    del taken, packed
    gc.collect()
    assert [sys.getrefcount(o) for o in objs] == refs


def test_a_map_grown_for_a_long_request_does_not_stay_for_every_step(shared: Shared) -> None:
    """A step of many grants (a long request's plan) grows the key map; a
    later step of a few grants neither clears that large map nor loses a
    take-over."""
    a = _handle(shared)
    key = SET0_KEYS[0]
    _stored(a, key)
    many = [_copy(key) for _ in range(20_000)]
    assert a.lease_many(many) == b"\x01" * len(many)
    a.release_leases()
    assert _pins(shared, key) == 0
    one = _copy(key)
    assert a.lease_many([one]) == b"\x01"
    a.release_leases()  # the large map goes here
    assert a.lease_many([one]) == b"\x01"  # a new map of its own size
    packed, missing = a.load_ops(2, [one], _rows(1), True)
    assert missing is None and _taken(a) == 1
    a.release_leases()
    a.complete(_ok(_ops(packed), checksum=11), False)
    assert _pins(shared, key) == 0
