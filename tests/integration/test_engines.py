"""Behaviour every ``IoEngine`` shares, run against each engine usable here.

The suite as a whole runs once per engine (``NVMETIER_ENGINE``); these tests
compare the engines directly, so both are built in one process.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Iterator

import pytest
import xxhash

from nvmetier.engine import make_engine, uring_status
from nvmetier.engine.base import OP_READ, OP_WRITE, Completion, IoEngine, Op

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


def _run(engine: IoEngine, ops: list[Op]) -> dict[int, Completion]:
    engine.submit(ops)
    got: dict[int, Completion] = {}
    deadline = time.monotonic() + 30
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
