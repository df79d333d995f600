"""Adversarial checks of ``Table.contains_many`` (and ``touch``, its shared
path) against ``Table.contains``, key by key: random stores, half-written
stores, leases, purges and retention expiry over two handles, and another
process storing and purging while this one asks (never a false hit).

Reuses the model test's small table (4 sets of 2 ways) and helpers; no disk.
About 2 s.
"""

from __future__ import annotations

import multiprocessing
import os

import numpy as np
from hypothesis import given, settings
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
def test_contains_many_agrees_with_contains_in_every_state(ops, order) -> None:
    """After each step (a completed store, a store left WRITING, a leased hit,
    a purge, a retention switched on with the wall clock moved past it), the
    batch answers as contains does, key by key, in any key order."""
    sh = Shared()
    a, b = _handle(sh), _handle(sh)
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
            elif op == "retention":
                for h in (a, b):
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
    finally:
        _table._set_wall_clock_offset_ns(0)
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
