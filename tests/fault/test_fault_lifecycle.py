"""Open, close and remove of a shared store never race, and operator
commands never disturb the processes using it (issue 15, items 5 and 7).

Real processes (``lifecycle_proc.py``) open and close the store; the test
process plays the operator or the process that arrives at the wrong moment.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence

import pytest

from nvmetier import files, fsck, info
from nvmetier.files import PROBE_PREFIX, probe_o_direct, reclaim_private_stores, store_held
from tests.fault.faultkit import STORE_NAME

pytestmark = pytest.mark.timeout(120)

PROC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lifecycle_proc.py")


class Proc:
    """One ``lifecycle_proc.py`` process: send a command, read its answer."""

    def __init__(self, prefix: Sequence[str] = ()) -> None:
        self.p = subprocess.Popen(
            [*prefix, sys.executable, PROC],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    def send(self, line: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def expect(self, timeout_s: float = 60.0) -> str:
        assert self.p.stdout is not None
        out: list[str] = []
        reader = threading.Thread(target=lambda: out.append(self.p.stdout.readline()))  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout_s)
        assert out, f"no answer within {timeout_s} s"
        return out[0].strip()

    def call(self, line: str, timeout_s: float = 60.0) -> str:
        self.send(line)
        answer = self.expect(timeout_s)
        assert answer.startswith("ok"), f"{line!r}: {answer}"
        return answer

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    made = [Proc() for _ in range(3)]
    yield made
    for p in made:
        p.stop()


def test_a_process_attaching_while_the_last_one_removes_the_store_shares_with_the_next(
    tmp_path, procs
) -> None:
    root = str(tmp_path / "kv")
    closer, late, next_one = procs
    closer.call(f"open {root} 0")  # ephemeral: the last process to close removes it
    assert closer.call("store 0 8") == "ok 8"
    closer.call("slow_remove 1.0")
    closer.send("close")
    assert closer.expect() == "removing"  # it decided it is last; removal under way
    late.send(f"open {root} 0")  # arrives in that moment
    assert closer.expect() == "ok"
    assert late.expect() == "ok"
    # The late process has a store of its own on disk, not unlinked files ...
    assert os.path.exists(os.path.join(root, STORE_NAME, "superblock"))
    assert late.call("store 100 8") == "ok 8"
    # ... which the next process shares (on unlinked files it would not).
    next_one.call(f"open {root} 0")
    assert next_one.call("has 100 8") == "ok 8"
    assert next_one.call("has 0 8") == "ok 0"  # the removed store's chunks are gone
    late.call("close")
    next_one.call("close")
    assert not os.path.exists(os.path.join(root, STORE_NAME))


def _slow_flock(monkeypatch: pytest.MonkeyPatch, hold_s: float) -> None:
    """Every lock this process gets is held ``hold_s`` longer (an operator
    command descheduled in the middle of its probe)."""
    real = fcntl.flock

    def flock(fd: int, how: int) -> None:
        real(fd, how)
        if how != fcntl.LOCK_UN:
            time.sleep(hold_s)

    monkeypatch.setattr(fcntl, "flock", flock)


@pytest.mark.parametrize("persist", [1, 0], ids=["persistent", "ephemeral"])
def test_info_and_fsck_looping_never_fail_an_open_nor_skip_a_close_sweep(
    tmp_path, procs, monkeypatch, persist
) -> None:
    root = str(tmp_path / "kv")
    store_dir = os.path.join(root, STORE_NAME)
    user = procs[0]
    if persist:
        user.call(f"open {root} 1")  # create it, then leave it closed
        user.call("close")
    _slow_flock(monkeypatch, 0.002)
    stop = threading.Event()
    probes = [0]
    errors: list[BaseException] = []

    def operator(kind: str) -> None:
        try:
            while not stop.is_set():
                if kind == "info":
                    info.store_info(store_dir)
                elif kind == "fsck":
                    fsck.check_store(store_dir)
                else:
                    store_held(store_dir)
                probes[0] += 1
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=operator, args=(k,)) for k in ("info", "fsck", "held")]
    for t in threads:
        t.start()
    try:
        # Ephemeral: each last close also removes the store, under the probes.
        answer = user.call(f"loop_open {root} {persist} 60")
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
    assert probes[0] > 60
    _ok, locked, unclean = answer.split()
    assert int(locked) == 0, f"{locked} of 60 opens failed with StoreLockedError"
    if persist:
        assert int(unclean) == 0, f"{unclean} of 60 last closes skipped the sweep"


# ------------------------------------------------------------ crash leaks
def _private_dirs(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if "_private_" in n)


def _wait_released(store: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while store_held(store) and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_killed_process_private_store_is_reclaimed_by_the_next_start(tmp_path, procs) -> None:
    root = str(tmp_path / "kv")
    victim, survivor, _ = procs
    _ok, _pid, name, _n = victim.call(f"open_private {root}").split()
    assert victim.call("store 0 8") == "ok 8"
    victim.p.send_signal(signal.SIGKILL)
    victim.p.wait()
    assert _private_dirs(root) == [name]  # a whole preallocated store, left behind
    # Its io_uring rings keep its lock until their queued I/O drained (the
    # kernel tears them down just after the exit): reclaim comes after that.
    _wait_released(os.path.join(root, name))
    _ok, _pid, mine, reclaimed = survivor.call(f"open_private {root}").split()
    assert (reclaimed, _private_dirs(root)) == ("1", [mine])
    survivor.call("close")
    assert os.listdir(root) == []


def test_a_stopped_process_keeps_its_private_store(tmp_path, procs) -> None:
    root = str(tmp_path / "kv")
    stopped = procs[0]
    _ok, _pid, name, _n = stopped.call(f"open_private {root}").split()
    stopped.p.send_signal(signal.SIGSTOP)
    try:
        assert reclaim_private_stores([root]) == []  # its lock is held: alive
    finally:
        stopped.p.send_signal(signal.SIGCONT)
    assert _private_dirs(root) == [name]
    stopped.call("close")
    assert os.listdir(root) == []


def test_reclaim_leaves_shared_stores_whose_names_look_private(tmp_path) -> None:
    root = tmp_path / "kv"
    names = ["org_my_private_model_0123456789ab", "m_private_1", "m_0123456789ab_private_x"]
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "lock.init").touch()  # a store nobody holds
        (root / name / "lock").touch()
    assert reclaim_private_stores([str(root)]) == []
    assert sorted(os.listdir(root)) == sorted(names)


def _unshare_pid() -> list[str]:
    """``unshare --pid --fork`` (each process is pid 1 of its own namespace),
    or a skip with the reason where it is not permitted."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "true"], capture_output=True, text=True, check=False
    )
    if probe.returncode != 0:
        pytest.skip(f"unshare --pid --fork is not permitted here: {probe.stderr.strip()}")
    return ["unshare", "--pid", "--fork"]


