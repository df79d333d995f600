"""The table survives what a careless or hostile caller hands it: bogus
arguments raise or are answered, never crash the process; a header corrupted
one byte at a time is refused or usable, never a crash; the job path keeps no
reference to the caller's objects (the review of issue 15, reproducers R03,
R05 and R08, which lived in ``tools/review`` until they became these tests).

No disk but a lock file: anonymous mappings. What could crash runs in a
subprocess, so a crash is a failed test naming the case, not a dead session.
"""

from __future__ import annotations

import mmap
import os
import struct
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator

import numpy as np
import pytest

from nvmetier import _table  # type: ignore[attr-defined]  # a C extension

pytestmark = pytest.mark.timeout(120)

# Builds one attached handle ``t`` (lock fd ``fd``) on a fresh table ``sh``.
PRELUDE = textwrap.dedent(
    """
    import mmap, os, struct, tempfile
    import numpy as np
    import nvmetier._table as _table

    OP = _table.OP_BYTES

    class Shared:
        def __init__(self, n_slots=64, ways=4, rows=64, row_bytes=4096):
            self.row_bytes = row_bytes
            self.table_map = mmap.mmap(-1, _table.table_bytes(n_slots, ways))
            self.index_map = mmap.mmap(-1, n_slots * 128)
            _table.format(self.table_map, n_slots, ways)
            self.fd, path = tempfile.mkstemp(prefix="nvt-robust-")
            os.unlink(path)
            self.rows = rows

        def handle(self, attach=True):
            t = _table.Table(self.table_map, self.index_map, self.fd, n_paths=1,
                             slot_bytes=self.row_bytes, row_bytes=self.row_bytes,
                             n_rows=self.rows, lease_ns=10**9, watch_timeout_ns=2 * 10**9)
            if attach:
                t.attach()
            return t

    def ops_ids(ops):
        return [struct.unpack_from("<Q", ops, i * OP)[0] for i in range(len(ops) // OP)]

    def comp(op_id, result, checksum=0):
        return struct.pack("<QqQ", op_id, result, checksum)
    """
)

