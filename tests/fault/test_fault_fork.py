"""A child forked without exec must not keep its parent's sharer alive.

The store's lock fd carries the parent's shared flock and its OFD registry
lock; a forked fd shares that open file description. Was a bug: the fds were
only close-on-exec, so a plain ``fork()`` child (a worker pool, a daemon
helper) held both for its whole life. Once the parent died its WRITING slots
were never reclaimed, every store of those keys waited the watch timeout and
failed, ``sharers()`` counted a dead process, and no later opener was first.

Each test runs a victim process that opens the store (under the engine the
suite runs with), claims WRITING slots for some keys (their writes never
complete), forks a child that only sleeps, and is then SIGKILLed. The child
outlives it for the whole test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from nvmetier import files

from .faultkit import (
    ROW,
    ROWS,
    STORE_NAME,
    key,
    load_keys,
    new_buffer,
    open_store,
    payload,
    store_keys,
    wait_jobs,
)

HERE = os.path.dirname(os.path.abspath(__file__))
VICTIM_KEYS = 4
# A killed process's io_uring rings are torn down by the kernel a little
# after it dies (they hold the lock until then): how long to wait for that.
GONE_S = 20.0

VICTIM = r"""
import os, sys, time
sys.path.insert(0, sys.argv[2])
from faultkit import ROWS, key, new_buffer, open_store
buf = new_buffer(ROWS)
store = open_store(sys.argv[1], buf)
keys = [key(i, trial=7) for i in range(int(sys.argv[3]))]
ops, failed, _evicted, _pending = store._table.store_ops(1, keys, list(range(len(keys))), 64, False)
assert failed is None or not failed, failed
child = os.fork()
if child == 0:
    time.sleep(600)
    os._exit(0)
