"""Files of a store: directories, the locks, the superblock, the mapped index,
the mapped shared slot table and the preallocated data files (one per root
directory, one per drive).

Owns: every fd of a store, the mappings of its index and table, and this
process's attachment to the store (``nvmetier._table.Table``). Called on the
constructing thread (open/create, blocking, may take seconds to preallocate)
and at shutdown. The O_DIRECT probe runs once per directory.

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
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import shutil
import struct
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from nvmetier import format as fmt
from nvmetier.config import DEFAULT_WAYS, format_size
from nvmetier.errors import ConfigError, FormatError, StoreLockedError, StoreSpaceError

logger = logging.getLogger(__name__)

SUPERBLOCK_NAME = "superblock"
INDEX_NAME = "index"
DATA_NAME = "data"
LOCK_NAME = "lock"
INIT_LOCK_NAME = "lock.init"
TABLE_NAME = "table"
REMOVING_TAG = ".removing-"  # a store directory renamed aside to be deleted
DIR_MODE = 0o700
FILE_MODE = 0o600
O_DIRECT = getattr(os, "O_DIRECT", 0)
_MAX_LOGGED_DROPS = 20


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


def _fallocate(fd: int, size: int, path: str) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise StoreSpaceError(
                f"preallocating {format_size(size)} at {path!r} failed: no space left; "
                "lower capacity_bytes or free space on that drive"
            ) from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)  # filesystem without fallocate (e.g. some tmpfs)


# --- filesystems --------------------------------------------------------------
# statfs f_type magics (linux/magic.h and the filesystems' own headers).
NETWORK_FILESYSTEMS: dict[int, str] = {
    0x6969: "NFS",
    0x517B: "SMB",
    0xFE534D42: "SMB2",
    0xFF534D42: "CIFS",
    0x0BD00BD0: "Lustre",
    0x00C36400: "CephFS",
    0x47504653: "GPFS",
    0x19830326: "BeeGFS",
    0x65735546: "FUSE",
}
OVERLAYFS = 0x794C7630
# fallocate does not reserve blocks for overwrites (copy on write).
NO_RESERVE_FILESYSTEMS: dict[int, str] = {0x9123683E: "btrfs", 0x2FC12FC1: "ZFS"}
_FS_IOC_GETFLAGS, _FS_IOC_SETFLAGS, _FS_NOCOW_FL = 0x80086601, 0x40086602, 0x00800000


def statfs_type(path: str) -> int:
    """The ``f_type`` of the filesystem holding ``path`` (``statfs(2)``; 0
    when it cannot be read). ``os.statvfs`` does not give it."""
    global _statfs
    if _statfs is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            _statfs = libc.statfs
            _statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
            _statfs.restype = ctypes.c_int
        except (OSError, AttributeError):
            _statfs = False
    if not _statfs:
        return 0
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if _statfs(os.fsencode(path), buf) != 0:
        return 0
    # f_type is the first field, a long (__fsword_t).
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


_statfs: Any = None
# Test hook: how a directory's filesystem type is read (tests inject one).
fs_type = statfs_type


def check_filesystem(path: str, sharing: str) -> int:
    """Refuse ``sharing: node`` on a filesystem where the shared table cannot
    be coherent; warn on overlayfs. Returns the ``f_type``.

    Raises:
        ConfigError: ``sharing: node`` on a network or cluster filesystem
            (MAP_SHARED pages, robust mutexes and OFD locks are per node, or
            not coherent, there).
    """
    kind = fs_type(path)
    if sharing != "node":
        return kind
    name = NETWORK_FILESYSTEMS.get(kind)
    if name is not None:
        raise ConfigError(
            f"root_dir {path!r} is on {name} (statfs type {kind:#x}), where processes cannot "
            "share a store's table coherently (its memory mapping, locks and mutexes are per "
            'node). Use a local drive, or set sharing: "process" (a store per process: '
            "give each process on each node its own root_dir); for reuse across nodes, "
            "stack vLLM's shared 'fs' tier below this one"
        )
    if kind == OVERLAYFS:
        logger.warning(
            "nvmetier: root_dir %s is on overlayfs: each container's upper layer is its own "
            "copy, so containers do not share this store. Bind-mount a host directory to share "
            "it between containers",
            path,
        )
    return kind


def _set_nocow(fd: int) -> None:
    """Ask btrfs to overwrite ``fd``'s blocks in place (chattr +C; only
    works on an empty file). Ignored where unsupported."""
    import array

    flags = array.array("l", [0])
    with contextlib.suppress(OSError):
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, flags, True)
        flags[0] |= _FS_NOCOW_FL
        fcntl.ioctl(fd, _FS_IOC_SETFLAGS, flags, True)


def _write_zeros(fd: int, size: int, path: str) -> None:
    """Write ``size`` zero bytes (ENOSPC is a StoreSpaceError)."""
    zeros = bytes(1 << 20)
    try:
        for off in range(0, size, len(zeros)):
            n = min(len(zeros), size - off)
            if os.pwrite(fd, zeros[:n] if n < len(zeros) else zeros, off) != n:
                raise OSError(errno.EIO, "short write")
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise StoreSpaceError(
                f"writing {format_size(size)} at {path!r} failed: no space left; "
                "lower capacity_bytes or free space on that drive"
            ) from exc
        raise


def _preallocate_mapped(fd: int, size: int, path: str) -> None:
    """Make a file that will be memory-mapped ``size`` bytes, with every
    block allocated now: on a filesystem whose fallocate does not reserve
    blocks for overwrites (btrfs, ZFS) its pages are written in full (NOCOW
    on btrfs), so a full disk is an error at creation, never a SIGBUS on a
    mapped page inside a set's critical section."""
    os.ftruncate(fd, 0)
    if fs_type(os.path.dirname(path)) in NO_RESERVE_FILESYSTEMS:
        _set_nocow(fd)
        _write_zeros(fd, size, path)
    else:
        _fallocate(fd, size, path)


