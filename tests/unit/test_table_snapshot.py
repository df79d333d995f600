"""The table walks a snapshot of its keys and rows arguments: a caller that
edits its lists (another thread during a set wait that releases the GIL, an
item's ``__index__``, or a list reused after submit) can neither crash it nor
change what a job reports (review of issue 15's table, findings R01, R09, R10)."""

from __future__ import annotations

import mmap
import os
import struct
import tempfile

from nvmetier import _table  # type: ignore[attr-defined]  # a C extension

N_SLOTS, WAYS, ROW_BYTES, N_ROWS = 64, 4, 4096, 64


def _handle() -> _table.Table:
    table_map = mmap.mmap(-1, _table.table_bytes(N_SLOTS, WAYS))
    index_map = mmap.mmap(-1, N_SLOTS * 128)
    _table.format(table_map, N_SLOTS, WAYS)
    fd, path = tempfile.mkstemp(prefix="nvt-snapshot-", suffix=".lock")
    os.unlink(path)
    table = _table.Table(
        table_map,
        index_map,
        fd,
        n_paths=1,
        slot_bytes=ROW_BYTES,
        row_bytes=ROW_BYTES,
        n_rows=N_ROWS,
        lease_ns=10**9,
        watch_timeout_ns=10**9,
    )
    table.attach()
    return table


def test_rows_whose_index_empties_the_list() -> None:
    table = _handle()
    rows: list[object] = []

    class Evil:
        def __index__(self) -> int:
            rows.clear()
            return 1

    rows.extend([Evil()] + [2] * 999)
    keys = [b"k%d" % i for i in range(1000)]
    _ops, failed, _evicted, _pending = table.store_ops(1, keys, rows, 10, False)
    assert failed is not None and len(failed) == 990  # over max_ops; no crash


def test_successful_keys_are_the_keys_submitted() -> None:
    table = _handle()
    pending: list[bytes] = []

    def submit_raw(ops: bytes) -> None:
        for i in range(len(ops) // _table.OP_BYTES):
            (op_id,) = struct.unpack_from("<Q", ops, i * _table.OP_BYTES)
            pending.append(struct.pack("<QqQ", op_id, ROW_BYTES, 9))

    def wait_raw(_timeout: float) -> bytes:
        out = b"".join(pending)
        pending.clear()
        return out

    table.bind(submit_raw, wait_raw, 100, False, False)
    keys = [b"stored-1", b"k" * 100]  # the second key is too long: the job fails
    table.submit_store(1, keys, [1, 2])
    keys[:] = [b"never-stored", b"also-never"]  # the caller reuses its list
    (job,) = table.poll()
    assert job[1] is False
    assert job[2] == [b"stored-1"]


def test_non_iterable_keys_and_rows_are_type_errors() -> None:
    table = _handle()
    for keys, rows in ((None, [1]), ([b"a"], None)):
        try:
            table.store_ops(1, keys, rows, 10, False)
        except TypeError as exc:
            assert "must be a sequence" in str(exc)
        else:
            raise AssertionError("accepted")