def test_processes_with_the_same_pid_in_two_containers_keep_separate_private_stores(
    tmp_path,
) -> None:
    prefix = _unshare_pid()
    root = str(tmp_path / "kv")
    a, b = Proc(prefix), Proc(prefix)
    try:
        _ok, pid_a, name_a, _n = a.call(f"open_private {root}").split()
        _ok, pid_b, name_b, reclaimed = b.call(f"open_private {root}").split()
        assert pid_a == pid_b  # the same pid, as identical containers have
        assert name_a != name_b
        assert reclaimed == "0"  # b left a's live store alone
        assert a.call("store 0 8") == "ok 8"
        assert b.call("store 0 8") == "ok 8"
        assert _private_dirs(root) == sorted([name_a, name_b])
        a.call("close")
        b.call("close")
        assert os.listdir(root) == []
    finally:
        a.stop()
        b.stop()


def test_a_crash_during_the_o_direct_probe_leaves_no_file(tmp_path) -> None:
    # The probe's process dies (SIGKILL) while its probe file is open.
    code = (
        "import os, signal, sys\n"
        "from nvmetier import files\n"
        "os.pwrite = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n"
        "files.probe_o_direct(sys.argv[1])\n"
    )
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=False)
    assert run.returncode == -signal.SIGKILL
    assert os.listdir(tmp_path) == []


def test_named_probe_files_left_by_a_crash_are_deleted_by_the_next_probe(
    tmp_path, monkeypatch
) -> None:
    # A filesystem without O_TMPFILE gets named probe files.
    monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    stale = tmp_path / f"{PROBE_PREFIX}12345-deadbeef"
    stale.write_bytes(bytes(4096))
    old = time.time() - 3600
    os.utime(stale, (old, old))
    fresh = tmp_path / f"{PROBE_PREFIX}12346-deadbeef"  # a live probe's file
    fresh.write_bytes(bytes(4096))
    assert files.O_DIRECT
    ok, why = probe_o_direct(str(tmp_path))
    assert ok, why
    assert sorted(os.listdir(tmp_path)) == [fresh.name]


def test_a_store_being_repaired_is_reported_held_without_taking_a_lock(tmp_path) -> None:
    root = str(tmp_path / "kv")
    user = Proc()
    try:
        user.call(f"open {root} 1")
        user.call("close")
    finally:
        user.stop()
    store_dir = os.path.join(root, STORE_NAME)
    assert not store_held(store_dir)
    with fsck.store_lock(store_dir, write=True):
        assert store_held(store_dir)  # another open file description sees the OFD lock
    assert not store_held(store_dir)
