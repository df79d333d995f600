"""Several io_uring workers in one engine: routing per drive, checksums, a
failed ring, shutdown with ops in flight, registration sharing and its memlock
fallback. Skipped where the extension or io_uring is unavailable."""

from __future__ import annotations

import errno
import json
import mmap
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import xxhash

pytest.importorskip("nvmetier._uring", reason="native extension nvmetier._uring is not built")

from nvmetier.engine import uring
from nvmetier.engine.base import OP_READ, OP_WRITE, Completion, Op

_OK, _WHY = uring.probe()
if not _OK:
    pytest.skip(f"io_uring is unusable here: {_WHY}", allow_module_level=True)

ROW = 64 * 1024
ROWS = 64
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def region() -> Iterator[mmap.mmap]:
    mm = mmap.mmap(-1, ROWS * ROW)
    for r in range(ROWS):
        mm[r * ROW : (r + 1) * ROW] = os.urandom(64) * (ROW // 64)
    yield mm
    mm.close()


@pytest.fixture
def files(tmp_path) -> Iterator[list[int]]:
    """Four 4 MiB files: the engine's "drives" (one file per drive)."""
    fds = []
    for i in range(4):
        fd = os.open(tmp_path / f"d{i}", os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, ROWS * ROW)
        fds.append(fd)
    yield fds
    for fd in fds:
        os.close(fd)


@pytest.fixture
def engines(region, files) -> Iterator[list[uring.UringEngine]]:
    """Engines closed at teardown, before the region and files they use."""
    made: list[uring.UringEngine] = []
    yield made
    for e in made:
        e.close()


def _engine(made, region, fds, **kw) -> uring.UringEngine:
    e = uring.UringEngine(region, fds, **kw)
    made.append(e)
    return e


def _collect(engine: uring.UringEngine, n: int, timeout_s: float = 30.0) -> dict[int, Completion]:
    got: dict[int, Completion] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < n:
        assert time.monotonic() < deadline, f"only {len(got)} of {n} completions arrived"
        for c in engine.wait_completions(0.5):
            assert c.op_id not in got, f"op {c.op_id} completed twice"
            got[c.op_id] = c
    return got


def _writes(n_files: int, per_file: int, first_id: int = 0) -> list[Op]:
    """``per_file`` row writes to each file, interleaved, with checksums."""
    return [
        Op(first_id + i, OP_WRITE, i % n_files, (i // n_files) * ROW, (i % ROWS) * ROW, ROW, i)
        for i in range(n_files * per_file)
    ]


@pytest.mark.parametrize(
    ("workers", "n_files", "expected_ops"),
    [
        (1, 2, [32]),  # one worker serves both drives
        (2, 2, [16, 16]),  # one per drive
        (4, 2, [8, 8, 8, 8]),  # two per drive, alternating
        (3, 2, [8, 16, 8]),  # drive 0 has workers 0 and 2, drive 1 worker 1
        (2, 4, [16, 16]),  # each worker serves two drives
    ],
)
def test_ops_are_spread_over_workers_by_drive(
    engines, region, files, workers, n_files, expected_ops
) -> None:
    engine = _engine(engines, region, files[:n_files], workers=workers)
    ops = _writes(n_files, 32 // n_files)
    engine.submit(ops)
    done = _collect(engine, len(ops))
    assert all(c.result == ROW for c in done.values())
    assert [w["ops"] for w in engine.worker_stats()] == expected_ops
    assert all(w["bytes"] == w["ops"] * ROW for w in engine.worker_stats())


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_a_job_over_idle_workers_wakes_them_all_through_the_first(
    engines, region, files, workers
) -> None:
    """A submit wakes one idle worker (one eventfd write on the caller's
    thread); that worker wakes the others that got ops. Each round lets every
    worker go idle first: no op may wait for a wake-up that never comes."""
    engine = _engine(engines, region, files, workers=workers)
    for r in range(60):
        time.sleep(0.003)  # every worker idle, blocked in its ring
        ops = [
            Op(r * 100 + i, OP_READ, i % 4, (i // 4) * ROW, i * ROW, ROW, 0)
            for i in range(2 * workers)
        ]
        engine.submit(ops)
        done = _collect(engine, len(ops), timeout_s=5.0)
        assert all(c.result == ROW for c in done.values())
    assert all(w["ops"] > 0 for w in engine.worker_stats())


@pytest.mark.serial  # a busy core beside it delays the submit past worker 0's hashing
def test_an_idle_workers_op_does_not_wait_for_another_workers_hashing(tmp_path) -> None:
    """Worker 0 has reaped a backlog of big checksummed reads and hashes them
    (idle: nothing in flight, so `sleeping`); a job then gives an op to it
    and one to idle worker 1. Worker 1's op must not wait for worker 0 to
    hash its whole backlog (~10 ms here): the submit wakes the worker that
    waits in its ring, or worker 0 relays the wake-up between two hashes.
    With the wake-up left to worker 0's next round, worker 1's op always
    completed after the backlog's."""
    big, n = 4 << 20, 16
    fds = []
    for i in range(2):
        fd = os.open(tmp_path / f"d{i}", os.O_RDWR | os.O_CREAT, 0o600)
        os.pwrite(fd, bytes([0x5A + i]) * (n * big if i == 0 else ROW), 0)
        fds.append(fd)
    mm = mmap.mmap(-1, n * big + 2 * ROW)
    buf = memoryview(mm)
    engine = uring.UringEngine(buf, fds, workers=2, queue_depth=n, max_inflight_bytes=4 * n * big)
    try:
        caught = won = 0
        for trial in range(6):
            time.sleep(0.005)  # both workers idle
            base = engine.worker_stats()[0]["hashed_bytes"]
            engine.submit([Op(i, OP_READ, 0, i * big, i * big, big, i) for i in range(n)])
            deadline = time.monotonic() + 5.0
            while (hashed := engine.worker_stats()[0]["hashed_bytes"]) == base:
                assert time.monotonic() < deadline, "worker 0 never hashed its reads"
            if trial == 0 or hashed >= base + n * big:
                _collect(engine, n, timeout_s=5.0)  # page cache warm-up, or too late
                continue
            caught += 1
            tail = n * big
            engine.submit(
                [Op(n, OP_READ, 0, 0, tail, ROW, 0), Op(n + 1, OP_READ, 1, 0, tail + ROW, ROW, 0)]
            )
            order: list[int] = []
            deadline = time.monotonic() + 5.0
            while len(order) < n + 2:
                assert time.monotonic() < deadline, f"{len(order)} of {n + 2} completions came"
                order += [c.op_id for c in engine.wait_completions(0.5) if c.result > 0]
            won += order.index(n + 1) < max(order.index(i) for i in range(n))
        assert caught >= 3, f"the job landed during worker 0's hashing in only {caught} of 5 tries"
        assert won * 2 >= caught, (
            f"worker 1's op completed after worker 0's hashing backlog in {caught - won} of "
            f"{caught} tries: its wake-up waited for another worker's hashing"
        )
    finally:
        engine.close()
        buf.release()
        mm.close()
        for fd in fds:
            os.close(fd)


def test_submits_from_several_threads_over_idle_workers_all_complete(
    engines, region, files
) -> None:
    """Three threads submit small jobs over eight workers, pausing so that the
    workers go idle between them (each submit wakes one and leaves the
    others' wake-ups to it), while a fourth thread collects: every op
    completes, once, within a bounded time."""
    engine = _engine(engines, region, files, workers=8)
    threads, per_thread, jobs = 3, 8, 40  # 3 * 8 rows of the region
    errors: list[BaseException] = []

    def submitter(t: int) -> None:
        try:
            for j in range(jobs):
                time.sleep(0.0005 * (1 + (j + t) % 4))
                first = (t * jobs + j) * per_thread
                engine.submit(
                    [
                        Op(first + i, OP_READ, i % 4, i // 4 * ROW, (t * 8 + i) * ROW, ROW, 0)
                        for i in range(per_thread)
                    ]
                )
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    workers = [threading.Thread(target=submitter, args=(t,)) for t in range(threads)]
    for th in workers:
        th.start()
    done = _collect(engine, threads * jobs * per_thread, timeout_s=20.0)
    for th in workers:
        th.join(timeout=5.0)
        assert not th.is_alive(), "a submitting thread is stuck"
    assert not errors, errors
    assert all(c.result == ROW for c in done.values())
    assert all(w["ops"] > 0 for w in engine.worker_stats())


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_several_workers_move_the_bytes_with_correct_checksums(
    engines, region, files, workers
) -> None:
    engine = _engine(engines, region, files[:2], workers=workers)
    ops = _writes(2, 32)
    engine.submit(ops)
    done = _collect(engine, len(ops))
    for op in ops:
        payload = region[op.buf_offset : op.buf_offset + ROW]
        expected = xxhash.xxh3_64_intdigest(payload, op.seed)
        assert done[op.op_id] == Completion(op.op_id, ROW, expected)
        assert os.pread(files[op.file_idx], ROW, op.file_offset) == payload
    # Read everything back into a zeroed region: same checksums.
    sums = {op.op_id: done[op.op_id].checksum for op in ops}
    region[:] = bytes(len(region))
    reads = [op._replace(op_id=op.op_id + 1000, kind=OP_READ) for op in ops[:ROWS]]
    engine.submit(reads)
    back = _collect(engine, len(reads))
    for op in reads:
        assert back[op.op_id].result == ROW
        assert back[op.op_id].checksum == sums[op.op_id - 1000]


def test_queue_depth_and_bytes_in_flight_are_per_drive(engines, region, files) -> None:
    cap = 64 << 20
    one = _engine(engines, region, files[:2], workers=1, queue_depth=8, max_inflight_bytes=cap)
    four = _engine(engines, region, files[:2], workers=4, queue_depth=8, max_inflight_bytes=cap)
    assert one.describe()["worker_queue_depth"] == [16]
    assert one.describe()["worker_max_inflight_bytes"] == [64 << 20]
    assert four.describe()["worker_queue_depth"] == [4] * 4
    assert four.describe()["worker_max_inflight_bytes"] == [16 << 20] * 4


def test_one_failed_ring_fails_only_its_ops(engines, region, files) -> None:
    engine = _engine(engines, region, files[:2], workers=2)
    engine.inject_ring_failure(1, errno.EIO)
    ops = _writes(2, 8)
    engine.submit(ops)
    done = _collect(engine, len(ops))
    for op in ops:
        assert done[op.op_id].result == (ROW if op.file_idx == 0 else -errno.EIO), op
    stats = engine.worker_stats()
    assert [w["failed_errno"] for w in stats] == [0, errno.EIO]


def test_a_drive_with_another_worker_routes_around_a_failed_ring(engines, region, files) -> None:
    engine = _engine(engines, region, files[:2], workers=4)
    engine.inject_ring_failure(3, errno.EIO)
    ops = _writes(2, 16)
    engine.submit(ops)
    done = _collect(engine, len(ops))
    assert all(c.result == ROW for c in done.values())
    assert engine.worker_stats()[3]["ops"] == 0


def test_close_with_ops_in_flight_completes_each_op_once(engines, region, files) -> None:
    engine = _engine(engines, region, files, workers=4, queue_depth=2)
    ops = _writes(4, 64)
    engine.submit(ops)
    engine.close()
    done = _collect(engine, len(ops), timeout_s=10)
    results = {c.result for c in done.values()}
    assert results <= {ROW, -errno.ECANCELED}
    assert engine.wait_completions(0.1) == []
    with pytest.raises(Exception, match="closed"):
        engine.submit(ops[:1])


@pytest.mark.parametrize("delay_ms", [1, 3, 6])
def test_a_close_racing_submits_over_idle_workers_completes_each_op_once(
    engines, region, files, delay_ms
) -> None:
    """A thread keeps submitting small jobs over eight mostly idle workers
    (each submit wakes one, which relays the others' wake-ups) while the
    main thread closes the engine: every accepted op completes once, close
    returns, and the submitter sees the engine closed."""
    engine = _engine(engines, region, files, workers=8)
    accepted: list[int] = []
    outcome: list[BaseException] = []

    def submitter() -> None:
        try:
            for j in range(100_000):
                ops = [
                    Op(j * 8 + i, OP_READ, i % 4, i // 4 * ROW, i * ROW, ROW, 0) for i in range(8)
                ]
                engine.submit(ops)
                accepted.extend(op.op_id for op in ops)
                time.sleep(0.0002)
        except BaseException as exc:  # the engine closed (expected) or a failure
            outcome.append(exc)

    th = threading.Thread(target=submitter)
    th.start()
    time.sleep(delay_ms / 1000)
    engine.close()
    th.join(timeout=10.0)
    assert not th.is_alive(), "the submitting thread never saw the engine closed"
    assert len(outcome) == 1 and "closed" in str(outcome[0]), outcome
    done = _collect(engine, len(accepted), timeout_s=10.0)
    assert sorted(done) == sorted(accepted)
    assert {c.result for c in done.values()} <= {ROW, -errno.ECANCELED}


def test_every_worker_clones_one_registration_where_the_kernel_can(engines, region, files) -> None:
    engine = _engine(engines, region, files[:2], workers=3)
    modes = engine.describe()["worker_buffers"]
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    if (major, minor) < (6, 12):
        assert modes == ["registered"] * 3  # registration per ring
        return
    assert modes == ["cloned"] * 3


_MEMLOCK_LAUNCHER = r"""
import ctypes, os, resource, sys
PR_CAPBSET_DROP, CAP_IPC_LOCK = 24, 14
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(PR_CAPBSET_DROP, CAP_IPC_LOCK, 0, 0, 0) != 0:
    print("SKIP cannot drop CAP_IPC_LOCK: " + os.strerror(ctypes.get_errno()))
    sys.exit(0)
resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 * 1024, 64 * 1024))
os.execv(sys.executable, [sys.executable, "-c", sys.argv[1], sys.argv[2]])
"""

_MEMLOCK_CHILD = r"""
import json, logging, mmap, os, sys, time
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
fds = [os.open(sys.argv[1] + str(i), os.O_RDWR | os.O_CREAT, 0o644) for i in range(2)]
engine = uring.UringEngine(mm, fds, workers=3)
mm[:131072] = os.urandom(131072)
got = {}
deadline = time.monotonic() + 20
def wait_for(n):
    while len(got) < n and time.monotonic() < deadline:
        for c in engine.wait_completions(0.5):
            got[c.op_id] = c.result
engine.submit([Op(i, OP_WRITE, i % 2, 0, i * 65536, 65536) for i in range(2)])
wait_for(2)
engine.submit([Op(2 + i, OP_READ, i % 2, 0, (2 + i) * 65536, 65536) for i in range(2)])
wait_for(4)
engine.close()
print(json.dumps({"describe": engine.describe(), "results": [got.get(i) for i in range(4)],
                  "same": mm[:131072] == mm[131072:262144],
                  "warnings": [r.getMessage() for r in records if r.levelno == logging.WARNING]}))
"""


def test_several_workers_fall_back_to_plain_io_under_a_small_memlock_limit(tmp_path) -> None:
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
    assert got["describe"]["worker_buffers"] == ["plain"] * 3
    assert got["results"] == [65536] * 4
    assert got["same"] is True
    assert len(got["warnings"]) == 1
    assert "Cannot allocate memory" in got["warnings"][0]
    assert "3 of 3 worker ring(s)" in got["warnings"][0]


_NOFILE_CHILD = r"""
import errno, mmap, os, resource, sys, threading
from nvmetier.engine import uring
mm = mmap.mmap(-1, 1 << 20)
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
stdin_before = os.fstat(0)
n_open = len(os.listdir("/proc/self/fd"))
# Room for 3 more fds: the workers' eventfds run out at the fourth.
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (n_open + 3, hard))
try:
    uring.UringEngine(mm, [fd], workers=8)
except OSError as exc:
    print("error", errno.errorcode.get(exc.errno))
else:
    print("opened")
same = os.fstat(0)
print("stdin", (same.st_dev, same.st_ino) == (stdin_before.st_dev, stdin_before.st_ino))
print("fds", len(os.listdir("/proc/self/fd")) - n_open + 1, "threads", threading.active_count())
"""


def test_an_open_that_runs_out_of_fds_fails_cleanly(tmp_path) -> None:
    """Workers' setup failing part way (EMFILE) raises OSError and leaves
    nothing behind: no fd of the caller's closed (stdin included), none leaked."""
    r, w = os.pipe()  # a stdin the child can check
    try:
        out = subprocess.run(
            [sys.executable, "-c", _NOFILE_CHILD, str(tmp_path / "d")],
            stdin=r,
            capture_output=True,
            text=True,
            timeout=50,
            check=True,
        )
    finally:
        os.close(r)
        os.close(w)
    lines = out.stdout.split("\n")
    assert lines[0] == "error EMFILE", out.stdout + out.stderr
    assert lines[1] == "stdin True"
    assert lines[2].startswith("fds 1 ")  # only the listdir's own fd


def _close_within(engine: uring.UringEngine, timeout_s: float) -> bool:
    """Close ``engine`` on a helper thread; whether it returned in time."""
    import threading

    t = threading.Thread(target=engine.close, daemon=True)
    t.start()
    t.join(timeout_s)
    return not t.is_alive()


@pytest.mark.parametrize("when", ["before_submit", "with_ops_in_the_ring"])
def test_a_ring_that_keeps_refusing_enter_fails_its_ops_and_close_returns(
    engines, region, files, when
) -> None:
    """Was a suspected hang: ops whose SQEs were prepared but never taken by
    the kernel stayed in their slots for good when io_uring_enter kept
    failing, so the I/O thread never exited and close() joined forever."""
    engine = _engine(engines, region, files[:1], workers=1, queue_depth=8)
    ops = _writes(1, 8)
    if when == "before_submit":
        engine._native._inject_enter_error(0, errno.EIO)
        engine.submit(ops)
    else:
        engine.submit(ops[:4])
        _collect(engine, 4)
        engine._native._inject_enter_error(0, errno.EIO)
        engine.submit(ops[4:])
    # The ring is failed after NVT_RING_FAIL_TRIES refusals: every op fails
    # (none is lost or left in a slot), then close returns.
    done = _collect(engine, 8 if when == "before_submit" else 4, timeout_s=20)
    assert {c.result for c in done.values()} == {-errno.EIO}
    assert engine.worker_stats()[0]["failed_errno"] == errno.EIO
    assert _close_within(engine, 20.0), "close() did not return"
    assert engine.wait_completions(0.1) == []


def test_close_of_a_ring_refusing_enter_with_ops_taken_returns(engines, region, files) -> None:
    """The refusals start with close already under way: still bounded."""
    engine = _engine(engines, region, files[:1], workers=1, queue_depth=4)
    engine._native._inject_enter_error(0, errno.ENOMEM)
    ops = _writes(1, 12)  # 4 in slots, 8 queued behind them
    engine.submit(ops)
    assert _close_within(engine, 20.0), "close() did not return"
    done = _collect(engine, len(ops), timeout_s=5)
    assert {c.result for c in done.values()} <= {-errno.ENOMEM, -errno.ECANCELED}


@pytest.mark.parametrize("err", ["EAGAIN", "EBUSY", "EINTR", "ETIME"])
def test_a_ring_that_keeps_refusing_enter_with_a_transient_error_fails_its_ops_and_close_returns(
    engines, region, files, err
) -> None:
    """Was a hang: an enter error that is normally transient (EAGAIN: the
    kernel has no memory for requests) never failed the ring however long it
    lasted, so the ops in the ring never completed, the I/O thread spun at
    full speed and close() joined forever. Once it comes back with nothing
    completing long enough, the ring fails like one refusing with EIO."""
    engine = _engine(engines, region, files[:1], workers=1, queue_depth=4)
    engine._native._inject_enter_error(0, getattr(errno, err))
    ops = _writes(1, 12)  # 4 in slots, 8 queued behind them
    engine.submit(ops)
    done = _collect(engine, len(ops), timeout_s=20)
    assert {c.result for c in done.values()} == {-getattr(errno, err)}
    assert engine.worker_stats()[0]["failed_errno"] == getattr(errno, err)
    assert _close_within(engine, 20.0), "close() did not return"


def test_a_forked_child_closes_its_copy_of_the_engine_and_its_rings(
    engines, region, files, tmp_path
) -> None:
    """A child forked without exec must not hold the parent's rings (their
    registered files keep the store's lock alive after the parent died) nor
    use engine threads that do not exist there; the parent's engine goes on."""
    lock_fd = os.open(tmp_path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        engine = _engine(engines, region, files[:2], workers=2, keepalive_fd=lock_fd)
        engine.submit(_writes(2, 4))
        _collect(engine, 8)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report one line, never return
            code = 1
            try:
                rings = [
                    fd
                    for fd in os.listdir("/proc/self/fd")
                    if "io_uring" in _link(f"/proc/self/fd/{fd}")
                ]
                try:
                    engine.submit(_writes(2, 1))
                    refused = False
                except Exception:
                    refused = True
                engine.close()  # returns: no thread to join
                os.write(w, json.dumps({"rings": rings, "refused": refused}).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            answer = json.loads(f.read() or b"{}")
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert answer == {"rings": [], "refused": True}
        ops = _writes(2, 8, first_id=100)
        engine.submit(ops)
        assert all(c.result == ROW for c in _collect(engine, len(ops)).values())
    finally:
        for e in engines:
            e.close()
        os.close(lock_fd)


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""
