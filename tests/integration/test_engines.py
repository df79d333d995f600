"""Behaviour every ``IoEngine`` shares, run against each engine usable here.

The suite as a whole runs once per engine (``NVMETIER_ENGINE``); these tests
compare the engines directly, so both are built in one process.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import time
from collections.abc import Iterator

import numpy as np
import pytest
import xxhash

from nvmetier.engine import ThreadEngine, make_engine, uring_status
from nvmetier.engine.base import (
    COMPLETION_DTYPE,
    OP_DTYPE,
    OP_READ,
    OP_WRITE,
    Completion,
    IoEngine,
    Op,
)

ROW = 65536
_URING_OK, _URING_WHY = uring_status()
ENGINES = [
    "threads",
    pytest.param(
        "uring", marks=pytest.mark.skipif(not _URING_OK, reason=f"io_uring: {_URING_WHY}")
    ),
]


@pytest.fixture(params=ENGINES)
def engine_over_file(request, tmp_path) -> Iterator[tuple[IoEngine, mmap.mmap, int]]:
    region = mmap.mmap(-1, 8 * ROW)
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 8 * ROW)
    engine = make_engine(request.param, memoryview(region), [fd], io_threads=2, queue_depth=4)
    yield engine, region, fd
    engine.close()
    os.close(fd)
    region.close()


def _run(engine: IoEngine, ops: list[Op], timeout_s: float = 30) -> dict[int, Completion]:
    engine.submit(ops)
    got: dict[int, Completion] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < len(ops):
        assert time.monotonic() < deadline, f"{len(got)} of {len(ops)} ops completed"
        for c in engine.wait_completions(0.5):
            got[c.op_id] = c
    return got


def test_checksum_false_moves_the_bytes_and_reports_zero(engine_over_file) -> None:
    engine, region, fd = engine_over_file
    payload = os.urandom(ROW)
    region[0:ROW] = payload
    done = _run(engine, [Op(1, OP_WRITE, 0, 0, 0, ROW, 7, False)])
    assert done[1] == Completion(1, ROW, 0)
    assert os.pread(fd, ROW, 0) == payload
    done = _run(engine, [Op(2, OP_READ, 0, 0, ROW, ROW, 7, False)])
    assert done[2] == Completion(2, ROW, 0)
    assert region[ROW : 2 * ROW] == payload


def test_checksum_is_the_seeded_xxh3_by_default(engine_over_file) -> None:
    engine, region, _fd = engine_over_file
    region[0:ROW] = os.urandom(ROW)
    expected = xxhash.xxh3_64_intdigest(region[0:ROW], 11)
    done = _run(engine, [Op(1, OP_WRITE, 0, 0, 0, ROW, 11)])
    assert done[1] == Completion(1, ROW, expected)
    done = _run(engine, [Op(2, OP_READ, 0, 0, 2 * ROW, ROW, 11)])
    assert done[2] == Completion(2, ROW, expected)


def test_an_op_naming_no_file_fails_with_ebadf_and_the_engine_goes_on(engine_over_file) -> None:
    """A negative or too-large file index fails its op alike under both
    engines (the thread engine used to index Python's list with it: -1 wrote
    the last file, 5 killed the worker and stranded the op)."""
    engine, region, fd = engine_over_file
    region[0:ROW] = os.urandom(ROW)
    done = _run(
        engine,
        [
            Op(1, OP_WRITE, -1, 0, 0, ROW),
            Op(2, OP_WRITE, 5, 0, 0, ROW),
            *(Op(10 + i, OP_WRITE, 0, i * ROW, 0, ROW) for i in range(4)),
        ],
    )
    assert done[1].result == -errno.EBADF
    assert done[2].result == -errno.EBADF
    assert all(done[10 + i].result == ROW for i in range(4))
    assert os.pread(fd, ROW, 0) == bytes(region[0:ROW])


def test_packed_ops_naming_no_file_fail_with_ebadf(engine_over_file) -> None:
    engine, _region, _fd = engine_over_file
    ops = np.zeros(3, dtype=OP_DTYPE)
    ops["op_id"] = [1, 2, 3]
    ops["file_idx"] = [-1, 9, 0]
    ops["length"] = ROW
    ops["kind"] = OP_WRITE
    engine.submit_raw(ops.tobytes())
    got: dict[int, int] = {}
    deadline = time.monotonic() + 10
    while len(got) < 3 and time.monotonic() < deadline:
        for op_id, result, _sum in np.frombuffer(engine.wait_raw(0.2), COMPLETION_DTYPE).tolist():
            got[op_id] = result
    assert got == {1: -errno.EBADF, 2: -errno.EBADF, 3: ROW}


@pytest.mark.timeout(30)
def test_thread_engine_worker_survives_an_unexpected_exception(tmp_path, caplog) -> None:
    """Any exception inside a worker fails that op with EIO, logged once; the
    single worker goes on with the next ops (it used to die, stranding its op
    and every op queued behind it, and the table's slot stayed WRITING)."""
    region = mmap.mmap(-1, 4 * ROW)
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 4 * ROW)
    engine = ThreadEngine(memoryview(region), [fd], n_threads=1)
    try:
        with caplog.at_level(logging.ERROR, logger="nvmetier"):
            done = _run(
                engine,
                [
                    Op(1, OP_WRITE, 0, 0, 0, float(ROW)),  # type: ignore[arg-type]  # TypeError
                    Op(2, OP_WRITE, 0, 0, 0, ROW),
                    Op(3, OP_READ, 0, 0, ROW, ROW, "seed"),  # type: ignore[arg-type]  # TypeError
                    Op(4, OP_READ, 0, 0, 2 * ROW, ROW),
                ],
                timeout_s=10,
            )
    finally:
        engine.close()
        os.close(fd)
    assert done[1].result == -errno.EIO
    assert done[2].result == ROW
    assert done[3].result == -errno.EIO
    assert done[4].result == ROW
    assert region[2 * ROW : 3 * ROW] == region[0:ROW]
    assert len([r for r in caplog.records if "unexpected" in r.getMessage()]) == 1
    region.close()


@pytest.mark.timeout(30)
def test_thread_engine_store_fails_a_job_whose_worker_raised_and_the_key_stores_again(
    tmp_path, monkeypatch
) -> None:
    """Through the store: a worker exception fails the store job and leaves the
    slot free (not WRITING), so the next store of the key succeeds."""
    from nvmetier.engine import threads
    from tests.integration.helpers import key, load_keys, make_store, store_keys

    region = mmap.mmap(-1, 16 * ROW)
    buf = memoryview(region)
    store = make_store(str(tmp_path), buf, engine="threads", io_threads=1)
    calls = {"n": 0}
    real, real_copy = threads._xxh3, threads._xxh3_copy

    def flaky(*args):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 1:
            raise MemoryError("injected")
        return (real if len(args) == 2 else real_copy)(*args)

    try:
        # Direct ops hash with _xxh3, staged ones copy and hash with _xxh3_copy.
        monkeypatch.setattr(threads, "_xxh3", flaky)
        monkeypatch.setattr(threads, "_xxh3_copy", flaky)
        (first,) = store_keys(store, buf, [key(1)])
        assert not first.success
        assert calls["n"] == 1
        monkeypatch.setattr(threads, "_xxh3", real)
        monkeypatch.setattr(threads, "_xxh3_copy", real_copy)
        (second,) = store_keys(store, buf, [key(1)], job_id=3)
        assert second.success
        outcome, good = load_keys(store, buf, [key(1)])
        assert outcome.success and good == [key(1)]
    finally:
        store.close()
        buf.release()
        region.close()
