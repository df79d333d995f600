"""Open, close and remove of a shared store never race, and operator
commands never disturb the processes using it (issue 15, items 5 and 7).

Real processes (``lifecycle_proc.py``) open and close the store; the test
process plays the operator or the process that arrives at the wrong moment.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from nvmetier import fsck, info
from nvmetier.files import store_held
from tests.fault.faultkit import STORE_NAME

pytestmark = pytest.mark.timeout(120)

PROC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lifecycle_proc.py")


class Proc:
    """One ``lifecycle_proc.py`` process: send a command, read its answer."""

    def __init__(self) -> None:
        self.p = subprocess.Popen(
            [sys.executable, PROC],
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
