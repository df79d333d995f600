"""Behaviour of the native io_uring engine (``nvmetier._uring`` via ``UringEngine``).

One small test per behaviour. The module is skipped when the extension is not
built or io_uring cannot run here (seccomp, ``kernel.io_uring_disabled``): a
missing kernel feature is a skip, never a failure.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest
import xxhash

pytest.importorskip("nvmetier._uring", reason="native extension nvmetier._uring is not built")

from nvmetier.engine import uring
from nvmetier.engine.base import OP_READ, OP_WRITE, Completion, Op
from nvmetier.errors import EngineClosedError

_OK, _WHY = uring.probe()
if not _OK:
    pytest.skip(f"io_uring is unusable here: {_WHY}", allow_module_level=True)

KIB = 1024
MIB = 1024 * KIB
ROW = 64 * KIB

EngineFactory = Callable[..., uring.UringEngine]


def xxh3(data: bytes | memoryview, seed: int) -> int:
    return xxhash.xxh3_64_intdigest(data, seed)


def run_ops(engine: uring.UringEngine, ops: Sequence[Op], timeout_s: float = 30.0) -> dict:
    """Submit ``ops`` and collect exactly one completion per op id."""
    engine.submit(ops)
    return collect(engine, len(ops), timeout_s)


def collect(engine: uring.UringEngine, n: int, timeout_s: float = 30.0) -> dict:
    got: dict[object, Completion] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < n:
        assert time.monotonic() < deadline, f"only {len(got)} of {n} completions arrived"
        for c in engine.wait_completions(0.5):
            assert c.op_id not in got, f"op {c.op_id!r} completed twice"
            got[c.op_id] = c
    return got


def open_direct_or_buffered(path: str, direct: bool) -> int:
    flags = os.O_RDWR | os.O_CREAT
    if direct:
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                pytest.skip(f"O_DIRECT is not supported under {os.path.dirname(path)}")
            raise
    return os.open(path, flags, 0o644)


@pytest.fixture
def region() -> Iterator[mmap.mmap]:
    """A page-aligned 4 MiB buffer (64 rows of 64 KiB)."""
    mm = mmap.mmap(-1, 64 * ROW)
    yield mm
    mm.close()


@pytest.fixture
def data_fd(tmp_path) -> Iterator[int]:
    """A 4 MiB file opened read-write (buffered)."""
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, 64 * ROW)
    yield fd
    os.close(fd)


@pytest.fixture
def make_engine() -> Iterator[EngineFactory]:
    """Build engines that are closed at teardown, whatever the test did."""
    engines: list[uring.UringEngine] = []

    def make(buffer, fds, **kwargs) -> uring.UringEngine:
        engine = uring.UringEngine(buffer, fds, **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def fill_rows(buf: mmap.mmap, rows: range) -> None:
    for r in rows:
        buf[r * ROW : (r + 1) * ROW] = os.urandom(64) * (ROW // 64)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "odirect"])
@pytest.mark.parametrize("fixed_files", [True, False], ids=["fixedfiles", "plainfds"])
@pytest.mark.parametrize("register_buffers", [True, False], ids=["fixedbufs", "plainbufs"])
def test_batch_round_trip_returns_data_and_xxh3_checksums(
    tmp_path, region, make_engine, register_buffers, fixed_files, direct
):
    fd = open_direct_or_buffered(str(tmp_path / "rt"), direct)
    try:
        os.ftruncate(fd, 32 * ROW)
        engine = make_engine(
            region, [fd], queue_depth=8, register_buffers=register_buffers, fixed_files=fixed_files
        )
        fill_rows(region, range(32))
        writes = [Op(r, OP_WRITE, 0, r * ROW, r * ROW, ROW, seed=r * 7919) for r in range(32)]
        done = run_ops(engine, writes)
        for r in range(32):
            assert done[r].result == ROW
            assert done[r].checksum == xxh3(region[r * ROW : (r + 1) * ROW], r * 7919)

        # Read rows back into the other half of the buffer.
        reads = [Op(("r", r), OP_READ, 0, r * ROW, (32 + r) * ROW, ROW, seed=r) for r in range(32)]
        done = run_ops(engine, reads)
        for r in range(32):
            data = region[(32 + r) * ROW : (33 + r) * ROW]
            assert data == region[r * ROW : (r + 1) * ROW]
            assert done[("r", r)] == Completion(("r", r), ROW, xxh3(data, r))
    finally:
        os.close(fd)


@pytest.mark.timeout(60)
def test_describe_reports_registration_and_queue_depth(region, data_fd, make_engine):
    engine = make_engine(region, [data_fd], queue_depth=16)
    facts = engine.describe()
    assert facts["engine"] == "uring"
    assert facts["queue_depth"] == 16
    assert isinstance(facts["registered_buffers"], bool)
    assert facts["fixed_files"] is True


@pytest.mark.timeout(60)
def test_register_buffers_false_forces_plain_io(region, data_fd, make_engine):
    engine = make_engine(region, [data_fd], register_buffers=False)
    assert engine.describe()["registered_buffers"] is False
    fill_rows(region, range(1))
    assert run_ops(engine, [Op(1, OP_WRITE, 0, 0, 0, ROW)])[1].result == ROW
    assert run_ops(engine, [Op(2, OP_READ, 0, 0, ROW, ROW)])[2].result == ROW
    assert region[ROW : 2 * ROW] == region[0:ROW]


@pytest.mark.timeout(60)
def test_read_past_eof_is_a_short_read_reported_as_eio(region, data_fd, make_engine):
    engine = make_engine(region, [data_fd])
    size = os.fstat(data_fd).st_size
    done = run_ops(
        engine, [Op(1, OP_READ, 0, size - 4 * KIB, 0, ROW), Op(2, OP_READ, 0, size, 0, ROW)]
    )
    assert done[1] == Completion(1, -errno.EIO, 0)
    assert done[2] == Completion(2, -errno.EIO, 0)


@pytest.mark.timeout(60)
def test_write_to_full_device_fails_with_enospc(region, make_engine):
    fd = os.open("/dev/full", os.O_WRONLY)
    try:
        engine = make_engine(region, [fd])
        assert run_ops(engine, [Op(1, OP_WRITE, 0, 0, 0, ROW)])[1] == Completion(
            1, -errno.ENOSPC, 0
        )
    finally:
        os.close(fd)


@pytest.mark.timeout(60)
def test_write_to_read_only_fd_fails_with_ebadf(tmp_path, region, make_engine):
    (tmp_path / "ro").write_bytes(b"x" * ROW)
    fd = os.open(tmp_path / "ro", os.O_RDONLY)
    try:
        engine = make_engine(region, [fd])
        assert run_ops(engine, [Op(1, OP_WRITE, 0, 0, 0, ROW)])[1] == Completion(1, -errno.EBADF, 0)
    finally:
        os.close(fd)


@pytest.mark.timeout(60)
def test_read_from_directory_fails_with_eisdir(tmp_path, region, make_engine):
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        engine = make_engine(region, [fd])
        assert run_ops(engine, [Op(1, OP_READ, 0, 0, 0, ROW)])[1] == Completion(1, -errno.EISDIR, 0)
    finally:
        os.close(fd)


_FSIZE_CHILD = r"""
import json, mmap, os, resource, signal, sys
from nvmetier.engine import uring
from nvmetier.engine.base import OP_WRITE, Op
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100 * 1024, 100 * 1024))
mm = mmap.mmap(-1, 1 << 20)
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
engine = uring.UringEngine(mm, [fd])
engine.submit([Op(1, OP_WRITE, 0, 0, 0, 65536), Op(2, OP_WRITE, 0, 65536, 0, 65536),
               Op(3, OP_WRITE, 0, 1 << 20, 0, 65536)])
