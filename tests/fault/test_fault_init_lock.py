"""A process stopped while it holds a store's ``lock.init`` (it was opening,
closing or repairing the store) costs every other process a bounded wait:
an opener gets ``StoreLockedError`` naming the cause after
``INIT_LOCK_TIMEOUT_S``, a closer detaches without its end-of-use sweep, and
nothing stored is lost (issue 15 item 1: stopped is not dead)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from nvmetier import locks
from nvmetier.errors import StoreLockedError
from tests.fault.faultkit import key, load_keys, new_buffer, open_store, store_dir, store_keys

pytestmark = pytest.mark.timeout(120)
BOUND_S = 0.5


def _holder(directory: str) -> subprocess.Popen[str]:
    """A process that takes ``lock.init`` as an opener does, then is stopped."""
    code = textwrap.dedent(
        f"""
        import fcntl, os, sys, time
        os.makedirs({directory!r}, exist_ok=True)
        fd = os.open(os.path.join({directory!r}, "lock.init"), os.O_CREAT | os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(600)
        """
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    os.kill(p.pid, signal.SIGSTOP)
    return p


@pytest.fixture
def bound(monkeypatch) -> Iterator[float]:
    monkeypatch.setattr(locks, "INIT_LOCK_TIMEOUT_S", BOUND_S)
    yield BOUND_S


def _end(p: subprocess.Popen[str]) -> None:
    p.kill()
    os.kill(p.pid, signal.SIGCONT)
    p.wait(10)


def test_an_open_behind_a_stopped_opener_fails_in_bounded_time(tmp_path, bound) -> None:
    root = str(tmp_path)
    holder = _holder(store_dir(root))
    buf = new_buffer()
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreLockedError, match="stopped"):
            open_store(root, buf)
        assert time.monotonic() - t0 < bound + 5.0
    finally:
        _end(holder)
    # Once the holder is gone, the store opens.
    store = open_store(root, buf)
    store.close()


def test_a_close_behind_a_stopped_opener_returns_and_loses_nothing(tmp_path, bound, caplog) -> None:
    root = str(tmp_path)
    buf = new_buffer()
    store = open_store(root, buf)
    keys = [key(i) for i in range(8)]
    assert store_keys(store, buf, keys).success
    holder = _holder(store_dir(root))
    try:
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="nvmetier.files"):
            store.close()
        assert time.monotonic() - t0 < bound + 5.0
        assert "without the end-of-use sweep" in caplog.text
    finally:
        _end(holder)
    buf = new_buffer()
    again = open_store(root, buf)
    try:
        outcome, ok, wrong = load_keys(again, buf, keys)
        assert outcome.success and sorted(ok) == sorted(keys) and wrong == []
    finally:
        again.close()
