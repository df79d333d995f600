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

from .faultkit import ROWS, STORE_NAME, key, new_buffer, open_store, store_keys

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
