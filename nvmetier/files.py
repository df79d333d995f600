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

import numpy as np

from nvmetier import format as fmt
from nvmetier.config import DEFAULT_WAYS
from nvmetier.errors import ConfigError, FormatError, StoreLockedError, StoreSpaceError

logger = logging.getLogger(__name__)

SUPERBLOCK_NAME = "superblock"
INDEX_NAME = "index"
DATA_NAME = "data"
LOCK_NAME = "lock"
INIT_LOCK_NAME = "lock.init"
TABLE_NAME = "table"
DIR_MODE = 0o700
FILE_MODE = 0o600
O_DIRECT = getattr(os, "O_DIRECT", 0)
_MAX_LOGGED_DROPS = 20


def _lock_file(directory: str, name: str, how: int) -> int:
    """Open ``directory/name`` and flock it (blocking); returns the fd."""
    fd = os.open(os.path.join(directory, name), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, FILE_MODE)
    try:
        fcntl.flock(fd, how)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _unlock_file(fd: int) -> None:
    if fd >= 0:
        os.close(fd)  # closing the only fd of the open file drops its flock


def _fallocate(fd: int, size: int, path: str) -> None:
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
    """Whether any process holds the store's ``lock`` (attached, or exclusive).
    A probe: the lock is released at once, so it never keeps a process out.

    Raises:
        OSError: the lock file exists but cannot be opened.
    """
    try:
        fd = os.open(os.path.join(store_dir, LOCK_NAME), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False  # never opened by any process
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)  # drops the probe's lock, if it got one


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
            self.dirs.append(os.path.join(root, store_name))
        main = self.dirs[0]
        sb_path = os.path.join(main, SUPERBLOCK_NAME)
        exists = os.path.exists(sb_path)
        if not exists and not create:
            raise FormatError(f"{main!r} is not an nvmetier store (no superblock)")
        for d in self.dirs:
            _ensure_dir(d, "store directory")
        self._init_fd = _lock_file(main, INIT_LOCK_NAME, fcntl.LOCK_EX)
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
            os.ftruncate(fd, 0)
            _fallocate(fd, size, path)
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
            self.table.load(np.ascontiguousarray(rebuild, dtype=np.int64), unclean)
        self.table.attach()

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
        for slot, reason in scan.bad[:_MAX_LOGGED_DROPS]:
            logger.warning("nvmetier: dropping index record of slot %d: %s", slot, reason)
        if len(scan.bad) > _MAX_LOGGED_DROPS:
            logger.warning("nvmetier: dropped %d index records at open in all", len(scan.bad))
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

    def close(self, clean: bool = True) -> bool:
        """Detach; the last sharer also sweeps the table and, when ``clean``,
        marks the superblock clean. Closes every fd.

        Returns:
            True when this process was the last one attached (nobody else
            holds the store now).
        """
        last = False
        init_fd = -1
        if self._lock_fd >= 0 and self.table is not None and self.dirs:
            # Serialize with opens: no process attaches while we decide.
            with contextlib.suppress(OSError):
                init_fd = _lock_file(self.dirs[0], INIT_LOCK_NAME, fcntl.LOCK_EX)
        try:
            if self.table is not None:
                self.table.detach()
            if self._lock_fd >= 0:
                try:
                    fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    last = True
                except OSError:
                    last = False
            if last and self.table is not None:
                self.table.sweep()
            if hasattr(self, "index") and not self.index.closed:
                self.flush_index()
            for fd in self.data_fds:
                with contextlib.suppress(OSError):
                    os.fsync(fd)
            if last and clean and self.table is not None:
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
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1
        finally:
            _unlock_file(init_fd)
        return last

    def remove(self) -> None:
        """Delete the store's directories (ephemeral mode). Call after close."""
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
