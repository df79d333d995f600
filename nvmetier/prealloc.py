"""Allocation of a store's files: every block of a data, index or table
file allocated at creation (``posix_fallocate``; on filesystems whose
fallocate reserves nothing for overwrites, btrfs and ZFS, written in full,
NOCOW on btrfs), so a full disk is an error at creation, never an ENOSPC on a
data write nor a SIGBUS on a mapped page later.

Owns no state. Called by ``nvmetier.files`` on the creating thread, under the
root lock; blocks for the allocation and its fsync (seconds for a big store
on a filesystem that writes zeros).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os

from nvmetier import store_dir
from nvmetier.config import format_size
from nvmetier.crashsim import hook
from nvmetier.errors import StoreSpaceError
from nvmetier.store_dir import FILE_MODE, NO_RESERVE_FILESYSTEMS


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


_FS_IOC_GETFLAGS, _FS_IOC_SETFLAGS, _FS_NOCOW_FL = 0x80086601, 0x40086602, 0x00800000


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


def preallocate_mapped(fd: int, size: int, path: str) -> None:
    """Make a file that will be memory-mapped ``size`` bytes, with every
    block allocated now: on a filesystem whose fallocate does not reserve
    blocks for overwrites (btrfs, ZFS) its pages are written in full (NOCOW
    on btrfs), so a full disk is an error at creation, never a SIGBUS on a
    mapped page inside a set's critical section."""
    os.ftruncate(fd, 0)
    if store_dir.fs_type(os.path.dirname(path)) in NO_RESERVE_FILESYSTEMS:
        _set_nocow(fd)
        _write_zeros(fd, size, path)
    else:
        _fallocate(fd, size, path)


def preallocate(path: str, size: int, mapped: bool = False) -> None:
    """Create (or empty) ``path`` and allocate ``size`` bytes of it, durably
    (fsync), each step told to the crash recorder. ``mapped``: the file will
    be memory-mapped (``preallocate_mapped``).

    Raises:
        StoreSpaceError: no space for it (names the path and the fix).
        OSError: any other step failed.
    """
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, FILE_MODE)
    rec = hook.recorder
    try:
        if rec is not None:
            rec.create(path)
        if mapped:
            preallocate_mapped(fd, size, path)
        else:
            os.ftruncate(fd, 0)
            _fallocate(fd, size, path)
        if rec is not None:
            rec.truncate(path, size)
        os.fsync(fd)
        if rec is not None:
            rec.fsync(path)
    finally:
        os.close(fd)
