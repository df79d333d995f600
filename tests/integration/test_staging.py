"""Staging: ops moved through huge-page staging memory behave as direct ops.

Both engines are built here (the suite also runs once per ``NVMETIER_ENGINE``);
the buffer is a ``/dev/shm`` file populated as vLLM's ``SharedOffloadRegion``
populates its own (the kind of memory staging is for). Each test states one
behaviour: same bytes, same checksums, same failures, and the config and the
store say what they chose.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import time
from collections.abc import Iterator

import pytest
import xxhash

from nvmetier.bench.tier import vllm_like_primary
from nvmetier.config import TierConfig
from nvmetier.engine import make_engine, uring_status
from nvmetier.engine.base import OP_READ, OP_WRITE, Completion, IoEngine, Op
from nvmetier.errors import ConfigError
from nvmetier.memory import huge_page_bytes, staging_wanted
from nvmetier.store import BlockStore

ROW = 1 << 20  # 1 MiB: a few huge pages' worth across the arena
ROWS = 8
_URING_OK, _URING_WHY = uring_status()
ENGINES = [
    "threads",
    pytest.param(
        "uring", marks=pytest.mark.skipif(not _URING_OK, reason=f"io_uring: {_URING_WHY}")
    ),
]


@pytest.fixture
def shm_region() -> Iterator[mmap.mmap]:
    region = vllm_like_primary(ROWS * ROW, tag="test")
    yield region
    region.close()


def _engine(name: str, region: mmap.mmap, fd: int, staging: bool) -> IoEngine:
    return make_engine(
        name,
        memoryview(region),
        [fd],
        io_threads=3,
        queue_depth=4,
        max_inflight_bytes=3 * ROW,
        staging=staging,
    )


def _run(engine: IoEngine, ops: list[Op], timeout_s: float = 30) -> dict[int, Completion]:
    engine.submit(ops)
    got: dict[int, Completion] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < len(ops):
        assert time.monotonic() < deadline, f"{len(got)} of {len(ops)} ops completed"
        for c in engine.wait_completions(0.5):
            got[c.op_id] = c
    return got


@pytest.mark.parametrize("name", ENGINES)
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "o_direct"])
def test_staged_writes_and_reads_move_the_bytes_with_the_direct_checksums(
    name: str, direct: bool, shm_region: mmap.mmap, tmp_path
) -> None:
    flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
    try:
        fd = os.open(tmp_path / "data", flags, 0o600)
    except OSError as exc:
        pytest.skip(f"O_DIRECT refused here: {exc}")
    os.ftruncate(fd, ROWS * ROW)
    payloads = [os.urandom(ROW) for _ in range(4)]
    for i, p in enumerate(payloads):
        shm_region[i * ROW : (i + 1) * ROW] = p
    engine = _engine(name, shm_region, fd, staging=True)
    try:
        # More ops than the arena holds at once: some wait or move directly,
        # every one still lands whole.
        writes = [Op(i, OP_WRITE, 0, i * ROW, i * ROW, ROW, 5) for i in range(4)]
        done = _run(engine, writes)
        for i, p in enumerate(payloads):
            assert done[i] == Completion(i, ROW, xxhash.xxh3_64_intdigest(p, 5))
        shm_region[4 * ROW : 8 * ROW] = b"\0" * (4 * ROW)
        reads = [Op(10 + i, OP_READ, 0, i * ROW, (4 + i) * ROW, ROW, 5) for i in range(4)]
        done = _run(engine, reads)
        for i, p in enumerate(payloads):
            assert done[10 + i] == Completion(10 + i, ROW, xxhash.xxh3_64_intdigest(p, 5))
            assert shm_region[(4 + i) * ROW : (5 + i) * ROW] == p
        assert int(engine.describe()["staged_bytes"]) > 0  # type: ignore[call-overload]
    finally:
        engine.close()
        os.close(fd)


@pytest.mark.parametrize("name", ENGINES)
def test_staged_read_past_the_end_fails_and_leaves_the_buffer_untouched(
    name: str, shm_region: mmap.mmap, tmp_path
) -> None:
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, ROW // 2)  # half a row: the read comes up short
    shm_region[0:ROW] = b"\x5a" * ROW
    engine = _engine(name, shm_region, fd, staging=True)
    try:
        done = _run(engine, [Op(1, OP_READ, 0, 0, 0, ROW, 1)])
        assert done[1].result == -errno.EIO
        assert shm_region[0:ROW] == b"\x5a" * ROW
    finally:
        engine.close()
        os.close(fd)


@pytest.mark.parametrize("name", ENGINES)
def test_staged_ops_still_fail_a_bad_range_or_file(
    name: str, shm_region: mmap.mmap, tmp_path
) -> None:
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT, 0o600)
    engine = _engine(name, shm_region, fd, staging=True)
    try:
        done = _run(
            engine,
            [
                Op(1, OP_READ, 0, 0, ROWS * ROW - 4096, 8192, 1),  # past the buffer
                Op(2, OP_READ, 3, 0, 0, 4096, 1),  # no such file
            ],
        )
        assert done[1].result == -errno.EFAULT
        assert done[2].result == -errno.EBADF
    finally:
        engine.close()
        os.close(fd)


@pytest.mark.skipif(not _URING_OK, reason=f"io_uring: {_URING_WHY}")
def test_uring_staging_arena_is_mapped_per_worker_within_its_byte_cap(
    shm_region: mmap.mmap, tmp_path
) -> None:
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT, 0o600)
    engine = _engine("uring", shm_region, fd, staging=True)
    try:
        d = engine.describe()
        assert d["staging"] is True
        sizes = d["worker_staging_bytes"]
        assert isinstance(sizes, list) and sizes and all(s > 0 for s in sizes)
        # Twice the cap (3 rows: in flight, and reaped awaiting their copy),
        # in whole 2 MiB pages.
        assert all(s == 6 << 20 for s in sizes)
    finally:
        engine.close()
        os.close(fd)
    off = _engine("uring", shm_region, os.open(tmp_path / "data", os.O_RDWR), staging=False)
    try:
        assert off.describe()["staging"] is False
    finally:
        off.close()


def test_staging_auto_stages_a_4k_page_primary_and_not_a_huge_page_one() -> None:
    plain = vllm_like_primary(4 << 20, tag="test")
    try:
        stage, why = staging_wanted("auto", plain)
        if "[never]" in _thp_mode():
            assert not stage and "disabled" in why
        elif huge_page_bytes(*_addr(plain)) < (4 << 20) * 0.9:
            assert stage and "4 KiB pages" in why
        assert staging_wanted("off", plain) == (False, "staging off (config)")
        assert staging_wanted("on", plain)[0] is True
    finally:
        plain.close()


def test_huge_page_bytes_counts_a_thp_mapping(tmp_path) -> None:
    if "[never]" in _thp_mode():
        pytest.skip("transparent huge pages are off here")
    m = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
        m.write(b"\1" * len(m))
        got = huge_page_bytes(*_addr(m))
        if got == 0:
            pytest.skip("the kernel gave no huge page (memory fragmented)")
        assert 0 < got <= 8 << 20
        stage, why = staging_wanted("auto", m)
        if got >= 0.9 * (8 << 20):
            assert not stage and "huge-page backed" in why
    finally:
        m.close()


def _thp_mode() -> str:
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        return f.read()


def _addr(m: mmap.mmap) -> tuple[int, int]:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(m)), len(m)


def test_config_staging_accepts_auto_on_off_and_yaml_booleans(tmp_path) -> None:
    base = {"root_dir": str(tmp_path), "capacity_bytes": "64MiB"}
    assert TierConfig.from_dict(base).staging == "auto"
    assert TierConfig.from_dict({**base, "staging": True}).staging == "on"
    assert TierConfig.from_dict({**base, "staging": False}).staging == "off"
    with pytest.raises(ConfigError, match=r"staging='sometimes'.*'auto', 'on' or 'off'"):
        TierConfig.from_dict({**base, "staging": "sometimes"})


@pytest.mark.parametrize("name", ENGINES)
def test_store_logs_the_primary_backing_and_the_staging_choice(
    name: str, shm_region: mmap.mmap, tmp_path, caplog
) -> None:
    cfg = TierConfig.from_dict(
        {
            "root_dir": str(tmp_path),
            "capacity_bytes": 64 << 20,
            "persist": False,
            "staging": "on",
        }
    )
    with caplog.at_level(logging.INFO, logger="nvmetier.store"):
        store = BlockStore(
            cfg,
            store_name="t",
            identity={"t": 1},
            buffer=memoryview(shm_region),
            row_bytes=ROW,
            engine=name,
        )
    try:
        d = store.describe()
        assert d["primary_bytes"] == ROWS * ROW
        assert d["staging"] is True
        assert d["staging_reason"].startswith("staging on (config)")
        line = [r.getMessage() for r in caplog.records if "huge pages" in r.getMessage()]
        assert line and "primary 8 MiB" in line[0] and "staging on" in line[0]
    finally:
        store.close()


@pytest.mark.parametrize("name", ENGINES)
def test_wait_completions_blocks_until_a_job_can_be_polled(
    name: str, shm_region: mmap.mmap, tmp_path
) -> None:
    cfg = TierConfig.from_dict(
        {"root_dir": str(tmp_path), "capacity_bytes": 64 << 20, "persist": False}
    )
    store = BlockStore(
        cfg,
        store_name="t",
        identity={"t": 1},
        buffer=memoryview(shm_region),
        row_bytes=ROW,
        engine=name,
    )
    try:
        shm_region[0:ROW] = os.urandom(ROW)
        store.submit_store(1, [b"k"], [0])
        done = []
        deadline = time.monotonic() + 30
        while not done:
            assert time.monotonic() < deadline
            store.wait_completions(1.0)
            done = store.poll()
        assert done[0].job_id == 1 and done[0].success
        t0 = time.monotonic()
        store.wait_completions(0.05)  # nothing in flight: returns by the timeout
        assert time.monotonic() - t0 < 5
    finally:
        store.close()
