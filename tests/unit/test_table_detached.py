"""A Table that is not a sharer (never attached, or detached) refuses the
data path.

Was a bug (R07 of an earlier review): ``store_ops``, ``submit_store`` and the
other data-path calls worked on a Table before ``attach()`` or after
``detach()``, claiming slots WRITING under owner 0 (registry entry 0: another
process's, or nobody's) with this process's incarnation unknown to it, so a
live sharer's slot could be reclaimed as dead, or a dead entry keep a slot.
Now each such call raises RuntimeError and changes nothing in the table;
the rebuild (``load``, before attach), the last closer's ``sweep`` (after
detach) and the read-only gauges stay allowed.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from nvmetier import _table  # type: ignore[attr-defined]  # a C extension

N_SLOTS, WAYS, ROW_BYTES, N_ROWS = 64, 4, 4096, 16


class Shared:
    """One table and index, and a lock file; each handle is its own sharer."""

    def __init__(self) -> None:
        self.table_map = mmap.mmap(-1, _table.table_bytes(N_SLOTS, WAYS))
        self.index_map = mmap.mmap(-1, N_SLOTS * 128)
        _table.format(self.table_map, N_SLOTS, WAYS)
        fd, self.path = tempfile.mkstemp(prefix="nvt-detached-", suffix=".lock")
        os.close(fd)
        self.fds: list[int] = []

    def handle(self) -> _table.Table:
        fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        self.fds.append(fd)
        return _table.Table(
            self.table_map,
            self.index_map,
            fd,
            n_paths=1,
            slot_bytes=ROW_BYTES,
            row_bytes=ROW_BYTES,
            n_rows=N_ROWS,
            lease_ns=10**9,
            watch_timeout_ns=10**9,
        )

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        os.unlink(self.path)


@pytest.fixture
def shared() -> Iterator[Shared]:
    sh = Shared()
    yield sh
    sh.close()


def _bound(t: _table.Table) -> list[bytes]:
    """Bind ``t`` to an engine that records what it is handed."""
    handed: list[bytes] = []
    t.bind(handed.append, lambda _timeout: b"", 100, False, False)
    return handed


ROWS = np.array([1], dtype=np.int64)

# Every data-path call, each with arguments it accepts on an attached Table.
CALLS: dict[str, Callable[[_table.Table], object]] = {
    "lookup": lambda t: t.lookup(b"k"),
    "contains": lambda t: t.contains(b"k"),
    "contains_many": lambda t: t.contains_many([b"k"]),
    "lease_many": lambda t: t.lease_many([b"k"]),
    "slot_of": lambda t: t.slot_of(b"k"),
    "touch": lambda t: t.touch([b"k"]),
    "store_ops": lambda t: t.store_ops(1, [b"k"], ROWS, 10, False),
    "load_ops": lambda t: t.load_ops(1, [b"k"], ROWS, False),
    "complete": lambda t: t.complete(b"", False),
    "submit_store": lambda t: t.submit_store(1, [b"k"], ROWS),
    "submit_load": lambda t: t.submit_load(1, [b"k"], ROWS),
    "poll": lambda t: t.poll(),
    "collect": lambda t: t.collect(0.0),
    "release_leases": lambda t: t.release_leases(),
    "invalidate": lambda t: t.invalidate(b"k"),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_a_data_path_call_on_a_table_never_attached_raises(shared: Shared, call: str) -> None:
    t = shared.handle()
    _bound(t)
    with pytest.raises(RuntimeError, match="not attached"):
        CALLS[call](t)


@pytest.mark.parametrize("call", list(CALLS))
def test_a_data_path_call_after_detach_raises(shared: Shared, call: str) -> None:
    t = shared.handle()
    t.attach()
    _bound(t)
    t.detach()
    with pytest.raises(RuntimeError, match="not attached"):
        CALLS[call](t)


def test_a_store_refused_after_detach_claims_no_slot_and_hands_the_engine_nothing(
    shared: Shared,
) -> None:
    t = shared.handle()
    t.attach()
    handed = _bound(t)
    t.detach()
    with pytest.raises(RuntimeError):
        t.submit_store(1, [b"k"], ROWS)
    with pytest.raises(RuntimeError):
        t.store_ops(2, [b"j"], ROWS, 10, False)
    assert handed == []
    assert t.inflight() == (0, 0)
    assert t.usage() == (0, 0, 0, 0)
    # A sharer that is attached stores both keys at once: no claim waits on them.
    other = shared.handle()
    other.attach()
    ops, failed, _evicted, pending = other.store_ops(3, [b"k", b"j"], np.array([1, 2]), 10, False)
    assert failed is None and pending == 2 and len(ops) == 2 * _table.OP_BYTES


def test_the_rebuild_before_attach_and_the_sweep_after_detach_stay_allowed(
    shared: Shared,
) -> None:
    t = shared.handle()
    t.load(np.zeros(0, dtype=np.int64), False)
    t.attach()
    t.detach()
    assert t.sweep() == 0
    assert t.counters()["hits"] == 0 and t.usage() == (0, 0, 0, 0) and t.inflight() == (0, 0)


def test_a_table_attached_again_after_detach_stores(shared: Shared) -> None:
    t = shared.handle()
    t.attach()
    t.detach()
    t.attach()
    _ops, failed, _evicted, pending = t.store_ops(1, [b"k"], ROWS, 10, False)
    assert failed is None and pending == 1


# The calls that read a sequence of keys (Python code may run while it is read).
KEY_CALLS: dict[str, Callable[[_table.Table, object], object]] = {
    "contains_many": lambda t, keys: t.contains_many(keys),
    "lease_many": lambda t, keys: t.lease_many(keys),
    "touch": lambda t, keys: t.touch(keys),
    "store_ops": lambda t, keys: t.store_ops(1, keys, np.array([1, 2]), 10, False),
    "load_ops": lambda t, keys: t.load_ops(1, keys, np.array([1, 2]), False),
    "submit_store": lambda t, keys: t.submit_store(1, keys, np.array([1, 2])),
    "submit_load": lambda t, keys: t.submit_load(1, keys, np.array([1, 2])),
}


@pytest.mark.parametrize("call", list(KEY_CALLS))
def test_a_detach_while_the_keys_are_read_is_refused_too(shared: Shared, call: str) -> None:
    """Was a bug: the attach check ran before the keys were read, and a
    generator (or a sequence's __getitem__) that detaches the Table let the
    call go on detached (store_ops claimed slots under no live sharer)."""
    t = shared.handle()
    t.attach()
    handed = _bound(t)

    def keys() -> Iterator[bytes]:
        yield b"k"
        t.detach()
        yield b"j"

    with pytest.raises(RuntimeError, match="not attached"):
        KEY_CALLS[call](t, keys())
    assert handed == []
    assert t.inflight() == (0, 0)
    assert t.usage() == (0, 0, 0, 0)
