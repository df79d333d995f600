"""Both engines, staged and direct, with each XXH3 build the CPU has forced
on the module that engine hashes with (``_table`` for threads, ``_uring``
for io_uring): the checksums are python-xxhash's, and a chunk corrupted on
disk reads back with a checksum that no longer matches the stored one (the
load's verify fails) whatever the build (about 1 s)."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterator

import pytest
import xxhash

from nvmetier import _table
from nvmetier.bench.tier import vllm_like_primary
from nvmetier.engine import uring_status
from nvmetier.engine.base import OP_READ, OP_WRITE, Op
from tests.integration.test_staging import _engine, _run

ROW = 1 << 20
_URING_OK, _URING_WHY = uring_status()
IMPLS = ("avx512", "avx2", "baseline")


def _module(engine: str):  # type: ignore[no-untyped-def]
    if engine == "threads":
        return _table
    from nvmetier import _uring

    return _uring


@pytest.fixture
def shm_region() -> Iterator[mmap.mmap]:
    region = vllm_like_primary(8 * ROW, tag="test-builds")
    yield region
    region.close()


@pytest.mark.parametrize("staging", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize(
    "name",
    [
        "threads",
        pytest.param(
            "uring", marks=pytest.mark.skipif(not _URING_OK, reason=f"io_uring: {_URING_WHY}")
        ),
    ],
)
def test_every_build_checksums_as_xxhash_and_catches_a_corrupted_chunk(
    name: str, staging: bool, shm_region: mmap.mmap, tmp_path
) -> None:
    mod = _module(name)
    best = mod.xxh3_impl()
    builds = IMPLS[IMPLS.index(best) :]
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 4 * ROW)
    try:
        for b, impl in enumerate(builds):
            mod._xxh3_force(impl)
            engine = _engine(name, shm_region, fd, staging=staging)
            try:
                payloads = [os.urandom(ROW) for _ in range(4)]
                for i, p in enumerate(payloads):
                    shm_region[i * ROW : (i + 1) * ROW] = p
                seed = 1000 * b + 7
                done = _run(
                    engine, [Op(i, OP_WRITE, 0, i * ROW, i * ROW, ROW, seed + i) for i in range(4)]
                )
                stored = {i: done[i].checksum for i in range(4)}
                for i, p in enumerate(payloads):
                    assert done[i].result == ROW
                    assert stored[i] == xxhash.xxh3_64_intdigest(p, seed + i), (impl, i)
                # One byte flipped in chunk 2, at an odd offset past the
                # first fused block.
                at = 2 * ROW + 65537
                os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x40]), at)
                shm_region[4 * ROW : 8 * ROW] = b"\0" * (4 * ROW)
                reads = [
                    Op(10 + i, OP_READ, 0, i * ROW, (4 + i) * ROW, ROW, seed + i) for i in range(4)
                ]
                done = _run(engine, reads)
                for i in range(4):
                    got = shm_region[(4 + i) * ROW : (5 + i) * ROW]
                    assert done[10 + i].result == ROW
                    assert done[10 + i].checksum == xxhash.xxh3_64_intdigest(got, seed + i)
                    assert (done[10 + i].checksum == stored[i]) is (i != 2), (impl, i)
            finally:
                engine.close()
    finally:
        mod._xxh3_force(best)
        os.close(fd)


@pytest.mark.parametrize(
    "name",
    [
        "threads",
        pytest.param(
            "uring", marks=pytest.mark.skipif(not _URING_OK, reason=f"io_uring: {_URING_WHY}")
        ),
    ],
)
def test_a_staged_store_of_a_row_being_overwritten_keeps_bytes_and_checksum_together(
    name: str, shm_region: mmap.mmap, tmp_path
) -> None:
    """The CPU tier's row changes while a staged store copies it (a torn
    source): the checksum is of the copy, which is what is written, so what
    lands on disk always verifies (never a chunk that fails for no fault)."""
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 4 * ROW)
    stop = threading.Event()
    patterns = [bytes([b]) * (64 << 10) for b in range(1, 9)]

    def scribble() -> None:
        k = 0
        while not stop.is_set():
            for off in range(0, 4 * ROW, 64 << 10):  # every row, 64 KiB at a time
                shm_region[off : off + (64 << 10)] = patterns[k % len(patterns)]
                k += 1

    t = threading.Thread(target=scribble)
    engine = _engine(name, shm_region, fd, staging=True)
    t.start()
    try:
        for r in range(5):
            ops = [Op(100 * r + i, OP_WRITE, 0, i * ROW, i * ROW, ROW, i) for i in range(4)]
            done = _run(engine, ops)
            for i in range(4):
                assert done[100 * r + i].result == ROW
                on_disk = os.pread(fd, ROW, i * ROW)
                assert done[100 * r + i].checksum == xxhash.xxh3_64_intdigest(on_disk, i)
    finally:
        stop.set()
        t.join()
        engine.close()
        os.close(fd)