got = {}
while len(got) < 3:
    got.update((c.op_id, c.result) for c in engine.wait_completions(1.0))
engine.close()
print(json.dumps(got))
"""


@pytest.mark.timeout(60)
def test_write_past_rlimit_fsize_fails_whole_or_short(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", _FSIZE_CHILD, str(tmp_path / "f")],
        capture_output=True,
        text=True,
        timeout=50,
        check=True,
    )
    got = json.loads(out.stdout)
    assert got["1"] == 65536  # below the limit
    assert got["2"] == -errno.EIO  # crosses it: 36 KiB written, then EFBIG -> short
    assert got["3"] == -errno.EFBIG  # wholly beyond it


@pytest.mark.timeout(60)
def test_bad_file_idx_fails_with_ebadf_without_io(region, data_fd, make_engine):
    engine = make_engine(region, [data_fd])
    done = run_ops(engine, [Op(1, OP_READ, 1, 0, 0, ROW), Op(2, OP_WRITE, -1, 0, 0, ROW)])
    assert done[1] == Completion(1, -errno.EBADF, 0)
    assert done[2] == Completion(2, -errno.EBADF, 0)


@pytest.mark.timeout(60)
def test_range_outside_buffer_fails_with_efault_without_io(region, data_fd, make_engine):
    engine = make_engine(region, [data_fd])
    region[0:ROW] = b"\xaa" * ROW
    os.pwrite(data_fd, b"\x55" * ROW, 0)
    end = len(region)
    done = run_ops(
        engine,
        [
            Op(1, OP_READ, 0, 0, end - ROW + 1, ROW),
            Op(2, OP_READ, 0, 0, end, 1),
            Op(3, OP_READ, 0, 0, -1, 4),
        ],
    )
    assert {c.result for c in done.values()} == {-errno.EFAULT}
    assert region[end - ROW :] != b"\x55" * ROW


@pytest.mark.timeout(60)
def test_zero_length_op_completes_with_checksum_of_nothing(region, data_fd, make_engine):
    engine = make_engine(region, [data_fd])
    assert run_ops(engine, [Op(1, OP_READ, 0, 0, 0, 0, seed=9)])[1] == Completion(
        1, 0, xxh3(b"", 9)
    )


@pytest.mark.timeout(60)
def test_ops_without_checksum_move_the_data_and_report_checksum_zero(region, data_fd, make_engine):
    engine = make_engine(region, [data_fd])
    fill_rows(region, range(1))
    done = run_ops(engine, [Op(1, OP_WRITE, 0, 0, 0, ROW, 5, False)])
    assert done[1] == Completion(1, ROW, 0)
    done = run_ops(
        engine,
        [Op(2, OP_READ, 0, 0, ROW, ROW, 5, False), (3, OP_READ, 0, 0, 2 * ROW, ROW, 5, True)],
    )
    assert done[2] == Completion(2, ROW, 0)
    assert region[ROW : 2 * ROW] == region[0:ROW]
    assert done[3] == Completion(3, ROW, xxh3(region[0:ROW], 5))


@pytest.mark.timeout(60)
def test_op_tuples_of_the_wrong_size_are_refused_whole(region, data_fd, make_engine):
    engine = make_engine(region, [data_fd])
    with pytest.raises(TypeError, match="7 or 8 fields"):
        engine.submit([Op(1, OP_WRITE, 0, 0, 0, ROW), (2, OP_WRITE, 0, 0, 0)])
    assert engine.wait_completions(0.2) == []  # the valid op was not queued either


@pytest.mark.timeout(60)
def test_ops_crossing_a_registered_chunk_boundary_are_split(tmp_path, region, make_engine):
    fd = open_direct_or_buffered(str(tmp_path / "x"), direct=True)
    try:
        os.ftruncate(fd, 8 * ROW)
        engine = make_engine(region, [fd], register_chunk_bytes=ROW)
        assert engine.describe()["registered_buffers"] is True
        fill_rows(region, range(4))
        # 3 rows starting mid-row: crosses three 64 KiB registered pieces.
        span = 3 * ROW
        assert run_ops(engine, [Op(1, OP_WRITE, 0, 0, ROW // 2, span, 5)])[1] == Completion(
            1, span, xxh3(region[ROW // 2 : ROW // 2 + span], 5)
        )
        done = run_ops(engine, [Op(2, OP_READ, 0, 0, 32 * ROW + ROW // 2, span, 5)])
        assert done[2].result == span
        assert (
            region[32 * ROW + ROW // 2 : 32 * ROW + ROW // 2 + span]
            == region[ROW // 2 : ROW // 2 + span]
        )
    finally:
        os.close(fd)


@pytest.mark.timeout(60)
def test_op_larger_than_inflight_byte_cap_still_runs(region, data_fd, make_engine):
    engine = make_engine(region, [data_fd], queue_depth=4, max_inflight_bytes=4 * KIB)
    fill_rows(region, range(16))
    ops = [Op(i, OP_WRITE, 0, i * 4 * ROW, i * 4 * ROW, 4 * ROW) for i in range(8)]
    done = run_ops(engine, ops)
    assert all(c.result == 4 * ROW for c in done.values())


@pytest.mark.timeout(60)
def test_many_more_ops_than_queue_depth_all_complete(region, data_fd, make_engine):
    engine = make_engine(region, [data_fd], queue_depth=2)
    ops = [
        Op(i, OP_WRITE if i % 2 else OP_READ, 0, (i % 64) * ROW, (i % 64) * ROW, 4 * KIB)
        for i in range(3000)
    ]
    done = run_ops(engine, ops)
    assert all(c.result == 4 * KIB for c in done.values())


@pytest.mark.timeout(60)
def test_close_with_ops_in_ring_and_queued_completes_each_op_once(tmp_path, region, make_engine):
    fd = open_direct_or_buffered(str(tmp_path / "c"), direct=True)
    try:
        engine = make_engine(region, [fd], queue_depth=4, max_inflight_bytes=256 * KIB)
        n = 2000
        engine.submit([Op(i, OP_WRITE, 0, (i % 256) * ROW, (i % 64) * ROW, ROW) for i in range(n)])
        engine.close()
        done = collect(engine, n, timeout_s=10)
        assert set(done) == set(range(n))
        assert {c.result for c in done.values()} <= {ROW, -errno.ECANCELED}
        assert sum(c.result == -errno.ECANCELED for c in done.values()) > 0
        assert engine.wait_completions(5.0) == []  # closed and drained: returns at once
    finally:
        os.close(fd)


@pytest.mark.timeout(60)
def test_submit_after_close_raises_engine_closed(region, data_fd, make_engine):
    engine = make_engine(region, [data_fd])
    engine.close()
    engine.close()  # idempotent
    with pytest.raises(EngineClosedError):
        engine.submit([Op(1, OP_READ, 0, 0, 0, ROW)])
    assert engine.wait_completions(0) == []


@pytest.mark.timeout(60)
def test_buffer_is_held_until_close(data_fd):
    mm = mmap.mmap(-1, 4 * ROW)
    engine = uring.UringEngine(mm, [data_fd])
    with pytest.raises(BufferError):
        mm.close()  # the engine still exports it
    engine.close()
    mm.close()


@pytest.mark.timeout(60)
def test_read_only_buffer_is_refused(data_fd):
    with pytest.raises((BufferError, TypeError)):
        uring.UringEngine(b"\0" * ROW, [data_fd])


@pytest.mark.timeout(60)
def test_wait_completions_releases_the_gil(region, data_fd, make_engine):
    engine = make_engine(region, [data_fd])
    ticks = 0
    stop = threading.Event()

    def spin() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    t = threading.Thread(target=spin)
    t.start()
    try:
        time.sleep(0.05)
        before = ticks
        assert engine.wait_completions(0.5) == []
        during = ticks - before
    finally:
        stop.set()
        t.join()
    # With the GIL held for the whole wait the spinner would barely move
    # (only at the 100 ms signal-check slices).
    assert during > 10_000


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


_PF_IO_WORKER = 0x10  # include/linux/sched.h


def _task_counts() -> tuple[int, int]:
    """(our threads, io_uring kernel workers) of this process.

    io_uring's io-wq workers are tasks of this process that the kernel starts
    on demand and retires a little after their ring closes, so they are
    counted apart (by the PF_IO_WORKER flag: a new one briefly has our name).
    """
    ours = workers = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
            continue
        flags = int(stat[stat.rindex(")") + 2 :].split()[6])
        if flags & _PF_IO_WORKER:
            workers += 1
        else:
            ours += 1
    return ours, workers


def _settled_task_counts(ours: int, workers: int, timeout_s: float = 10.0) -> tuple[int, int]:
    """Task counts once at most ``ours``/``workers`` remain, or at the timeout.

    A joined thread (Python's or ours) is still listed for a moment while the
    kernel finishes its exit, so every count is allowed to settle.
    """
    deadline = time.monotonic() + timeout_s
    counts = _task_counts()
    while (counts[0] > ours or counts[1] > workers) and time.monotonic() < deadline:
        time.sleep(0.02)
        counts = _task_counts()
    return counts


@pytest.mark.timeout(120)
def test_open_close_cycles_leak_no_fds_or_threads(region, data_fd):
    pythreads0 = threading.active_count()
    # Let earlier tests' threads and io-wq workers finish exiting.
    baseline = _settled_task_counts(pythreads0, 0, timeout_s=5)
    fds0 = _fd_count()
    for i in range(100):
        engine = uring.UringEngine(region, [data_fd], queue_depth=4)
        run_ops(engine, [Op(i, OP_WRITE, 0, 0, 0, 4 * KIB)])
        if i % 2:
            engine.submit([Op(-i, OP_READ, 0, 0, 0, 4 * KIB)])  # left for close to finish
        engine.close()
    assert _fd_count() == fds0
    assert threading.active_count() == pythreads0
    ours, workers = _settled_task_counts(*baseline)
    assert ours <= baseline[0]
    assert workers <= baseline[1]


_MEMLOCK_LAUNCHER = r"""
import ctypes, os, resource, sys
PR_CAPBSET_DROP, CAP_IPC_LOCK = 24, 14
libc = ctypes.CDLL(None, use_errno=True)
# Root bypasses RLIMIT_MEMLOCK through CAP_IPC_LOCK: drop it from the bounding
# set so the exec'd child runs without it.
if libc.prctl(PR_CAPBSET_DROP, CAP_IPC_LOCK, 0, 0, 0) != 0:
    print("SKIP cannot drop CAP_IPC_LOCK: " + os.strerror(ctypes.get_errno()))
    sys.exit(0)
resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 * 1024, 64 * 1024))
os.execv(sys.executable, [sys.executable, "-c", sys.argv[1], sys.argv[2]])
"""

_MEMLOCK_CHILD = r"""
import json, logging, mmap, os, sys
from nvmetier.engine import uring
from nvmetier.engine.base import OP_READ, OP_WRITE, Op
with open("/proc/self/status") as f:
    cap_eff = int(next(l for l in f if l.startswith("CapEff:")).split()[1], 16)