# name -> statements run against a fresh ``sh`` / ``t`` / ``fd``.
BOGUS = {
    "rows int32 negative": "t.store_ops(1, [b'a'], np.array([-1], np.int32), 10, False)",
    "rows uint64 huge": "t.store_ops(1, [b'a'], np.array([2**63 + 5], np.uint64), 10, False)",
    "rows uint32 max": "t.store_ops(1, [b'a'], np.array([2**32 - 1], np.uint32), 10, False)",
    "rows float64": "t.store_ops(1, [b'a'], np.array([1.5]), 10, False)",
    "rows bool": "t.store_ops(1, [b'a'], np.array([True]), 10, False)",
    "rows strided": "t.store_ops(1, [b'a', b'b'], np.arange(20)[::2][:2], 10, False)",
    "rows 2d": "t.store_ops(1, [b'a', b'b', b'c', b'd'], np.arange(4).reshape(2, 2), 10, False)",
    "rows big-endian": "t.store_ops(1, [b'a'], np.array([1], dtype='>i8'), 10, False)",
    "rows wrong count": "t.store_ops(1, [b'a', b'b'], np.array([1], np.int64), 10, False)",
    "rows huge int": "t.store_ops(1, [b'a'], [2**70], 10, False)",
    "rows 0d array": "t.store_ops(1, [b'a'], np.int64(3), 10, False)",
    "key str": "t.store_ops(1, ['a'], [1], 10, False)",
    "key bytearray": "t.lookup(bytearray(b'a'))",
    "key empty": (
        "o = t.store_ops(1, [b''], [1], 10, False)\n"
        "t.complete(comp(ops_ids(o[0])[0], 4096), False)\n"
        "t.lookup(b'')"
    ),
    "key 89 bytes": "t.store_ops(1, [b'x' * 89], [1], 10, False)",
    "key 344 bytes": "t.lookup(b'x' * 344), t.invalidate(b'x' * 344), t.contains(b'y' * 100000)",
    "keys generator": "t.store_ops(1, (k for k in [b'a']), [1], 10, False)",
    "keys dict": "t.store_ops(1, {b'a': 1}, [1], 10, False)",
    "keys None": "t.store_ops(1, None, [1], 10, False)",
    "max_ops negative": "t.store_ops(1, [b'a'], [1], -5, False)",
    "complete forged ids": (
        "t.complete(comp(2**64 - 1, 4096) + comp(5000, 4096) + comp(2**32, 4096) + "
        "comp(0, 4096), False)"
    ),
    "complete short buffer": "t.complete(b'x' * 23, False)",
    "complete misaligned": (
        "o = t.store_ops(1, [b'a'], [1], 10, False)\n"
        "c = b'\\0' + comp(ops_ids(o[0])[0], 4096)\n"
        "t.complete(memoryview(c)[1:], False)"
    ),
    "complete op id plus 2^32": (
        "o = t.store_ops(1, [b'a'], [1], 10, False)\n"
        "t.complete(comp(ops_ids(o[0])[0] + 2**32, 4096), False)"
    ),
    "load float slots": "t.load(np.array([1.0, 3e300, -1.0]), False)",
    "load int32 slots": "t.load(np.array([1, 2, 3, 4], np.int32), False)",
    "load huge slots": "t.load(np.array([2**62, -(2**62)], np.int64), False)",
    "hold_set huge": "t._hold_set(2**64 - 1)",
    "hold_set negative": "t._hold_set(-1)",
    # Released at the end: a robust mutex still held when its mapping goes
    # would stay on this thread's robust list (a test hook's hazard only).
    "hold_set twice": "t._hold_set(0), t._hold_set(0)\nt._release_set(0)",
    "release not held": "t._release_set(3), t.lookup(b'zz')",
    "clock offset min": (
        "_table._set_clock_offset_ns(-(2**63))\n"
        "try:\n    t.lookup(b'a'), t.store_ops(1, [b'q'], [1], 10, False)\n"
        "finally:\n    _table._set_clock_offset_ns(0)"
    ),
    "clock offset max": (
        "_table._set_clock_offset_ns(2**63 - 1)\n"
        "try:\n    t.lookup(b'a'), t.store_ops(1, [b'q'], [1], 10, False)\n"
        "finally:\n    _table._set_clock_offset_ns(0)"
    ),
    "Table n_paths 0": (
        "_table.Table(sh.table_map, sh.index_map, fd, n_paths=0, slot_bytes=4096, "
        "row_bytes=4096, n_rows=1, lease_ns=1, watch_timeout_ns=1)"
    ),
    "Table huge geometry": (
        "tt = _table.Table(sh.table_map, sh.index_map, fd, n_paths=1, slot_bytes=2**62, "
        "row_bytes=2**62, n_rows=2**62, lease_ns=1, watch_timeout_ns=2**64 - 1)\n"
        "tt.attach()\n"
        "tt.store_ops(1, [b'a', b'b'], [2**62 - 1, 5], 10, False)"
    ),
    "Table index short": (
        "_table.Table(sh.table_map, mmap.mmap(-1, 100), fd, n_paths=1, slot_bytes=4096, "
        "row_bytes=4096, n_rows=1, lease_ns=1, watch_timeout_ns=1)"
    ),
    "Table read-only buffer": (
        "_table.Table(bytes(sh.table_map), sh.index_map, fd, n_paths=1, slot_bytes=4096, "
        "row_bytes=4096, n_rows=1, lease_ns=1, watch_timeout_ns=1)"
    ),
    "Table bad lock fd": (
        "_table.Table(sh.table_map, sh.index_map, -1, n_paths=1, slot_bytes=4096, "
        "row_bytes=4096, n_rows=1, lease_ns=1, watch_timeout_ns=1).attach()"
    ),
    "bind non-callables": "t.bind(1, 2, 10, False, False)\nt.submit_store(1, [b'a'], [1])",
    "bind wait returns str": (
        "t.bind(lambda b: None, lambda to: 'zz' * 13, 10, False, False)\n"
        "t.submit_store(1, [b'a'], [1]), t.poll(), t.inflight()"
    ),
    "bind wait raises": (
        "t.bind(lambda b: None, lambda to: 1 / 0, 10, False, False)\n"
        "t.submit_store(1, [b'a'], [1])\nt.poll()"
    ),
    "submit refused": (
        "t.bind(lambda b: 1 / 0, lambda to: b'', 10, False, False)\n"
        "t.submit_store(1, [b'a'], [1]), t.poll(), t.usage()"
    ),
    "submit after unbind": "t.bind(None, None, 0, False, False)\nt.submit_load(1, [b'a'], [1])",
    "skip wrong type": (
        "t.bind(lambda b: None, lambda to: b'', 10, False, False)\n"
        "t.submit_store(1, [b'a'], [1], 'x')"
    ),
    "never attached": "sh.handle(attach=False).store_ops(1, [b'a'], [1], 10, False)",
    "attach twice": "t.attach(), t.attach()",
    "sharers bogus fd": "_table.sharers(sh.table_map, 99999)",
    "header short": "_table.header(b'x' * 10)",
    "format tiny": "_table.format(bytearray(100), 8, 2)",
    "format ways 0": "_table.format(bytearray(10**6), 8, 0)",
    "table_bytes huge": "_table.table_bytes(2**32 - 4096, 4096)",
}

