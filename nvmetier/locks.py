"""A store's locks: ``lock.init`` (opens and closes one at a time, every wait
bounded) and ``lock`` (who is attached), and the probes that tell who holds
a store without taking any lock.

Sharing protocol (``sharing: node``), with two files in the main store dir:

- ``lock.init``: an exclusive flock held only while a process opens or closes
  the store, so opens and closes never interleave (a dead holder's flock is
  released by the kernel);
- ``lock``: every attached process holds a *shared* flock on it for its whole
  life. An opener that gets it *exclusively* (non-blocking) is alone: it may
  create the store, rebuild the table from the records and clear the clean
  flags, then converts to shared (safe: ``lock.init`` keeps other openers
  out). A closer that gets it exclusively is the last sharer: it sweeps the
  table and marks the superblock clean. ``sharing: process`` keeps it exclusive
  for the process's life, so any other opener gets ``StoreLockedError``, and
  so does an exclusive opener while sharers are attached. Each sharer also
  holds an OFD byte lock on ``lock`` naming its registry entry in the table
  (its pid), which is how the table tells a dead writer from a live one.

Owns: no state; the fds it returns belong to the caller (``StoreFiles``,
``reclaim``, ``fsck --repair``). Called on the constructing thread (open,
close) and by operator commands (``info``, ``fsck``). ``_lock_init`` and
``_lock_init_fd`` block, polling, for at most ``INIT_LOCK_TIMEOUT_S``; the
probes (``store_held``, ``sharers``, ``holders``) never wait.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import time
from collections.abc import Sequence

from nvmetier import format as fmt
from nvmetier.errors import StoreLockedError
from nvmetier.store_dir import FILE_MODE, INIT_LOCK_NAME, LOCK_NAME, TABLE_NAME, _ensure_dir

# struct flock of Linux on 64-bit ABIs: l_type, l_whence, l_start, l_len, l_pid.
_FLOCK = struct.Struct("hhqqi4x")


def mark_init_busy(fd: int) -> None:
    """Hold an OFD write lock on byte 0 of ``lock.init`` (fd holding it
    exclusively): a flag that probes read with ``F_OFD_GETLK`` without taking
    any lock, so an operator command never stands in an opener's way. It
    goes with the fd, like the flock."""
    with contextlib.suppress(OSError, AttributeError):  # a probe then sees "not busy"
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0))


def _busy(path: str) -> bool:
    """Whether a process holds ``lock.init`` at ``path`` now (opening,
    closing, removing or repairing the store). Takes no lock."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0))
        return bool(_FLOCK.unpack(got)[0] != fcntl.F_UNLCK)
    except (OSError, AttributeError):
        return False
    finally:
        os.close(fd)


# How long an open or a close waits for another process's hold of
# ``lock.init`` (it opens, closes, removes or repairs the store). Holds last
# milliseconds, or seconds for the rebuild of a very large store; a holder that
# is stopped (SIGSTOP, ``docker pause``) or hung would hold it for ever.
INIT_LOCK_TIMEOUT_S = float(os.environ.get("NVMETIER_INIT_LOCK_TIMEOUT_S", "60"))


class InitLockTimeout(TimeoutError):
    """``lock.init`` stayed held by another process past the bound."""


def _flock_bounded(fd: int, timeout_s: float) -> None:
    """flock ``fd`` exclusively, polling, for at most ``timeout_s``.

    Raises:
        InitLockTimeout: still held by another process at the deadline.
    """
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        now = time.monotonic()
        if now >= deadline:
            raise InitLockTimeout(f"held by another process for over {timeout_s:g} s")
        time.sleep(min(pause, deadline - now))
        pause = min(pause * 2, 0.05)


def _lock_init_fd(directory: str, timeout_s: float | None = None) -> int:
    """``lock.init`` of the store in ``directory``, flocked exclusively
    (waiting at most ``timeout_s``, default ``INIT_LOCK_TIMEOUT_S``) and
    marked busy; returns the fd.

    Raises:
        InitLockTimeout: another process held it past the bound.
    """
    fd = os.open(
        os.path.join(directory, INIT_LOCK_NAME), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, FILE_MODE
    )
    try:
        _flock_bounded(fd, INIT_LOCK_TIMEOUT_S if timeout_s is None else timeout_s)
    except BaseException:
        os.close(fd)
        raise
    mark_init_busy(fd)
    return fd