if cap_eff & (1 << 14):
    print("SKIP still has CAP_IPC_LOCK")
    sys.exit(0)
records = []
handler = logging.Handler()
handler.emit = records.append
logging.getLogger("nvmetier").addHandler(handler)
mm = mmap.mmap(-1, 64 << 20)
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
engine = uring.UringEngine(mm, [fd])
mm[:65536] = os.urandom(65536)
engine.submit([Op(1, OP_WRITE, 0, 0, 0, 65536)])
results = [c.result for c in engine.wait_completions(10.0)]
engine.submit([Op(2, OP_READ, 0, 0, 65536, 65536)])
results += [c.result for c in engine.wait_completions(10.0)]
engine.close()
print(json.dumps({"describe": engine.describe(), "results": results,
                  "same": mm[:65536] == mm[65536:131072],
                  "warnings": [r.getMessage() for r in records if r.levelno == logging.WARNING]}))
"""


@pytest.mark.timeout(60)
def test_registration_failure_from_memlock_falls_back_to_plain_io(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", _MEMLOCK_LAUNCHER, _MEMLOCK_CHILD, str(tmp_path / "m")],
        capture_output=True,
        text=True,
        timeout=50,
        check=True,
    )
    if out.stdout.startswith("SKIP"):
        pytest.skip(out.stdout.strip())
    got = json.loads(out.stdout)
    if got["describe"]["registered_buffers"]:
        pytest.skip("the kernel registered 64 MiB under a 64 KiB RLIMIT_MEMLOCK")
    assert got["results"] == [65536, 65536]
    assert got["same"] is True
    assert len(got["warnings"]) == 1
    assert "Cannot allocate memory" in got["warnings"][0]


def _ofd_locked(path: str) -> bool:
    import fcntl
    import struct

    flock = struct.Struct("hhqqi4x")
    fd = os.open(path, os.O_RDWR)
    try:
        got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, flock.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0))
        return bool(flock.unpack(got)[0] != fcntl.F_UNLCK)
    finally:
        os.close(fd)


@pytest.mark.parametrize("workers", [1, 2])
def test_the_lock_fd_outlives_its_close_until_the_rings_are_gone(tmp_path, workers: int) -> None:
    """The store's lock fd is registered in every ring (issue 15 item 9): when
    the process dies, the kernel closes its fds, but the rings keep the lock's
    open file, so its OFD lock (this process is alive) holds until the rings
    are torn down, after their queued writes. Here: our own fd closed, the
    lock still held while the engine lives, gone once it is closed."""
    import fcntl
    import struct

    data = os.open(tmp_path / "data", os.O_CREAT | os.O_RDWR)
    os.ftruncate(data, MIB)
    lock_path = str(tmp_path / "lock")
    lock = os.open(lock_path, os.O_CREAT | os.O_RDWR)
    flock = struct.Struct("hhqqi4x")
    fcntl.fcntl(lock, fcntl.F_OFD_SETLK, flock.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0))
    buf = memoryview(mmap.mmap(-1, MIB))
    eng = uring.UringEngine(buf, [data], keepalive_fd=lock, workers=workers)
    try:
        assert eng.describe()["lock_registered"] is True
        os.close(lock)  # what the kernel does first when the process dies
        assert _ofd_locked(lock_path), "the rings must keep the lock while they live"
    finally:
        eng.close()
        os.close(data)
    # The kernel tears a ring down asynchronously once its fd is closed (on a
    # workqueue: a loaded 2-core machine took over 10 s once).
    deadline = time.monotonic() + 30.0
    while _ofd_locked(lock_path) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _ofd_locked(lock_path), "the lock must go with the rings"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checksum", [True, False], ids=["hashed", "unhashed"])
@pytest.mark.parametrize("workers", [1, 2])
def test_staged_round_trip_lands_in_the_buffer_with_xxh3(
    tmp_path, region, make_engine, checksum, workers
):
    # Two drives so that two workers both get ops; an arena of 2 MiB per
    # worker holds 32 rows, fewer than the 32 + 32 ops of a worker's queue.
    fds = [os.open(tmp_path / f"d{i}", os.O_RDWR | os.O_CREAT, 0o644) for i in range(2)]
    try:
        for fd in fds:
            os.ftruncate(fd, 32 * ROW)
        engine = make_engine(
            region,
            fds,
            queue_depth=32,
            workers=workers,
            staging_bytes=2 * MIB,
            max_inflight_bytes=64 * MIB,
        )
        assert all(w["staging_bytes"] == 2 * MIB for w in engine._workers_info)
        fill_rows(region, range(32))
        writes = [
            Op(r, OP_WRITE, r % 2, (r // 2) * ROW, r * ROW, ROW, r, checksum) for r in range(32)
        ]
        done = run_ops(engine, writes)
        for r in range(32):
            want = xxh3(region[r * ROW : (r + 1) * ROW], r) if checksum else 0
            assert done[r] == Completion(r, ROW, want)
        region[32 * ROW :] = b"\0" * (32 * ROW)
        reads = [
            Op(("r", r), OP_READ, r % 2, (r // 2) * ROW, (32 + r) * ROW, ROW, r, checksum)
            for r in range(32)
        ]
        done = run_ops(engine, reads)
        for r in range(32):
            data = region[(32 + r) * ROW : (33 + r) * ROW]
            assert data == region[r * ROW : (r + 1) * ROW]
            assert done[("r", r)] == Completion(("r", r), ROW, xxh3(data, r) if checksum else 0)
        assert sum(s["staged_bytes"] for s in engine._native.worker_stats()) > 0
    finally:
        for fd in fds:
            os.close(fd)


def test_an_op_larger_than_the_staging_arena_moves_directly(tmp_path, region, data_fd, make_engine):
    engine = make_engine(region, [data_fd], staging_bytes=2 * MIB, max_inflight_bytes=2 * MIB)
    fill_rows(region, range(48))
    done = run_ops(engine, [Op(1, OP_WRITE, 0, 0, 0, 48 * ROW, 3)])  # 3 MiB > 2 MiB arena
    assert done[1] == Completion(1, 48 * ROW, xxh3(region[0 : 48 * ROW], 3))
    assert engine._native.worker_stats()[0]["staged_bytes"] == 0
    assert os.pread(data_fd, 48 * ROW, 0) == region[0 : 48 * ROW]


def test_negative_staging_bytes_is_refused(region, data_fd):
    from nvmetier import _uring

    with pytest.raises(ValueError, match="staging_bytes"):
        _uring.Engine(region, [data_fd], staging_bytes=-1)