def release_free_memory() -> None:
    """Give the allocator's free heap memory back to the kernel (glibc's
    ``malloc_trim``; nothing elsewhere). Called after a big transient
    allocation, so that private memory is what the process really holds."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            _malloc_trim = libc.malloc_trim
            _malloc_trim.argtypes = [ctypes.c_size_t]
            _malloc_trim.restype = ctypes.c_int
        except (OSError, AttributeError):  # not glibc (musl, macOS)
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None


def _zero(mm: mmap.mmap) -> None:
    zeros = bytes(1 << 20)
    for off in range(0, len(mm), len(zeros)):
        n = min(len(zeros), len(mm) - off)
        mm[off : off + n] = zeros[:n]


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


def probe_o_direct(directory: str) -> tuple[bool, str]:
    """Whether an aligned O_DIRECT write works in ``directory``, and why not.

    The probe file has no name (``O_TMPFILE``), so a crash in the middle
    leaves nothing on disk. Where the filesystem has no ``O_TMPFILE``, it is
    a named ``.odirect-probe-*`` file, unlinked at once; probe files older
    than a minute (left by a crash) are deleted by every probe.
    """
    if not O_DIRECT:
        return False, "O_DIRECT is not defined on this platform"
    page = mmap.mmap(-1, fmt.ALIGN_BYTES)
    try:
        fd = _probe_file(directory)
        try:
            os.pwrite(fd, page, 0)
            os.preadv(fd, [page], 0)
        finally:
            os.close(fd)
        return True, "aligned O_DIRECT write and read succeeded"
    except OSError as exc:
        return False, f"{os.strerror(exc.errno or 0)} (errno {exc.errno})"
    finally:
        page.close()


PROBE_PREFIX = ".odirect-probe-"
_STALE_PROBE_S = 60.0


def _probe_file(directory: str) -> int:
    """An O_DIRECT fd on a file of ``directory`` that no crash can leave."""
    tmpfile = getattr(os, "O_TMPFILE", 0)
    if tmpfile:
        try:
            fd = os.open(directory, tmpfile | os.O_RDWR | os.O_CLOEXEC, FILE_MODE)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                raise
        else:  # O_TMPFILE works here: the answer is whether O_DIRECT does
            os.close(fd)
            return os.open(directory, tmpfile | os.O_RDWR | os.O_CLOEXEC | O_DIRECT, FILE_MODE)
    _sweep_probe_files(directory)
    path = os.path.join(directory, f"{PROBE_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
    try:
        # A filesystem that refuses O_DIRECT may have created the file first.
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | O_DIRECT | os.O_CLOEXEC
        return os.open(path, flags, FILE_MODE)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)  # an open fd keeps the file until the probe ends


def _sweep_probe_files(directory: str) -> None:
    """Delete named probe files a crash left (older than a minute: a live
    probe lasts milliseconds)."""
    now = time.time()
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith(PROBE_PREFIX):
                with contextlib.suppress(OSError):
                    if now - entry.stat(follow_symlinks=False).st_mtime > _STALE_PROBE_S:
                        os.unlink(entry.path)


PRIVATE_TAG = "_private_"


def private_store_name(base: str) -> str:
    """The name of a store private to this process: ``<base>_private_<pid>_<random>``.

    The pid is for a person reading the directory; the random part keeps
    names unique where pids are not (containers in their own pid namespace
    start at the same pids), so no two processes ever pick one store.
    """
    return f"{base}{PRIVATE_TAG}{os.getpid()}_{secrets.token_hex(4)}"


def stores_of_other_formats(roots: Sequence[str]) -> list[tuple[str, int, int]]:
    """Stores under ``roots`` written by another nvmetier format version.

    This version never opens them (its layout identity, hence its store
    name, includes the format version), so after an upgrade the old store
    sits beside the new one, outside the new one's ``capacity_bytes``. Blocks
    for one directory listing and one superblock read per store; never raises.

    Returns:
        ``(main directory, format version, bytes on disk over all roots)``.
    """
    out: list[tuple[str, int, int]] = []
    if not roots:
        return out
    try:
        names = sorted(os.listdir(roots[0]))
    except OSError:
        return out
    for name in names:
        main = os.path.join(roots[0], name)
        try:
            with open(os.path.join(main, SUPERBLOCK_NAME), "rb") as f:
                version = fmt.superblock_version(f.read(64))
        except OSError:
            continue
        if version is None or version == fmt.FORMAT_VERSION:
            continue
        size = 0
        for d in _under(roots, name):
            with contextlib.suppress(OSError):
                for entry in os.scandir(d):
                    with contextlib.suppress(OSError):
                        size += entry.stat(follow_symlinks=False).st_blocks * 512
        out.append((main, version, size))
    return out


def reclaim_private_stores(roots: Sequence[str]) -> list[str]:
    """Delete the private stores under ``roots`` whose process is gone, and
    the ``.removing-`` directories a crash left in the middle of a removal.

    A private store is judged by its locks, never by a pid (pids are reused,
    and another container's pids are not ours): its process holds ``lock``
    exclusively for its whole life, so a store whose ``lock`` we can take
    (under ``lock.init``, without waiting) has nobody attached. A stopped
    (SIGSTOP, ``docker pause``) process still holds its lock and keeps its
    store. Blocks for one directory listing and a few lock probes; never
    raises: what cannot be examined is left.

    Returns:
        The main directories deleted.
    """
    if not roots:
        return []
    try:
        names = sorted(os.listdir(roots[0]))
    except OSError:
        return []
    reclaimed = []
    for name in names:
        if _REMOVING_NAME.search(name):
            for root in roots:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        elif _PRIVATE_NAME.search(name) and _reclaim_if_free(_under(roots, name)):
            reclaimed.append(os.path.join(roots[0], name))
    return reclaimed


def _under(roots: Sequence[str], name: str) -> list[str]:
    return [os.path.join(r, name) for r in roots]


# Exactly the names private_store_name gives (the pid alone before the random
# part was added) after a store name's 12-hex-digit digest, and _remove_dirs'
# names: a shared store is never taken for one, whatever its model is called.
_PRIVATE_NAME = re.compile(r"_[0-9a-f]{12}(_dp\d+)?_private_\d+(_[0-9a-f]{8})?$")
_REMOVING_NAME = re.compile(r"\.removing-[0-9a-f]{12}$")


def _reclaim_if_free(dirs: Sequence[str]) -> bool:
    """Remove the store in ``dirs`` if nobody holds it (``reclaim_private_stores``)."""
    main = dirs[0]
    init_path = os.path.join(main, INIT_LOCK_NAME)
    try:
        init_fd = os.open(init_path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False  # not a store, or one being created right now
    try:
        try:
            fcntl.flock(init_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # being opened or closed now
        mark_init_busy(init_fd)
        if not _is_linked(init_fd, init_path):
            return False
        try:
            lock_fd = os.open(os.path.join(main, LOCK_NAME), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            lock_fd = -1  # its process died before it took the lock
        except OSError:
            return False
        try:
            if lock_fd >= 0:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # its process is alive (or stopped): keep it
        finally:
            if lock_fd >= 0:
                os.close(lock_fd)
        logger.info("nvmetier: removing %s, the private store of a process that is gone", main)
        _remove_dirs(dirs)
        return True
    finally:
        os.close(init_fd)


def _ensure_dir(path: str, key: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{key} {path!r} is a file, not a directory; point it at a directory")
    try:
        os.makedirs(path, mode=DIR_MODE, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"{key} {path!r} cannot be created: {exc.strerror}; "
            "choose a writable directory or fix its permissions"
        ) from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{key} {path!r} is not writable by this process; "
            "choose a writable directory or fix its permissions"
        )


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the configuration asks a store to be (compared at every open)."""

    capacity_bytes: int
    chunk_bytes: int
    ways: int | None  # None: DEFAULT_WAYS, or fewer when fewer slots fit
    identity: dict[str, Any]
    capacity_per_path: tuple[int, ...] | None = None

    def geometry(self, n_paths: int) -> tuple[int, int, int]:
        """``(ways, slot_bytes, n_slots)`` of this layout over ``n_paths`` drives.

        Raises:
            FormatError: not one set fits (an explicit ``ways``), or not one
                slot per drive (the default).
        """
        ways = self.ways
        if ways is None:
            _slot, most = self._geometry(1, n_paths)
            ways = max(1, min(DEFAULT_WAYS, most // n_paths))
        return (ways, *self._geometry(ways, n_paths))

    def _geometry(self, ways: int, n_paths: int) -> tuple[int, int]:
        return fmt.geometry(
            self.capacity_bytes,
            self.chunk_bytes,
            ways,
            n_paths,
            self.identity,
            self.capacity_per_path,
        )


class StoreFiles:
    """The open files of one store.

    Use ``StoreFiles.open(...)``; call ``close()`` (or use ``with``).

    Attributes:
        dirs: the store directory under each root (the first holds the
            superblock, the index and the lock).
        sb: the superblock.
        index: writable mapping of the index file (``n_slots`` records).
        data_fds: one fd per data file, opened O_DIRECT when ``o_direct``.
        o_direct: whether the data fds use O_DIRECT.
        created: whether this open created the store.
    """

    def __init__(self) -> None:
        self.dirs: list[str] = []
        self.sb: fmt.Superblock
        self.index: mmap.mmap
        self.data_fds: list[int] = []
        self.o_direct = False
        self.o_direct_reason = ""
        self.created = False
        self.alone = False  # the first process attached (it prepared the table)
        self.exclusive = False
        self.table: Any = None  # nvmetier._table.Table once attached
        self.table_map: mmap.mmap
        self.records_dropped = 0
        self._lock_fd = -1
        self._init_fd = -1
        self._index_fd = -1
        self._table_fd = -1
        self._row_bytes = 0
        self._n_rows = 0
        self._lease_ns = 0
        self._watch_timeout_ns = 0
        self._wipe = False

    @classmethod
    def open(
        cls,
        roots: Sequence[str],
        store_name: str,
        *,
        capacity_bytes: int,
        chunk_bytes: int,
        ways: int | None,
        identity: dict[str, Any],
        o_direct: str | bool = "auto",
        create: bool = True,
        capacity_per_path: tuple[int, ...] | None = None,
        sharing: str = "node",
        row_bytes: int | None = None,
        n_rows: int = 0,
        lease_ns: int = 5_000_000_000,
        watch_timeout_ns: int = 2_000_000_000,
        wipe: bool = False,
    ) -> StoreFiles:
        """Open the store ``store_name`` under ``roots``, creating it if absent,
        and attach to its shared slot table.

        Args:
            sharing: ``node`` (attach beside other processes) or ``process``
                (exclusive; fails while any other process is attached).
            row_bytes, n_rows: the caller's buffer geometry (ops address rows).
            lease_ns: how long a lookup hit or a load protects its slot.
            watch_timeout_ns: how long a store of a key another sharer is
                writing waits for that write before the key fails.
            wipe: forget every chunk when this process is the first attached
                (an ephemeral store left behind by a crash).

        Raises:
            ConfigError: a root is a file, unwritable, or the existing store
                has another geometry than the configuration asks for.
            StoreLockedError: another process has the store open exclusively,
                or ``sharing="process"`` while other processes are attached.
            StoreSpaceError: not enough free space to preallocate.
            FormatError: the existing store is corrupt or of another version
                or layout identity.
        """
        self = cls()
        layout = Layout(capacity_bytes, chunk_bytes, ways, identity, capacity_per_path)
        self.exclusive = sharing == "process"
        self._row_bytes = row_bytes or chunk_bytes
        self._n_rows, self._lease_ns, self._wipe = n_rows, lease_ns, wipe
        self._watch_timeout_ns = watch_timeout_ns
        try:
            self._open(roots, store_name, layout, o_direct, create)
        except BaseException:
            # A failed open changes nothing: not even the clean flag.
            self.close(clean=False)
            raise
        return self

    def _open(
        self,
        roots: Sequence[str],
        store_name: str,
        layout: Layout,
        o_direct: str | bool,
        create: bool,
    ) -> None:
        for i, root in enumerate(roots):
            key = "root_dir" if len(roots) == 1 else f"root_dir[{i}]"
            if create:
                _ensure_dir(root, key)
            if os.path.isdir(root):
                check_filesystem(root, "process" if self.exclusive else "node")
            self.dirs.append(os.path.join(root, store_name))
        main = self.dirs[0]
        sb_path = os.path.join(main, SUPERBLOCK_NAME)
        exists = os.path.exists(sb_path)
        if not exists and not create:
            raise FormatError(f"{main!r} is not an nvmetier store (no superblock)")
        self._init_fd = _lock_init(self.dirs)
        try:
            self._lock(main)
            exists = os.path.exists(sb_path)
            if exists:
                self.sb = self._read_superblock(sb_path)
                self._check_same_layout(layout)
            elif not self.alone:
                raise FormatError(f"{main!r} has sharers attached but no superblock")
            else:
                self._create(layout)
                self.created = True
            self._choose_o_direct(o_direct)
            self._open_index()
            self._open_data()
            self._open_table()
            if self.alone:
                # Mark the store open (not clean) until the last sharer closes it.
                self._write_superblock(dataclasses.replace(self.sb, clean=False))
                if not self.exclusive:
                    fcntl.flock(self._lock_fd, fcntl.LOCK_SH)
            self._record_owner()
        finally:
            _unlock_file(self._init_fd)
            self._init_fd = -1

    # --- lock -----------------------------------------------------------------
    def _lock(self, main: str) -> None:
        """Take ``lock``: exclusively when alone (or ``sharing: process``),
        else shared. Called with ``lock.init`` held."""
        path = os.path.join(main, LOCK_NAME)
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, FILE_MODE)
        self._lock_fd = fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.alone = True
            return
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        who = holders(main)
        if self.exclusive:
            raise StoreLockedError(
                f"store {main!r} is in use by another process (pid {who}) and sharing is "
                "'process' (exclusive); stop that process, give this one another root_dir, "
                "or set sharing: 'node' to share the store"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StoreLockedError(
                    f"store {main!r} is in use by another process (pid {who}) that holds it "
                    "exclusively (sharing: 'process', or fsck --repair); stop that process "
                    "or give this one another root_dir"
                ) from exc
            raise

    def _record_owner(self) -> None:
        """Write our pid into the lock file of an exclusive store (only once
        the open succeeded); sharers are named by the table's registry."""
        if self.exclusive:
            os.ftruncate(self._lock_fd, 0)
            os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)

    # --- shared table ---------------------------------------------------------
    def _open_table(self) -> None:
        """Map the table; when alone, rebuild it from the index records."""
        import nvmetier._table as _table

        path = os.path.join(self.dirs[0], TABLE_NAME)
        size = self.sb.table_bytes
        rebuild: np.ndarray | None = None
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, FILE_MODE)
        self._table_fd = fd
        if os.fstat(fd).st_size != size:
            if not self.alone:
                raise FormatError(f"{path!r} has the wrong size while sharers are attached")
            _preallocate_mapped(fd, size, path)
        self.table_map = mmap.mmap(fd, size)
        if self.alone:
            # The records are the durable truth: the first process to attach
            # rebuilds the table from them (a native scan, ~40 ms per 256 K
            # slots), so bit rot, a crash or an fsck --repair since the last
            # close can never leave the table claiming what the records don't.
            if self._wipe and not self.created:  # a new index is zero already
                logger.info(
                    "nvmetier: persist is false; forgetting the chunks a previous run left in %s",
                    self.dirs[0],
                )
                _zero(self.index)
            _table.format(self.table_map, self.sb.n_slots, self.sb.ways)
            rebuild = self._scan_records()
        else:
            head = _table.header(self.table_map)
            if not head["valid"]:
                raise FormatError(
                    f"{path!r} is not a valid table while sharers are attached "
                    f"({head['problem']}); close every process using the store, then reopen"
                )
        self.table = _table.Table(
            self.table_map,
            self.index,
            self._lock_fd,
            n_paths=self.sb.n_paths,
            slot_bytes=self.sb.slot_bytes,
            row_bytes=self._row_bytes,
            n_rows=self._n_rows,
            lease_ns=self._lease_ns,
            watch_timeout_ns=self._watch_timeout_ns,
        )
        if rebuild is not None:
            # After an unclean shutdown (a crash, a power loss) a record may
            # sit over another key's bytes (the index page and the data reach
            # the media at different moments): each rebuilt slot is then
            # checked at its next load even with verify_checksums off.
            unclean = not self.created and not self.sb.clean
            if unclean:
                # Every stop of `vllm serve` kills its engine (docs/vllm.md), so
                # this is the usual restart: one line, nothing to do.
                logger.warning(
                    "nvmetier: %s was not closed cleanly (a killed or crashed vLLM); "
                    "%d chunks kept, each checksum-verified at its first load; "
                    "%d unfinished records dropped",
                    self.dirs[0],
                    len(rebuild),
                    self.records_dropped,
                )
            self.table.load(np.ascontiguousarray(rebuild, dtype=np.int64), unclean)
            del rebuild
            # The scan's temporaries (~65 B per stored slot) are freed now, but
            # in a long-lived process (vLLM: glibc's mmap threshold raised by
            # earlier big frees) they came from the heap, which glibc keeps.
            release_free_memory()
        self.table.attach()

    @property
    def registry_fd(self) -> int:
        """The fd whose OFD locks tell the other sharers this process is
        alive (-1 when closed). The io_uring engine registers it in its rings
        so that, if this process dies, the lock outlives its queued writes."""
        return self._lock_fd

    def other_sharers(self) -> int:
        """How many other processes are attached now (a lock probe each)."""
        import nvmetier._table as _table

        if self.table is None:
            return 0
        return len(_table.sharers(self.table_map, self._lock_fd))

    def _scan_records(self) -> np.ndarray:
        """The slots whose records prove valid; bad records are zeroed."""
        from nvmetier import recovery

        scan = recovery.scan_index(self.index, self.sb.n_slots, self.sb.ways, with_keys=False)
        rb = fmt.RECORD_BYTES
        for slot, _reason in scan.bad:
            self.index[slot * rb : (slot + 1) * rb] = fmt.EMPTY_RECORD
        # One line for the whole open (below, or the crash line in attach);
        # the slots themselves only at debug level: after a crash they are
        # the unfinished writes, expected, and a warning each was noise.
        for slot, reason in scan.bad[:_MAX_LOGGED_DROPS]:
            logger.debug("nvmetier: dropping index record of slot %d: %s", slot, reason)
        if scan.bad and self.sb.clean:
            logger.warning(
                "nvmetier: dropped %d index records of %s at open (%s%s)",
                len(scan.bad),
                self.dirs[0],
                scan.bad[0][1],
                ", ..." if len(scan.bad) > 1 else "",
            )
        self.records_dropped = len(scan.bad)
        # Oldest first: load() gives recency in this order (the LRU survives).
        return scan.slots[np.argsort(scan.stored_ns, kind="stable")]

    # --- superblock -----------------------------------------------------------
    def _read_superblock(self, path: str) -> fmt.Superblock:
        with open(path, "rb") as f:
            return fmt.unpack_superblock(f.read(), where=path)

    def _write_superblock(self, sb: fmt.Superblock) -> None:
        """Write the superblock atomically (temp file + rename + fsync)."""
        path = os.path.join(self.dirs[0], SUPERBLOCK_NAME)
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
        try:
            data = fmt.pack_superblock(sb)
            if os.write(fd, data) != len(data):
                raise OSError(errno.EIO, "short write of the superblock")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        self.sb = sb

    def _check_same_layout(self, layout: Layout) -> None:
        sb, main, n_paths = self.sb, self.dirs[0], len(self.dirs)
        if sb.identity != layout.identity:
            raise FormatError(
                f"store {main!r} was written for another layout identity; "
                "its data will not be served. Remove the directory or use another root_dir"
            )
        if sb.chunk_bytes != layout.chunk_bytes:
            raise FormatError(
                f"store {main!r} holds {sb.chunk_bytes}-byte chunks, not {layout.chunk_bytes}"
            )
        ways, _slot_bytes, n_slots = layout.geometry(n_paths)
        if (sb.ways, sb.n_paths, sb.n_slots) != (ways, n_paths, n_slots):
            raise ConfigError(
                f"store {main!r} was created with ways={sb.ways}, {sb.n_paths} path(s) "
                f"and {sb.n_slots} slots, but the configuration asks for ways={ways}, "
                f"{n_paths} path(s) and {n_slots} slots "
                f"(capacity_bytes={layout.capacity_bytes}); restore the original settings, or "
                "remove the store directory to start a new cache with the new size"
            )

    def _create(self, layout: Layout) -> None:
        try:
            ways, slot_bytes, n_slots = layout.geometry(len(self.dirs))
        except FormatError as exc:
            raise ConfigError(
                f"capacity_bytes={layout.capacity_bytes} is too small: {exc}"
            ) from exc
        sb = fmt.Superblock(
            chunk_bytes=layout.chunk_bytes,
            slot_bytes=slot_bytes,
            n_slots=n_slots,
            ways=ways,
            n_paths=len(self.dirs),
            created_ns=time.time_ns(),
            identity=layout.identity,
        )
        # Check space on every drive before writing anything big.
        need_main = sb.superblock_bytes + fmt.align_up(sb.index_bytes) + sb.table_bytes
        for i, d in enumerate(self.dirs):
            need = sb.data_file_bytes + (need_main if i == 0 else 0)
            free = shutil.disk_usage(d).free
            if free < need:
                # What would fit: the store's size scales with capacity_bytes.
                fit_bytes = layout.capacity_bytes * free // need >> 20 << 20
                raise StoreSpaceError(
                    f"{d!r} has {format_size(free)} free but the store needs "
                    f"{format_size(need)} ({format_size(need - free)} more): lower "
                    f"capacity_bytes (now {format_size(layout.capacity_bytes)}; about "
                    f"{format_size(fit_bytes)} fits), or free space on that drive"
                )
        for d in self.dirs:
            self._preallocate(os.path.join(d, DATA_NAME), sb.data_file_bytes)
        index_path = os.path.join(self.dirs[0], INDEX_NAME)
        self._preallocate(index_path, fmt.align_up(sb.index_bytes), mapped=True)
        self._write_superblock(sb)

    @staticmethod
    def _preallocate(path: str, size: int, mapped: bool = False) -> None:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, FILE_MODE)
        try:
            if mapped:
                _preallocate_mapped(fd, size, path)
            else:
                os.ftruncate(fd, 0)
                _fallocate(fd, size, path)
            os.fsync(fd)
        finally:
            os.close(fd)

    # --- index and data -------------------------------------------------------
    def _choose_o_direct(self, setting: str | bool) -> None:
        if setting is False:
            self.o_direct, self.o_direct_reason = False, "o_direct is false"
            return
        results = [probe_o_direct(d) for d in self.dirs]
        bad = [(d, why) for d, (ok, why) in zip(self.dirs, results, strict=True) if not ok]
        if not bad:
            self.o_direct, self.o_direct_reason = True, "probed OK"
            return
        d, why = bad[0]
        if setting is True:
            raise ConfigError(
                f"o_direct=true but {d!r} refuses O_DIRECT ({why}); "
                "use o_direct: 'auto' to fall back to buffered I/O, or another filesystem"
            )
        self.o_direct, self.o_direct_reason = False, f"{d!r} refuses O_DIRECT: {why}"
        logger.warning("nvmetier: O_DIRECT is not supported at %s (%s); using buffered I/O", d, why)

    def _open_index(self) -> None:
        path = os.path.join(self.dirs[0], INDEX_NAME)
        if not os.path.exists(path):
            raise FormatError(f"{path!r} is missing: the store's index is gone")
        self._index_fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        size = os.fstat(self._index_fd).st_size
        if size < self.sb.index_bytes:
            raise FormatError(f"{path!r} is {size} bytes, expected {self.sb.index_bytes}")
        self.index = mmap.mmap(self._index_fd, fmt.align_up(self.sb.index_bytes))

    def _open_data(self) -> None:
        flags = os.O_RDWR | os.O_CLOEXEC | (O_DIRECT if self.o_direct else 0)
        for d in self.dirs:
            path = os.path.join(d, DATA_NAME)
            if not os.path.exists(path):
                raise FormatError(f"{path!r} is missing: a data file of the store is gone")
            fd = os.open(path, flags)
            self.data_fds.append(fd)
            size = os.fstat(fd).st_size
            if size < self.sb.data_file_bytes:
                raise FormatError(
                    f"{path!r} is {size} bytes, expected {self.sb.data_file_bytes} (truncated)"
                )

    def flush_index(self) -> None:
        """msync the index (blocking). A process crash loses nothing without
        it; it narrows what a power loss can lose."""
        with contextlib.suppress(ValueError, OSError):
            self.index.flush()

    def close(self, clean: bool = True, remove: bool = False) -> bool:
        """Detach; the last sharer also sweeps the table and, when ``clean``,
        marks the superblock clean, or, when ``remove``, deletes the store's
        directories. Closes every fd.

        The decision "last" and the removal are both made under ``lock.init``
        (held exclusively from the detach to the end), so no process can
        attach between them: an opener waiting on ``lock.init`` finds it
        unlinked afterwards and creates a fresh store.

        Returns:
            True when this process was the last one attached (nobody else
            holds the store now).
        """
        last = False
        init_fd = -1
        timed_out = False
        if self._lock_fd >= 0 and self.table is not None and self.dirs:
            # Serialize with opens: no process attaches while we decide. A
            # holder stopped past the bound leaves init_fd -1: we then detach
            # without sweeping, marking clean or removing (the store stays,
            # unclean, and the next first opener rebuilds it).
            try:
                init_fd = _lock_init_fd(self.dirs[0])
            except InitLockTimeout:
                timed_out = True
                logger.warning(
                    "nvmetier: %s: another process held %s for over %g s while this one "
                    "closed (stopped or hung?); detaching without the end-of-use sweep",
                    self.dirs[0],
                    INIT_LOCK_NAME,
                    INIT_LOCK_TIMEOUT_S,
                )
            except OSError:
                pass
        try:
            if self.table is not None:
                self.table.detach()
            if self._lock_fd >= 0:
                try:
                    fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    last = not timed_out  # an opener may be attaching right now
                except OSError:
                    last = False
            # Only under lock.init: without it an opener could be attaching.
            removing = last and remove and init_fd >= 0
            if last and self.table is not None and not removing:
                self.table.sweep()
            if hasattr(self, "index") and not self.index.closed and not removing:
                self.flush_index()
            for fd in () if removing else self.data_fds:
                with contextlib.suppress(OSError):
                    os.fsync(fd)
            if last and clean and not removing and self.table is not None:
                with contextlib.suppress(OSError):
                    self._write_superblock(dataclasses.replace(self.sb, clean=True))
            self.table = None
            if hasattr(self, "table_map") and not self.table_map.closed:
                with contextlib.suppress(BufferError):
                    self.table_map.close()
            if hasattr(self, "index") and not self.index.closed:
                with contextlib.suppress(BufferError):
                    self.index.close()
            for fd in (self._index_fd, self._table_fd):
                if fd >= 0:
                    os.close(fd)
            self._index_fd = self._table_fd = -1
            for fd in self.data_fds:
                os.close(fd)
            self.data_fds = []
            if removing:
                _remove_dirs(self.dirs)  # still under lock.init: nobody attaches meanwhile
            if self._lock_fd >= 0:
                # Unlock before the close: an io_uring ring that registered
                # this fd (registry_fd) may hold the open file a few ms
                # longer, and a flock goes only with the last reference.
                with contextlib.suppress(OSError):
                    fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                os.close(self._lock_fd)
                self._lock_fd = -1
        finally:
            _unlock_file(init_fd)
        return last


def _remove_dirs(dirs: Sequence[str]) -> None:
    """Delete a store's directories; call with its ``lock.init`` held.

    Each directory is first renamed aside (``<name>.removing-<random>``,
    the main one last, which moves ``lock.init`` with it), then deleted. An
    opener that waited on the old ``lock.init`` finds it gone from its path
    and starts again; one that comes after the rename creates a fresh store
    at once, never waiting for the files to be deleted. A crash between the
    two steps leaves a ``.removing-`` directory, which the next
    ``reclaim_private_stores`` deletes.
    """
    tag = f"{REMOVING_TAG}{secrets.token_hex(6)}"
    doomed = []
    for d in [*dirs[1:], dirs[0]]:
        aside = os.path.normpath(d) + tag
        with contextlib.suppress(OSError):
            os.rename(d, aside)
            doomed.append(aside)
    for d in doomed:
        shutil.rmtree(d, ignore_errors=True)