def _is_linked(fd: int, path: str) -> bool:
    """Whether ``fd`` is still the file at ``path`` (not unlinked or replaced)."""
    try:
        st, at = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return st.st_nlink > 0 and (st.st_dev, st.st_ino) == (at.st_dev, at.st_ino)


def _lock_init(dirs: Sequence[str]) -> int:
    """Take ``lock.init`` of the store whose main directory is ``dirs[0]``
    exclusively (blocking); returns its fd.

    A store is removed under this lock (``StoreFiles.close(remove=True)``,
    ``reclaim_private_stores``), so a process that waited on it may get the
    lock of a file that is gone by then: it starts again, recreating the
    directories, and so never attaches to unlinked files.
    """
    deadline = time.monotonic() + INIT_LOCK_TIMEOUT_S
    while True:
        for d in dirs:
            _ensure_dir(d, "store directory")
        try:
            fd = _lock_init_fd(dirs[0], max(0.0, deadline - time.monotonic()))
        except FileNotFoundError:
            continue  # the directory was removed between makedirs and open
        except InitLockTimeout:
            raise StoreLockedError(
                f"store {dirs[0]!r} is being opened, closed or repaired by another process "
                f"that has held its {INIT_LOCK_NAME} for over {INIT_LOCK_TIMEOUT_S:g} s "
                f"(attached: {holders(dirs[0])}); a process stopped (SIGSTOP, docker pause) "
                "or hung while opening or closing the store holds it: resume or kill it, "
                "or use another root_dir"
            ) from None
        if _is_linked(fd, os.path.join(dirs[0], INIT_LOCK_NAME)):
            return fd
        os.close(fd)


def _unlock_file(fd: int) -> None:
    if fd >= 0:
        os.close(fd)  # closing the only fd of the open file drops its flock


def sharers(store_dir: str) -> list[tuple[int, int]]:
    """``(pid, attached_ns)`` of every process attached to the store in
    ``store_dir`` (read-only; empty when none, or when it has no table)."""
    try:
        import nvmetier._table as _table
    except ImportError:  # pragma: no cover - the table is a required extension
        return []
    try:
        lock_fd = os.open(os.path.join(store_dir, LOCK_NAME), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        with open(os.path.join(store_dir, TABLE_NAME), "rb") as f:
            head = f.read(fmt.TABLE_HEADER_BYTES)
        return [(pid, at) for _i, pid, at in _table.sharers(head, lock_fd)]
    except (OSError, ValueError):
        return []
    finally:
        os.close(lock_fd)


def sharer_pids(store_dir: str) -> list[int]:
    """The pids of the processes attached to the store in ``store_dir``."""
    return [pid for pid, _at in sharers(store_dir)]


def store_held(store_dir: str) -> bool:
    """Whether any process holds the store: attached (the table's registry),
    or opening, closing, removing or repairing it (``lock.init`` busy).

    A probe that takes no lock (``nvmetier info``, a read-only ``fsck``):
    it reads OFD locks with ``F_OFD_GETLK`` only, so it can never make an
    opener fail with ``StoreLockedError`` nor make a closer believe it is
    not the last. An answer is a snapshot: a process may attach just after.
    """
    if _busy(os.path.join(store_dir, INIT_LOCK_NAME)):
        return True
    return bool(sharers(store_dir))


def holders(store_dir: str) -> str:
    """Who holds the store, for a message: the attached processes' pids, else
    the pid an exclusive holder wrote into the lock file (fsck --repair), else
    ``unknown``."""
    pids = sharer_pids(store_dir)
    if pids:
        return ", ".join(str(p) for p in pids)
    try:
        with open(os.path.join(store_dir, LOCK_NAME), "rb") as f:
            text = f.read(64).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "unknown"
