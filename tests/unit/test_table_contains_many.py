"""Adversarial checks of ``Table.contains_many`` (and ``touch`` and
``lease_many``, its shared path) against ``Table.contains`` and
``Table.lookup``, key by key: random stores, half-written stores, leases,
purges and retention expiry over two handles, and another process storing
and purging while this one asks (never a false hit); ``lease_many`` leases
what it answers READY as ``lookup`` does, until ``release_leases``, and
counts nothing.

Reuses the model test's small table (4 sets of 2 ways) and helpers; no disk.
About 3 s.
"""

from __future__ import annotations

import multiprocessing
import os

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_table_model import KEYS, Shared, _handle, _ok

from nvmetier import _table  # type: ignore[attr-defined]  # a C extension
from nvmetier.engine.base import OP_DTYPE
from nvmetier.format import KEY_MAX_BYTES

# The model's colliding keys, plus edge lengths (empty, the record's maximum,
# one past it: a key the index can never hold).
EXTRA = [b"", b"m" * KEY_MAX_BYTES, b"o" * (KEY_MAX_BYTES + 1)]
ALL = KEYS + EXTRA

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.sampled_from(KEYS), st.booleans()),
        st.tuples(st.just("lookup"), st.sampled_from(KEYS), st.just(False)),
        st.tuples(st.just("purge"), st.just(b""), st.booleans()),
        st.tuples(st.just("retention"), st.just(b""), st.booleans()),
        st.tuples(st.just("age"), st.just(b""), st.just(False)),
        st.tuples(st.just("touch"), st.sampled_from(KEYS), st.just(False)),
    ),
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, order=st.permutations(ALL))
@example(  # a leased hit past retention: never READY, for a handle that leases too
    ops=[
        ("store", b"chunk-5", True),
        ("lookup", b"chunk-5", False),
        ("retention", b"", True),
        ("age", b"", False),
    ],
    order=list(ALL),
)
def test_contains_many_agrees_with_contains_in_every_state(ops, order) -> None:
    """After each step (a completed store, a store left WRITING, a leased hit,
    a purge, a retention switched on with the wall clock moved past it), the
    batch answers as contains does, key by key, in any key order."""
    sh = Shared()
    a, b, c = _handle(sh), _handle(sh), _handle(sh)
    job = 1000
    try:
        for op, key, flag in ops:
            job += 1
            if op == "store":
                packed, _failed, _ev, _pending = a.store_ops(job, [key], [0], 64, True)
                if flag:  # else left WRITING (being written: not READY)
                    a.complete(_ok(np.frombuffer(packed, dtype=OP_DTYPE)), False)
            elif op == "lookup":
                b.lookup(key)  # a leased hit (or a miss)
            elif op == "purge":
                b.purge(0, flag)
            elif op == "retention":  # each process's Table is told (the store's config)
                for h in (a, b, c):
                    h.set_retention(10**9 if flag else 0)
            elif op == "age":
                _table._set_wall_clock_offset_ns(2 * 10**9)
            elif op == "touch":
                got = a.touch([key, key])
                assert got in (0, 2)
            for h in (a, b):
                many = h.contains_many(order)
                one = bytes(h.contains(k) for k in order)
                assert many == one, (op, key, flag)
                assert h.contains_many(order) == one
            # A third handle leases what is READY, counts nothing, and lets
            # go of its own grants only (b's lookup lease stays).
            # (An expired chunk found is counted by every reader, contains too.)
            counted = c.counters()
            counted.pop("retention_expired")
            assert c.lease_many(order) == one, (op, key, flag)
            after = c.counters()
            after.pop("retention_expired")
            assert after == counted
            c.release_leases()
    finally:
        _table._set_wall_clock_offset_ns(0)
        sh.close()


def _stored(t, keys: list[bytes], job: int = 1) -> None:
    packed, _failed, _ev, _pending = t.store_ops(job, keys, list(range(len(keys))), 64, True)
    t.complete(_ok(np.frombuffer(packed, dtype=OP_DTYPE)), False)


def test_lease_many_leases_as_lookup_does_until_release_leases() -> None:
    """Key by key, ``lease_many`` answers as ``lookup`` and leaves each READY
    key leased as a lookup hit (no sharer invalidates it) until this handle's
    ``release_leases``; it counts neither hits nor misses."""
    sh = Shared()
    a, b = _handle(sh), _handle(sh)
    try:
        ready = [KEYS[0], KEYS[4]]  # two sets
        _stored(a, ready)
        writing = KEYS[1]
        a.store_ops(2, [writing], [0], 64, True)  # left WRITING: not READY
        asked = [KEYS[0], writing, b"never", KEYS[4], KEYS[0]]
        counted = b.counters()
        got = b.lease_many(asked)
        assert got == bytes([1, 0, 0, 1, 1])
        assert b.counters() == counted
        # Leased: neither handle can remove them, as after a lookup hit.
        assert not a.invalidate(KEYS[0]) and not a.invalidate(KEYS[4])
        b.release_leases()
        # KEYS[0] was leased twice in the batch: both grants are released.
        assert a.invalidate(KEYS[0]) and a.invalidate(KEYS[4])
        # The same as lookup's, answer by answer.
        _stored(a, ready, job=3)
        one = bytes(b.lookup(k) for k in asked)
        b.release_leases()
        assert b.lease_many(asked) == one
        b.release_leases()
    finally:
        sh.close()


def test_lease_many_refuses_what_lookup_refuses() -> None:
    sh = Shared()
    t = _handle(sh)
    try:
        with pytest.raises(TypeError, match="a key must be bytes"):
            t.lease_many([KEYS[0], "str"])
        with pytest.raises(TypeError, match="keys must be a sequence"):
            t.lease_many(7)
        t.detach()
        with pytest.raises(RuntimeError, match="not attached"):
            t.lease_many([KEYS[0]])
    finally:
        sh.close()


def _churn(sh: Shared, stop, ready) -> None:
    t = _handle(sh)
    ready.set()
    job = 1
    while not stop.is_set():
        for key in KEYS:
            job += 1
            packed, _f, _e, _p = t.store_ops(job, [key], [0], 64, True)
            t.complete(_ok(np.frombuffer(packed, dtype=OP_DTYPE)), False)
        t.purge(0, True)
    t.detach()
    os._exit(0)


def test_contains_many_never_hits_a_key_never_stored_while_another_process_churns() -> None:
    """Another process stores and purges KEYS in a loop: the batch never
    reports a key that was never stored, and each answer matches a state the
    key really had (READY or not)."""
    sh = Shared()
    ctx = multiprocessing.get_context("fork")
    stop, ready = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_churn, args=(sh, stop, ready))
    proc.start()
    try:
        assert ready.wait(10)
        t = _handle(sh)
        never = [b"never-%d" % i for i in range(64)]
        batch = (KEYS + never) * 8
        hits = 0
        for _ in range(2000):
            got = t.contains_many(batch)
            assert len(got) == len(batch)
            assert set(got) <= {0, 1}
            for i, key in enumerate(batch):
                if key in never:
                    assert got[i] == 0, key
            hits += sum(got)
        assert hits > 0  # the churn was seen
    finally:
        stop.set()
        proc.join(10)
        sh.close()
    assert proc.exitcode == 0
