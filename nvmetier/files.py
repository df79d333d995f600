"""Files of one open store: the mapped index, the mapped shared slot table and
the preallocated data files (one per root directory, one per drive), and this
process's attachment to the store (``nvmetier._table.Table``).

Owns: every fd of an open store, the mappings of its index and table, and the
table's rebuild from the records when this process is the first attached.
Called on the constructing thread (open/create, blocking, may take seconds to
preallocate) and at shutdown. The layers below it (lower never import
higher): ``store_dir`` (names, directories, filesystem and O_DIRECT checks),
``locks`` (``lock.init`` and ``lock``: the sharing protocol),
``superblock`` (reading, checking, durably writing it), ``prealloc``
(allocating every block of a new file) and ``reclaim``
(private stores, removal). Their public names are re-exported here, where
callers and tests have always imported them.

A child forked without exec closes its copies of every store fd at once
(``_forget_stores_in_child``): those fds share the parent's open file
descriptions, so a child that kept them would hold the parent's flock and
registry lock for its whole life, and a dead parent would look alive.
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
import shutil
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from nvmetier import budget, locks, store_dir
from nvmetier import format as fmt
from nvmetier.crashsim import hook
from nvmetier.errors import ConfigError, FormatError, StoreLockedError, StoreSpaceError
from nvmetier.locks import (
    INIT_LOCK_TIMEOUT_S,
    InitLockTimeout,
    _lock_init,
    _lock_init_fd,
    _unlock_file,
    holders,
    mark_init_busy,
    sharer_pids,
    sharers,
    store_held,
)
from nvmetier.memory import advise
from nvmetier.prealloc import preallocate, preallocate_mapped
from nvmetier.reclaim import (
    PRIVATE_TAG,
    _remove_dirs,
    private_store_name,
    reclaim_private_stores,
    stores_of_other_formats,
)
from nvmetier.store_dir import (
    DATA_NAME,
    DIR_MODE,
    FILE_MODE,
    INDEX_NAME,
    INIT_LOCK_NAME,
    LOCK_NAME,
    NETWORK_FILESYSTEMS,
    NO_RESERVE_FILESYSTEMS,
    O_DIRECT,
    OVERLAYFS,
    PROBE_PREFIX,
    REMOVING_TAG,
    SUPERBLOCK_NAME,
    TABLE_NAME,
    _ensure_dir,
    check_filesystem,
    fs_type,
    probe_o_direct,
    statfs_type,
)
from nvmetier.superblock import Layout, check_same_layout, read_superblock, write_superblock

# Re-exported: callers and tests import these from here (``fs_type`` and
# ``INIT_LOCK_TIMEOUT_S`` are read at call time from ``store_dir`` and
# ``locks``: patch them there).
__all__ = [
    "DATA_NAME",
    "DIR_MODE",
    "FILE_MODE",
    "INDEX_NAME",
    "INIT_LOCK_NAME",
    "INIT_LOCK_TIMEOUT_S",
    "LOCK_NAME",
    "NETWORK_FILESYSTEMS",
    "NO_RESERVE_FILESYSTEMS",
    "OVERLAYFS",
    "O_DIRECT",
    "PRIVATE_TAG",
    "PROBE_PREFIX",
    "REMOVING_TAG",
    "SUPERBLOCK_NAME",
    "TABLE_NAME",
    "InitLockTimeout",
    "Layout",
    "StoreFiles",
    "check_filesystem",
    "check_same_layout",
    "fs_type",
    "holders",
    "mark_init_busy",
    "private_store_name",
    "probe_o_direct",
    "read_superblock",
    "reclaim_private_stores",
    "release_free_memory",
    "sharer_pids",
    "sharers",
    "statfs_type",
    "store_held",
    "stores_of_other_formats",
    "write_superblock",
]

logger = logging.getLogger(__name__)

_MAX_LOGGED_DROPS = 20
# Test-only (issue 31): the planted bug the crash explorer must find.
_CLEAN_BEFORE_SYNC = hook.planted("clean-before-sync")


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


# Every StoreFiles of this process that may hold fds (weakly: a store that is
# gone needs nothing), for the fork hook below.
_open_stores: weakref.WeakSet[StoreFiles] = weakref.WeakSet()


def _forget_stores_in_child() -> None:
    """``os.fork`` hook, in the child: drop every store fd inherited.

    First the fds each store holds, then any other fd on a store's lock
    files: a fork while another thread was opening or closing a store (its
    fd opened, not yet kept in the object; a ``lock.init`` wait) leaves one
    that only that thread, absent in the child, knew. Nothing else in the
    child refers to such an fd. The mapped index and table keep their own
    fds (the mappings' own, closed with them): they hold no lock."""
    stores = list(_open_stores)
    for files in stores:
        files._forget_after_fork()
    locks = {
        os.path.realpath(os.path.join(f.dirs[0], n))
        for f in stores
        if f.dirs
        for n in (LOCK_NAME, INIT_LOCK_NAME)
    }
    if not locks:
        return
    try:
        fds = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target in locks:
            with contextlib.suppress(OSError):
                os.close(fd)


os.register_at_fork(after_in_child=_forget_stores_in_child)


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
        self._policy = budget.Policy()
        # Stores this open removed to fit the root budget (their names).
        self.removed_for_budget: list[str] = []
        # The capacity_bytes asked when the store was made smaller (None: not).
        self.shrunk_from: int | None = None

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
        policy: budget.Policy | None = None,
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
            policy: the root budget, the floor of a store made smaller and
                the filesystem reserve (``nvmetier.budget``; default: no
                budget stated, the default reserve).

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
        _open_stores.add(self)  # before the first fd: a fork may come mid-open
        layout = Layout(capacity_bytes, chunk_bytes, ways, identity, capacity_per_path)
        self.exclusive = sharing == "process"
        self._row_bytes = row_bytes or chunk_bytes
        self._n_rows, self._lease_ns, self._wipe = n_rows, lease_ns, wipe
        self._watch_timeout_ns = watch_timeout_ns
        if policy is not None:
            self._policy = policy
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
        if create:
            budget.record_stated(roots, self._policy)
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
            budget.touch_last_use(main)
        finally:
            # Forget the number before closing it (here and in close()): a
            # fork in between would otherwise have the child's fork hook
            # close it, by then maybe another thread's new file.
            init_fd, self._init_fd = self._init_fd, -1
            _unlock_file(init_fd)

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
            preallocate_mapped(fd, size, path)
        self.table_map = mmap.mmap(fd, size)
        advise(self.table_map, "MADV_HUGEPAGE")  # 2 MiB pages: a TLB miss less a key
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
        return read_superblock(path)

    def _write_superblock(self, sb: fmt.Superblock) -> None:
        """Write the superblock durably (``superblock.write_superblock``)."""
        write_superblock(self.dirs[0], sb)
        self.sb = sb

    def _check_same_layout(self, layout: Layout) -> None:
        try:
            check_same_layout(self.sb, layout, self.dirs[0], len(self.dirs))
        except ConfigError:
            # A store made smaller under the root budget or the filesystem
            # reserve is the one this configuration asked for.
            if not budget.accepts_shrunk(self.dirs[0], self.sb, layout, self._policy):
                raise
            self.shrunk_from = layout.capacity_bytes

    def _create(self, layout: Layout) -> None:
        """Create the store under the root lock: the budget's admission
        (dead stores giving way, the store made smaller or refused) and the
        filesystem reserve are checked and the files preallocated while no
        other process on these roots can do the same."""
        roots = [os.path.dirname(os.path.normpath(d)) for d in self.dirs]
        name = os.path.basename(os.path.normpath(self.dirs[0]))
        with budget.root_lock(roots):

            def space(d: str) -> tuple[int, int]:
                usage = shutil.disk_usage(d)
                return usage.total, usage.free

            try:
                admission = budget.admit(roots, name, layout, self._policy, space)
            except StoreSpaceError:
                # Refused before any file: the directories made for it go
                # (under lock.init, nobody else attached), not left as clutter.
                _remove_dirs(self.dirs)
                raise
            self.removed_for_budget = [s.name for s in admission.removed]
            self.shrunk_from = admission.shrunk_from
            self._create_locked(admission.layout)

    def _create_locked(self, layout: Layout) -> None:
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
        # Space on every drive was checked by the admission (root lock held).
        budget.clear_shrunk_note(self.dirs[0])
        if self.shrunk_from is not None:
            budget.write_shrunk_note(self.dirs[0], self.shrunk_from, layout.capacity_bytes)
        for d in self.dirs:
            self._preallocate(os.path.join(d, DATA_NAME), sb.data_file_bytes)
        index_path = os.path.join(self.dirs[0], INDEX_NAME)
        self._preallocate(index_path, fmt.align_up(sb.index_bytes), mapped=True)
        # The table too, under the root lock (the open maps it as it is).
        self._preallocate(os.path.join(self.dirs[0], TABLE_NAME), sb.table_bytes, mapped=True)
        # The superblock claims the files: their directory entries (and each
        # store directory's own entry in its root) are durable first, so a
        # power loss never leaves a superblock naming files that are gone.
        for d in self.dirs:
            store_dir.fsync_dir(d)
            store_dir.fsync_dir(os.path.dirname(os.path.normpath(d)))
        self._write_superblock(sb)

    @staticmethod
    def _preallocate(path: str, size: int, mapped: bool = False) -> None:
        preallocate(path, size, mapped)

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
        advise(self.index, "MADV_HUGEPAGE")

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
            rec = hook.recorder
            if rec is not None:
                rec.fsync(os.path.join(self.dirs[0], INDEX_NAME))

    def _forget_after_fork(self) -> None:
        """In a child forked from the process that opened the store: close the
        child's copies of the store's fds, so the parent's locks go with the
        parent.

        A forked fd shares its open file description (and so the flock and
        the OFD registry lock) with the parent's: closing it only drops the
        child's reference and leaves the parent's locks alone, while any
        unlock (``LOCK_UN``, ``F_UNLCK``) would release them for the parent
        too, so nothing here unlocks. The store is then closed for the child:
        ``close()`` does nothing but unmap (no detach, sweep or clean mark:
        those are the parent's), and the Table refuses every call. The
        mappings stay until then (the Table holds them); they hold no lock.
        """
        self.table = None
        fds = [self._lock_fd, self._init_fd, self._index_fd, self._table_fd, *self.data_fds]
        self._lock_fd = self._init_fd = self._index_fd = self._table_fd = -1
        self.data_fds = []
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)

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
                    locks.INIT_LOCK_TIMEOUT_S,
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
            # The clean mark only after the index and the data are synced: a
            # sync that failed leaves the store unclean (the next first opener
            # then checks every record it rebuilds).
            synced = True
            mark = last and clean and not removing and self.table is not None
            if mark and _CLEAN_BEFORE_SYNC:  # the planted bug (tests only)
                with contextlib.suppress(OSError):
                    self._write_superblock(dataclasses.replace(self.sb, clean=True))
                mark = False
            rec = hook.recorder
            if hasattr(self, "index") and not self.index.closed and not removing:
                try:
                    self.index.flush()
                    if rec is not None:
                        rec.fsync(os.path.join(self.dirs[0], INDEX_NAME))
                except (ValueError, OSError):
                    synced = False
            for fd in () if removing else self.data_fds:
                try:
                    os.fsync(fd)
                    if rec is not None:
                        rec.fsync_fd(fd)
                except OSError:
                    synced = False
            if mark and synced:
                with contextlib.suppress(OSError):
                    self._write_superblock(dataclasses.replace(self.sb, clean=True))
            self.table = None
            if hasattr(self, "table_map") and not self.table_map.closed:
                with contextlib.suppress(BufferError):
                    self.table_map.close()
            if hasattr(self, "index") and not self.index.closed:
                with contextlib.suppress(BufferError):
                    self.index.close()
            # Each number forgotten before it is closed (see open()).
            fds = (self._index_fd, self._table_fd)
            self._index_fd = self._table_fd = -1
            for fd in fds:
                if fd >= 0:
                    os.close(fd)
            data_fds, self.data_fds = self.data_fds, []
            for fd in data_fds:
                os.close(fd)
            if removing:
                _remove_dirs(self.dirs)  # still under lock.init: nobody attaches meanwhile
            elif self.dirs and self._lock_fd >= 0:
                budget.touch_last_use(self.dirs[0])
            if self._lock_fd >= 0:
                # Unlock before the close: an io_uring ring that registered
                # this fd (registry_fd) may hold the open file a few ms
                # longer, and a flock goes only with the last reference. A
                # child forked meanwhile closes its copy by its path (the
                # fork hook's scan of lock files).
                lock_fd, self._lock_fd = self._lock_fd, -1
                with contextlib.suppress(OSError):
                    fcntl.flock(lock_fd, fcntl.LOCK_UN)
                os.close(lock_fd)
        finally:
            _unlock_file(init_fd)
        return last
