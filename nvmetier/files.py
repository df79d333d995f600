"""Files of a store: directories, the lock, the superblock, the mapped index
and the preallocated data files (one per root directory, one per drive).

Owns: every fd of a store and the mapping of its index. Called on the
constructing thread (open/create, blocking, may take seconds to preallocate)
and at shutdown. The O_DIRECT probe runs once per directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import mmap
import os
import shutil
import time
from collections.abc import Sequence
from typing import Any

from nvmetier import format as fmt
from nvmetier.config import DEFAULT_WAYS
from nvmetier.errors import ConfigError, FormatError, StoreLockedError, StoreSpaceError

logger = logging.getLogger(__name__)

SUPERBLOCK_NAME = "superblock"
INDEX_NAME = "index"
DATA_NAME = "data"
LOCK_NAME = "lock"
DIR_MODE = 0o700
FILE_MODE = 0o600
O_DIRECT = getattr(os, "O_DIRECT", 0)


def probe_o_direct(directory: str) -> tuple[bool, str]:
    """Whether an aligned O_DIRECT write works in ``directory``, and why not."""
    if not O_DIRECT:
        return False, "O_DIRECT is not defined on this platform"
    path = os.path.join(directory, f".odirect-probe-{os.getpid()}")
    page = mmap.mmap(-1, fmt.ALIGN_BYTES)
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC | O_DIRECT, FILE_MODE)
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
        with contextlib.suppress(OSError):
            os.unlink(path)


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
        self._lock_fd = -1
        self._index_fd = -1

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
    ) -> StoreFiles:
        """Open the store ``store_name`` under ``roots``, creating it if absent.

        Raises:
            ConfigError: a root is a file, unwritable, or the existing store
                has another geometry than the configuration asks for.
            StoreLockedError: another process has the store open.
            StoreSpaceError: not enough free space to preallocate.
            FormatError: the existing store is corrupt or of another version
                or layout identity.
        """
        self = cls()
        layout = Layout(capacity_bytes, chunk_bytes, ways, identity, capacity_per_path)
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
            self.dirs.append(os.path.join(root, store_name))
        main = self.dirs[0]
        sb_path = os.path.join(main, SUPERBLOCK_NAME)
        exists = os.path.exists(sb_path)
        if not exists and not create:
            raise FormatError(f"{main!r} is not an nvmetier store (no superblock)")
        for d in self.dirs:
            _ensure_dir(d, "store directory")
        self._lock(main)
        if exists:
            self.sb = self._read_superblock(sb_path)
            self._check_same_layout(layout)
        else:
            self._create(layout)
            self.created = True
        self._choose_o_direct(o_direct)
        self._open_index()
        self._open_data()
        # Mark the store open (not clean) until an orderly close.
        self._write_superblock(dataclasses.replace(self.sb, clean=False))
        self._record_owner()

    # --- lock -----------------------------------------------------------------
    def _lock(self, main: str) -> None:
        path = os.path.join(main, LOCK_NAME)
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StoreLockedError(
                    f"store {main!r} is in use by another process (pid {holder}); "
                    "stop that process or give this one another root_dir"
                ) from exc
            raise
        self._lock_fd = fd

    def _record_owner(self) -> None:
        """Write our pid into the lock file (only once the open succeeded)."""
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)

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
        need_main = sb.superblock_bytes + fmt.align_up(sb.index_bytes)
        for i, d in enumerate(self.dirs):
            need = sb.data_file_bytes + (need_main if i == 0 else 0)
            free = shutil.disk_usage(d).free
            if free < need:
                raise StoreSpaceError(
                    f"{d!r} has {free} bytes free but the store needs {need}; "
                    "lower capacity_bytes or free space on that drive"
                )
        for d in self.dirs:
            self._preallocate(os.path.join(d, DATA_NAME), sb.data_file_bytes)
        self._preallocate(os.path.join(self.dirs[0], INDEX_NAME), fmt.align_up(sb.index_bytes))
        self._write_superblock(sb)

    @staticmethod
    def _preallocate(path: str, size: int) -> None:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, FILE_MODE)
        try:
            os.ftruncate(fd, 0)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise StoreSpaceError(
                        f"preallocating {size} bytes at {path!r} failed: no space left; "
                        "lower capacity_bytes or free space on that drive"
                    ) from exc
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, size)  # filesystem without fallocate (e.g. some tmpfs)
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

    def close(self, clean: bool = True) -> None:
        """Flush, mark the superblock clean (if ``clean``), close every fd."""
        if hasattr(self, "index") and not self.index.closed:
            self.flush_index()
            self.index.close()
        if self._index_fd >= 0:
            os.close(self._index_fd)
            self._index_fd = -1
        for fd in self.data_fds:
            with contextlib.suppress(OSError):
                os.fsync(fd)
            os.close(fd)
        self.data_fds = []
        if clean and self._lock_fd >= 0 and hasattr(self, "sb"):
            with contextlib.suppress(OSError):
                self._write_superblock(dataclasses.replace(self.sb, clean=True))
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def remove(self) -> None:
        """Delete the store's directories (ephemeral mode). Call after close."""
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