print(child, flush=True)
time.sleep(600)
"""


def _victim_keys() -> list[bytes]:
    return [key(i, trial=7) for i in range(VICTIM_KEYS)]


@pytest.fixture
def victim(tmp_path) -> Iterator[tuple[str, subprocess.Popen[str], int]]:
    """Start the victim under ``tmp_path/kv``: (root, its process, its child's pid)."""
    root = str(tmp_path / "kv")
    proc = subprocess.Popen(
        [sys.executable, "-c", VICTIM, root, HERE, str(VICTIM_KEYS)],
        stdout=subprocess.PIPE,
        text=True,
    )
    child = 0
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, "the victim failed before it forked"
        child = int(line)
        yield root, proc, child
    finally:
        proc.kill()
        proc.wait()
        if child:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _kill(proc: subprocess.Popen[str], child: int) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    os.kill(child, 0)  # the forked child is still there (it would raise if not)


def _wait_sharers(store_dir: str, n: int) -> list[tuple[int, int]]:
    deadline = time.monotonic() + GONE_S
    while True:
        live = files.sharers(store_dir)
        if len(live) <= n or time.monotonic() > deadline:
            return live
        time.sleep(0.05)


def test_a_forked_child_does_not_keep_a_dead_sharer_attached(victim) -> None:
    root, proc, child = victim
    store_dir = os.path.join(root, STORE_NAME)
    assert len(files.sharers(store_dir)) == 1
    _kill(proc, child)
    assert _wait_sharers(store_dir, 0) == []
    # The next opener is alone (the first): it rebuilds the table, and the
    # dead writer's keys can be stored at once.
    buf = new_buffer(ROWS)
    store = open_store(root, buf)
    try:
        assert store.files.alone
        assert store.sharers() == 1
        outcome = store_keys(store, buf, _victim_keys(), job_id=5)
        assert outcome.success
        assert all(store.contains(k) for k in _victim_keys())
    finally:
        store.close()


def test_a_survivor_reclaims_the_writing_slots_of_a_dead_sharer_with_a_forked_child(
    tmp_path,
) -> None:
    root = str(tmp_path / "kv")
    buf = new_buffer(ROWS)
    survivor = open_store(root, buf)
    proc = None
    child = 0
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", VICTIM, root, HERE, str(VICTIM_KEYS)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        assert survivor.sharers() == 2
        _kill(proc, child)
        deadline = time.monotonic() + GONE_S
        while survivor.sharers() > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert survivor.sharers() == 1
        # The victim's WRITING slots belong to a dead sharer now: a store of
        # the same keys finds their writer dead and reclaims them (those keys
        # fail, not stored by that job: their write never landed), and the
        # next store of them succeeds. While the writer looks alive, both
        # stores wait for its writes until the watch bound and fail.
        first = store_keys(survivor, buf, _victim_keys(), job_id=5)
        assert not first.success
        stats = survivor.stats()
        assert stats["dead_slots_reclaimed"] == VICTIM_KEYS
        assert stats["stores_dropped_watch_timeout"] == 0
        again = store_keys(survivor, buf, _victim_keys(), job_id=6)
        assert again.success, again
        assert all(survivor.contains(k) for k in _victim_keys())
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        if child:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        survivor.close()


def test_a_forked_child_closes_its_copies_of_the_store_fds_and_leaves_the_parent_attached(
    tmp_path,
) -> None:
    """In the child: every store fd is closed, the store closes as a no-op
    (no detach, unlock or clean mark: those would release the parent's
    locks); the parent stays attached and keeps working."""
    root = str(tmp_path / "kv")
    buf = new_buffer(ROWS)
    store = open_store(root, buf)
    try:
        store_dir = store.files.dirs[0]
        fds = [store.files.registry_fd, *store.files.data_fds]
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, close the store, never return
            code = 1
            try:
                still = [fd for fd in fds if _is_store_fd(fd, store_dir)]
                store.close()
                code = 0 if not still else 2
            finally:
                os.write(w, b"%d" % code)
                os._exit(code)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            answer = f.read()
        _, status = os.waitpid(pid, 0)
        assert answer == b"0", "the child kept store fds open"
        assert os.waitstatus_to_exitcode(status) == 0
        assert store.sharers() == 1
        assert [p for p, _at in files.sharers(store_dir)] == [os.getpid()]
        assert store_keys(store, buf, _victim_keys(), job_id=9).success
    finally:
        store.close()


def _is_store_fd(fd: int, store_dir: str) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith(store_dir)
    except OSError:
        return False


# ------------------------------------------------------------ forks at odd times
def _child(body) -> int:  # type: ignore[no-untyped-def]
    """Fork; the child runs ``body()`` (an int: its exit code) and never
    returns. Returns the child's exit code."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            code = body()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_fork_with_jobs_in_flight_leaves_the_parents_jobs_whole(tmp_path) -> None:
    root = str(tmp_path / "kv")
    buf = new_buffer(ROWS)
    store = open_store(root, buf)
    try:
        keys = [key(i, trial=8) for i in range(32)]
        for r, k in enumerate(keys):
            buf[r * ROW : (r + 1) * ROW] = payload(k)
        store.submit_store(1, keys, list(range(len(keys))))

        def child() -> int:
            try:
                store.submit_store(2, keys[:1], [0])
            except RuntimeError:
                pass  # the table refuses: it is the parent's
            else:
                return 1
            store.close()  # a no-op for the parent's store
            return 0

        assert _child(child) == 0
        (outcome,) = wait_jobs(store)
        assert outcome.success
        loaded, ok, wrong = load_keys(store, buf, keys, job_id=3)
        assert loaded.success and len(ok) == len(keys) and wrong == []
        assert [p for p, _at in files.sharers(store.files.dirs[0])] == [os.getpid()]
    finally:
        store.close()


def test_a_forked_child_opens_the_store_as_its_own_sharer(tmp_path) -> None:
    root = str(tmp_path / "kv")
    buf = new_buffer(ROWS)
    store = open_store(root, buf)
    k = key(1, trial=9)
    try:

        def child() -> int:
            own_buf = new_buffer(ROWS)
            own = open_store(root, own_buf)
            try:
                if own.sharers() != 2:
                    return 2
                return 0 if store_keys(own, own_buf, [k], job_id=1).success else 3
            finally:
                own.close()

        assert _child(child) == 0
        assert store.contains(k)
        assert store.sharers() == 1
    finally:
        store.close()


EXITING_CHILD = r"""
import os, sys, time
sys.path.insert(0, sys.argv[2])
from faultkit import ROWS, key, new_buffer, open_store, store_keys
buf = new_buffer(ROWS)
store = open_store(sys.argv[1], buf)
assert store_keys(store, buf, [key(0, trial=10)], job_id=1).success
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a normal exit: the inherited store is finalized in the child
os.waitpid(pid, 0)
assert store_keys(store, buf, [key(1, trial=10)], job_id=2).success
print("ready", flush=True)
sys.stdin.readline()
store.close()
"""


def test_a_forked_child_that_exits_normally_leaves_the_parent_attached(tmp_path) -> None:
    """The child's interpreter finalizes the inherited store, engine and
    table: none of it may unlock or detach the parent."""
    root = str(tmp_path / "kv")
    proc = subprocess.Popen(
        [sys.executable, "-c", EXITING_CHILD, root, HERE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "ready"
        store_dir = os.path.join(root, STORE_NAME)
        assert [p for p, _at in files.sharers(store_dir)] == [proc.pid]
        buf = new_buffer(ROWS)
        other = open_store(root, buf)
        try:
            assert not other.files.alone  # the parent's shared flock is still held
            assert other.contains(key(0, trial=10)) and other.contains(key(1, trial=10))
        finally:
            other.close()
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()


def _holds(paths: set[str]) -> list[str]:
    held = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target in paths or "io_uring" in target:
            held.append(target)
    return held


def test_forks_while_another_thread_opens_and_closes_stores_leave_no_lock_in_the_child(
    tmp_path,
) -> None:
    """A fork can land mid-open or mid-close (a lock.init wait, rings being
    set up): the child holds neither lock file nor ring."""
    import threading

    root = str(tmp_path / "kv")
    store_dir = os.path.realpath(os.path.join(root, STORE_NAME))
    locks = {os.path.join(store_dir, n) for n in (files.LOCK_NAME, files.INIT_LOCK_NAME)}
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        buf = new_buffer(ROWS)
        try:
            while not stop.is_set():
                open_store(root, buf).close()
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    t = threading.Thread(target=churn)
    t.start()
    try:
        bad = []
        for _ in range(100):
            code = _child(lambda: 1 if _holds(locks) else 0)
            if code:
                bad.append(code)
            time.sleep(0.005)
    finally:
        stop.set()
        t.join(60)
    assert not errors
    assert bad == []
    assert files.sharers(store_dir) == []


def test_a_fork_just_after_the_store_closes_an_fd_leaves_that_fd_number_alone_in_the_child(
    tmp_path, monkeypatch
) -> None:
    """Was a bug: the store closed each fd first and forgot its number after,
    so a fork in between (another thread forking, the number already reused
    by a third thread's open) made the child's fork hook close that number:
    a file the child had every right to keep (a pipe, a socket). Here each
    store fd, the moment it is closed (at open: lock.init; at close: index,
    table, data, lock), has its number taken by another file and a child is
    forked: the child must find that file still open."""
    import errno

    root = str(tmp_path / "kv")
    buf = new_buffer(ROWS)
    real_close = os.close
    probe = os.open(os.devnull, os.O_RDONLY)
    probe_ino = os.fstat(probe).st_ino
    checked: list[tuple[str, int]] = []
    store_paths = set()

    me = os.getpid()

    def forking_close(fd: int) -> None:
        if os.getpid() != me:  # the child's fork hook: a plain close (a fork
            real_close(fd)  # from a fork hook would deadlock on others' locks)
            return
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        real_close(fd)
        if not any(target.startswith(p) for p in store_paths):
            return
        os.dup2(probe, fd)  # another thread's open got the number
        try:
            pid = os.fork()
            if pid == 0:
                try:
                    code = 0 if os.fstat(fd).st_ino == probe_ino else 1
                except OSError as exc:
                    code = 2 if exc.errno == errno.EBADF else 3
                os._exit(code)
            _, status = os.waitpid(pid, 0)
            checked.append((os.path.basename(target), os.waitstatus_to_exitcode(status)))
        finally:
            real_close(fd)

    store_paths.add(os.path.realpath(os.path.join(root, STORE_NAME)))
    os.makedirs(root)
    monkeypatch.setattr(os, "close", forking_close)
    try:
        store = open_store(root, buf)
        store.close()
    finally:
        monkeypatch.undo()
        real_close(probe)
    names = {name for name, _code in checked}
    assert {"lock.init", "index", "table", "data", "lock"} <= names, checked
    assert [c for c in checked if c[1] != 0] == []