RUNNER = textwrap.dedent(
    """
    import json, sys
    cases = json.loads(sys.stdin.read())
    for name, body in cases.items():
        sh = Shared()
        t, fd = sh.handle(), sh.fd
        try:
            exec(body)
            outcome = "returned"
        except Exception as exc:
            outcome = "raised " + type(exc).__name__
        print(name + "\\t" + outcome, flush=True)
    """
)


@pytest.fixture(scope="module")
def bogus_outcomes() -> dict[str, str]:
    """Each case's outcome, all cases in one subprocess (a crash ends the
    run: the cases it did not reach have no outcome)."""
    import json

    run = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", PRELUDE + RUNNER],
        input=json.dumps(BOGUS),
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    out = dict(line.split("\t", 1) for line in run.stdout.splitlines() if "\t" in line)
    if run.returncode != 0:
        out["<exit>"] = f"exit {run.returncode}: {run.stderr[-2000:]}"
    return out


@pytest.mark.parametrize("case", list(BOGUS))
def test_a_bogus_argument_raises_or_is_answered_never_crashes(
    bogus_outcomes: dict[str, str], case: str
) -> None:
    assert case in bogus_outcomes, bogus_outcomes.get("<exit>", "the run stopped before this case")


HEADER_PROBE = textwrap.dedent(
    """
    sh = Shared(n_slots=64, ways=4)
    orig = bytes(sh.table_map[:256])
    refused = worked = 0
    for i in range(256):
        for v in (0, 0xFF, 0x80, 0x01):
            if orig[i] == v:
                continue
            sh.table_map[i] = v
            _table.header(sh.table_map)
            _table.sharers(sh.table_map, sh.fd)
            try:
                t = sh.handle(attach=False)
            except ValueError:
                refused += 1
            else:
                t.attach()
                t.lookup(b"x")
                t.store_ops(1, [b"a%d" % i], [1], 10, False)
                t.detach()
                t.sweep()
                worked += 1
            sh.table_map[i] = orig[i]
    print(refused, worked)
    """
)


def test_a_header_corrupted_one_byte_at_a_time_is_refused_or_usable_never_a_crash() -> None:
    run = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", PRELUDE + HEADER_PROBE],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    refused, worked = map(int, run.stdout.split())
    # Both outcomes occur: the magic, version and geometry fields are checked,
    # while counters and padding may hold anything.
    assert refused > 0 and worked > 0


@pytest.fixture
def handle() -> Iterator[tuple[_table.Table, list[bytes]]]:
    n_slots, ways, row_bytes = 256, 8, 4096
    table_map = mmap.mmap(-1, _table.table_bytes(n_slots, ways))
    index_map = mmap.mmap(-1, n_slots * 128)
    _table.format(table_map, n_slots, ways)
    fd, path = tempfile.mkstemp(prefix="nvt-robust-")
    os.unlink(path)
    t = _table.Table(
        table_map,
        index_map,
        fd,
        n_paths=1,
        slot_bytes=row_bytes,
        row_bytes=row_bytes,
        n_rows=64,
        lease_ns=10**9,
        watch_timeout_ns=10**9,
    )
    t.attach()
    pending: list[bytes] = []

    def submit_raw(ops: bytes) -> None:
        for i in range(len(ops) // _table.OP_BYTES):
            (op_id,) = struct.unpack_from("<Q", ops, i * _table.OP_BYTES)
            pending.append(struct.pack("<QqQ", op_id, row_bytes, 99))

    def wait_raw(_timeout: object) -> bytes:
        out = b"".join(pending)
        pending.clear()
        return out

    t.bind(submit_raw, wait_raw, 1000, True, True)
    yield t, pending
    t.bind(None, None, 0, False, False)
    t.detach()
    os.close(fd)


def test_the_job_path_keeps_no_reference_to_the_callers_keys_or_rows(handle) -> None:
    t, _pending = handle
    key = b"refkey-0"
    keys = [key, b"refkey-1", b"x" * 100]  # the third key is too long: it fails
    rows = np.array([1, 2, 3], np.int64)

    def one_round(i: int) -> None:
        t.submit_store(i, keys, rows)
        t.poll()
        t.take_events()
        t.submit_load(i, keys, rows)
        t.poll()
        t.lookup(key)
        t.release_leases()
        t.invalidate(b"refkey-1")
        t.take_events()
        with pytest.raises(TypeError):
            t.store_ops(i, [key, 5, key], rows, 10, True)

    for i in range(100):  # warm: caches and free lists at their steady size
        one_round(i)
    before = (sys.getrefcount(key), sys.getrefcount(keys), sys.getrefcount(rows))
    for i in range(100, 2100):
        one_round(i)
    after = (sys.getrefcount(key), sys.getrefcount(keys), sys.getrefcount(rows))
    assert after == before
    assert t.inflight() == (0, 0)
