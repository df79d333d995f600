"""A real slot table in anonymous memory, for the unit tests that drive
``nvmetier._table.Table`` directly (the SWAR scan's one-set table, the
refresh's multi-set table): its table and index mappings formatted for
``slots`` slots of ``ways`` ways, one lock file, one attached Table, and
stores completed at once. No engine, no disk; one thread.
"""

from __future__ import annotations

import mmap
import os
import tempfile

import numpy as np
import pytest

_table = pytest.importorskip("nvmetier._table")
from nvmetier.engine.base import COMPLETION_DTYPE, OP_DTYPE  # noqa: E402

ROW_BYTES = 4096


class MemTable:
    """A formatted, attached table of ``slots`` slots in sets of ``ways``."""

    def __init__(self, slots: int, ways: int, prefix: str = "nvt-mem-") -> None:
        self.slots = slots
        self.ways = ways
        self.map = mmap.mmap(-1, _table.table_bytes(slots, ways))
        self.index = mmap.mmap(-1, slots * 128)
        _table.format(self.map, slots, ways)
        self.fd, self.lock_path = tempfile.mkstemp(prefix=prefix, suffix=".lock")
        self.t = _table.Table(
            self.map,
            self.index,
            self.fd,
            n_paths=1,
            slot_bytes=ROW_BYTES,
            row_bytes=ROW_BYTES,
            n_rows=slots,
            lease_ns=10**9,
            watch_timeout_ns=10**9,
        )
        self.t.attach()
        self.job = 0

    def close(self) -> None:
        self.t.detach()
        os.close(self.fd)
        os.unlink(self.lock_path)

    def complete(self, packed: bytes) -> None:
        """Every op of ``packed`` done in full (its length, checksum 7)."""
        ops = np.frombuffer(packed, dtype=OP_DTYPE)
        comps = np.zeros(len(ops), dtype=COMPLETION_DTYPE)
        for i, op in enumerate(ops):
            comps[i] = (int(op["op_id"]), int(op["length"]), 7)
        self.t.complete(comps.tobytes(), False)

    def store(self, keys: list[bytes]) -> list[int]:
        """Store ``keys`` (completed at once): the slot each op claimed."""
        self.job += 1
        packed, failed, _ev, _pending = self.t.store_ops(
            self.job, keys, np.arange(len(keys), dtype=np.int64), len(keys), True
        )
        assert failed is None
        self.complete(packed)
        return [int(op["file_offset"]) // ROW_BYTES for op in np.frombuffer(packed, dtype=OP_DTYPE)]
