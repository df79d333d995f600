"""Where a store lives: the names of its files, its directories, and the
checks of the filesystem under them (network filesystems, overlayfs,
filesystems whose fallocate reserves nothing) and of O_DIRECT.

Owns: nothing that stays open; it is the bottom of the store's file layers
(``store_dir`` <- ``locks`` <- ``superblock``, ``reclaim`` <- ``files``) and
imports none of them. Called on the constructing thread (an open, ``nvmetier
info``); blocking: a ``statfs``, a ``makedirs``, and the O_DIRECT probe (one
4 KiB write and read of a file no crash can leave behind).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import secrets
import time
from typing import Any

from nvmetier import format as fmt
from nvmetier.crashsim import hook
from nvmetier.errors import ConfigError

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


def write_file(path: str, data: bytes, *, tmp: str | None = None, sync: bool = True) -> None:
    """Write ``data`` as the whole of a small file, each step told to the
    crash recorder (``nvmetier.crashsim``): straight into ``path``, or into
    ``tmp`` then renamed over ``path`` (the file is then old or new, never
    torn). ``sync``: the file's fsync before the rename. The directory is not
    synced here: a caller whose rename must survive a power loss calls
    ``fsync_dir`` after. Blocks for the write and the fsync.

    Raises:
        OSError: any step failed (a short write as EIO).
    """
    rec = hook.recorder
    target = path if tmp is None else tmp
    fd = os.open(target, os.O_CREAT | os.O_TRUNC | os.O_WRONLY | os.O_CLOEXEC, FILE_MODE)
    try:
        if rec is not None:
            rec.create(target)
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            if n <= 0:
                raise OSError(errno.EIO, f"short write of {target}")
            view = view[n:]
        if rec is not None:
            rec.write(target, 0, data)
        if sync:
            os.fsync(fd)
            if rec is not None:
                rec.fsync(target)
    finally:
        os.close(fd)
    if tmp is not None:
        os.replace(tmp, path)
        if rec is not None:
            rec.rename(tmp, path)


def fsync_dir(path: str) -> None:
    """fsync the directory ``path``: makes the entries created, renamed or
    removed in it durable (a file's own fsync does not; ``docs/format.md``,
    "Durability order"). Blocks for one journal commit.

    Raises:
        OSError: the directory cannot be opened or synced.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        # A filesystem that cannot sync a directory (some FUSE ones) says
        # EINVAL: there is nothing stronger to ask it for.
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)
    rec = hook.recorder
    if rec is not None:
        rec.fsync_dir(path)


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
