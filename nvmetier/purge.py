"""``nvmetier purge``: remove chunks from the stores under a root, live.

Owns: the purge of one store (``purge_store``) and of every store under a
root (``purge``), and the purge log that lets attached processes emit the
removals as KV events (``write_log``, ``read_log``). Runs on the CLI's main
thread and blocks (bounded waits only); ``read_log`` is called by an attached
store on vLLM's scheduler thread when it takes its KV events.

How a purge stays safe beside attached processes (docs/architecture.md):

- It joins the store like a sharer for the length of the purge: ``lock``
  flocked shared, taken under ``lock.init`` (waited for at most
  ``INIT_LOCK_TIMEOUT_S``), so no opener rebuilds the table under it and no
  closer believes itself the last one while it runs. It takes no registry
  entry and creates no WRITING slot, so its death leaves nothing to reclaim.
- Each set is changed under its own robust mutex, taken with the same bound
  every sharer uses (``SET_LOCK_WAIT_MS``, then try-only): a stopped sharer
  holding a set costs the purge a retry of that set, for ``BUSY_RETRY_S`` at
  most, then the set is reported not purged (exit 4), never a hang.
- READY and BAD slots are cleared record first, whether or not a lease
  covers them: a load in flight of such a slot fails by its generation (a
  miss, like a load that raced an eviction), never returns purged bytes.
  With ``--all`` a slot being written is marked PURGED: its write completes
  but is never published. With ``--older-than`` a write in flight is newer
  than the cutoff and is kept.
- With no process attached (``lock`` flocked exclusively) the records are
  zeroed directly under ``lock.init``; the next process to attach rebuilds
  the table from them.

The removed keys of an online purge are written to ``purged`` in the store
directory (replaced atomically), then the table's purge generation is
advanced: the first attached process with KV events on that sees the new
generation takes it (compare-and-swap) and emits the keys as ``removed``
events. In a plaintext store a purge only makes chunks unreachable: their
bytes stay in the data file until the slot is reused. In an encrypted store
it erases them (docs/operations.md): ``--all`` destroys every data key (each
epoch's entry in ``keys`` overwritten in place); ``--older-than`` destroys
the epochs whose sealing window ended before the cutoff and overwrites the
nonce and tag of every other removed slot (under its set's lock, so no new
chunk is touched), which no key can decrypt without.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import mmap
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from nvmetier import format as fmt
from nvmetier import recovery
from nvmetier.budget import PURGE_LOG_SLOTS
from nvmetier.crashsim import hook
from nvmetier.errors import FormatError
from nvmetier.files import (
    FILE_MODE,
    INDEX_NAME,
    INIT_LOCK_NAME,
    INIT_LOCK_TIMEOUT_S,
    LOCK_NAME,
    SUPERBLOCK_NAME,
    TABLE_NAME,
    holders,
    mark_init_busy,
)
from nvmetier.purge_log import LOG_NAME, read_log, remove_stale_logs, removed_since, write_log

# The log's format and reader live in ``purge_log`` (the data path reads it
# too); re-exported here, where callers have always found them.
__all__ = [
    "LOG_NAME",
    "PurgeResult",
    "format_result",
    "overall_exit",
    "purge",
    "purge_store",
    "read_log",
    "removed_since",
    "write_log",
]

# Exit codes, in the style of fsck (e2fsck): OR-ed over the stores.
EXIT_OK = 0
EXIT_LEFT = 4  # a store, or some of its sets, could not be purged now
EXIT_OPERATIONAL = 8
EXIT_USAGE = 16

# How long sets held by another process (stopped, or slow) are retried
# before they are reported not purged.
BUSY_RETRY_S = 5.0
# Test-only (issue 31): the planted bug the crash explorer must find.
_PURGE_UNSYNCED = hook.planted("purge-unsynced")
# How long a purge waits for another purge of the same store.
PURGE_LOCK_TIMEOUT_S = 10.0


@dataclasses.dataclass
class PurgeResult:
    """What a purge did to one store.

    Attributes:
        path: the store directory.
        model: the model of its layout identity (None when unreadable).
        removed: chunks removed (slots cleared).
        removed_bytes: their slots' bytes.
        writing_marked: writes in flight whose chunks will not be published.
        writing_kept: writes in flight left (newer than the cutoff).
        busy_sets: sets not purged (held by another process past the bound).
        online: processes were attached (the shared table was purged).
        events_logged: keys written to the purge log for KV events.
        epochs_destroyed: encrypted stores: data keys destroyed (every chunk
            sealed under them is unrecoverable, even with the key file).
        slots_wiped: encrypted stores: removed slots whose nonce and tag were
            overwritten (``--older-than``: chunks in epochs that live on).
        stale_wiped: encrypted stores, ``--older-than``: free slots whose
            nonce and tag were overwritten (chunks invalidated, evicted or
            expired before the purge, whose epoch key may live on).
        error: why the store was not purged (None when it was).
    """

    path: str
    model: str | None = None
    removed: int = 0
    removed_bytes: int = 0
    writing_marked: int = 0
    writing_kept: int = 0
    busy_sets: int = 0
    online: bool = False
    events_logged: int = 0
    epochs_destroyed: int = 0
    slots_wiped: int = 0
    stale_wiped: int = 0
    error: str | None = None

    @property
    def exit_code(self) -> int:
        if self.error is not None:
            return EXIT_LEFT
        return EXIT_LEFT if self.busy_sets else EXIT_OK

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "exit_code": self.exit_code}


class PurgeOperationalError(Exception):
    """ROOT is not something a purge can work on (exit 8)."""


def _flock_bounded(fd: int, op: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _try_flock(fd: int, op: int) -> bool:
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise


# ---------------------------------------------------------------- one store
def purge_store(
    store_dir: str,
    *,
    older_than_s: float | None,
    model: str | None = None,
    busy_retry_s: float = BUSY_RETRY_S,
) -> PurgeResult | None:
    """Purge one store: chunks stored ``older_than_s`` ago or longer, or
    every chunk when ``older_than_s`` is None.

    Returns None when ``model`` is given and the store is another model's.
    Never raises for a store that cannot be purged: ``error`` says why.
    """
    out = PurgeResult(path=store_dir)
    sb_path = os.path.join(store_dir, SUPERBLOCK_NAME)
    try:
        with open(sb_path, "rb") as f:
            sb = fmt.unpack_superblock(f.read(), where=sb_path)
    except (OSError, FormatError) as exc:
        out.error = f"{exc.strerror} ({sb_path!r})" if isinstance(exc, OSError) else str(exc)
        return out if model is None else None
    name = sb.identity.get("model_name", sb.identity.get("model"))  # vLLM's identity: model_name
    out.model = None if name is None else str(name)
    if model is not None and out.model != model:
        return None
    try:
        dir_fd = os.open(store_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        out.error = f"{store_dir!r}: {exc.strerror}"
        return out
    try:
        # One purge of a store at a time (the log and its generation).
        if not _flock_bounded(dir_fd, fcntl.LOCK_EX, PURGE_LOCK_TIMEOUT_S):
            out.error = (
                f"another nvmetier purge of this store ran for over {PURGE_LOCK_TIMEOUT_S:g} s; "
                "wait for it and run this one again"
            )
            return out
        remove_stale_logs(store_dir)
        _purge_locked(store_dir, sb, older_than_s, out, busy_retry_s)
    except OSError as exc:
        out.error = f"{exc.filename or store_dir!r}: {exc.strerror}"
    finally:
        os.close(dir_fd)
    out.removed_bytes = out.removed * sb.slot_bytes
    return out


def _purge_locked(
    store_dir: str,
    sb: fmt.Superblock,
    older_than_s: float | None,
    out: PurgeResult,
    busy_retry_s: float,
) -> None:
    init_fd = os.open(
        os.path.join(store_dir, INIT_LOCK_NAME), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, FILE_MODE
    )
    lock_fd = -1
    try:
        if not _flock_bounded(init_fd, fcntl.LOCK_EX, INIT_LOCK_TIMEOUT_S):
            out.error = (
                f"a process has held {INIT_LOCK_NAME} for over {INIT_LOCK_TIMEOUT_S:g} s "
                f"(attached: {holders(store_dir)}): one stopped or hung while opening or "
                "closing the store; resume or kill it, then purge again"
            )
            return
        mark_init_busy(init_fd)
        if not os.path.exists(os.path.join(store_dir, SUPERBLOCK_NAME)):
            out.error = "the store was removed meanwhile (its last process closed it)"
            return
        lock_fd = os.open(
            os.path.join(store_dir, LOCK_NAME), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, FILE_MODE
        )
        if _try_flock(lock_fd, fcntl.LOCK_EX):
            # Nobody attached (and none can attach: lock.init is ours): the
            # records are the whole truth; the next opener rebuilds from them.
            _purge_offline(store_dir, sb, older_than_s, out)
            return
        if not _try_flock(lock_fd, fcntl.LOCK_SH):
            out.error = (
                f"held exclusively by pid {holders(store_dir)} (sharing: 'process', or "
                "fsck --repair): not purged; stop that process, or purge once it is gone"
            )
            return
        out.online = True
        # Attached like a sharer: no opener rebuilds the table from here on.
        os.close(init_fd)
        init_fd = -1
        _purge_online(store_dir, sb, lock_fd, older_than_s, out, busy_retry_s)
    finally:
        if lock_fd >= 0:
            os.close(lock_fd)
        if init_fd >= 0:
            os.close(init_fd)


def _record_msync(store_dir: str) -> None:
    rec = hook.recorder
    if rec is not None:
        rec.fsync(os.path.join(store_dir, INDEX_NAME))


def _map(path: str, size: int) -> tuple[int, mmap.mmap]:
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size < size:
            raise FormatError(f"{path!r} is shorter than the store's geometry; run nvmetier fsck")
        return fd, mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise


def _is_sealed(sb: fmt.Superblock) -> bool:
    return "encryption" in sb.identity


def wipe_range(sb: fmt.Superblock) -> tuple[int, int]:
    """What a purge overwrites of a removed sealed slot: from the page that
    holds the trailer (its nonce and tag) to the slot's end, page aligned
    (``(offset, nbytes)`` within the slot). Without its nonce and its tag a
    chunk's ciphertext cannot be decrypted even with its epoch's key."""
    from nvmetier.engine.sealed import TRAILER_BYTES

    start = (sb.chunk_bytes - TRAILER_BYTES) // fmt.ALIGN_BYTES * fmt.ALIGN_BYTES
    return start, sb.slot_bytes - start


def _data_fds(store_dir: str, sb: fmt.Superblock) -> list[int] | None:
    """The data files to overwrite in (buffered), or None with several
    drives (their paths are not recorded in the store: erased by key only)."""
    if sb.n_paths != 1:
        return None
    return [os.open(os.path.join(store_dir, "data"), os.O_RDWR | os.O_CLOEXEC)]


def _destroy_epochs(store_dir: str, older_than_s: float | None) -> int:
    """Destroy every epoch key (``--all``) or those whose sealing window
    ended before the cutoff: no chunk sealed under them survives this purge."""
    from nvmetier.keyring import Keyring

    if not Keyring.exists(store_dir):
        return 0
    ring = Keyring.open(store_dir)
    try:
        if older_than_s is None:
            return len(ring.destroy_where(lambda e: True))
        cutoff = time.time_ns() - int(older_than_s * 1e9)
        return len(ring.destroy_where(lambda e: e.seal_until_ns < cutoff))
    finally:
        ring.close()


def _purge_offline(
    store_dir: str, sb: fmt.Superblock, older_than_s: float | None, out: PurgeResult
) -> None:
    fd, index = _map(os.path.join(store_dir, INDEX_NAME), sb.index_bytes)
    try:
        scan = recovery.scan_index(index, sb.n_slots, sb.ways, with_keys=False)
        slots = scan.slots
        if older_than_s is not None:
            now = time.time_ns()
            age = now - scan.stored_ns.astype(np.int64)
            horizon = -3600 * 10**9  # a stamp over an hour ahead has no known age
            slots = slots[(age >= int(older_than_s * 1e9)) | (age < horizon)]
        empty = bytes(fmt.RECORD_BYTES)
        for s in slots.tolist():
            index[s * fmt.RECORD_BYTES : (s + 1) * fmt.RECORD_BYTES] = empty
        index.flush()
        _record_msync(store_dir)
        out.removed = len(slots)
        if _is_sealed(sb):
            if older_than_s is not None:
                out.slots_wiped = _wipe_offline(store_dir, sb, slots.tolist())
                out.stale_wiped = _wipe_stale_offline(store_dir, sb, scan.slots.tolist())
            out.epochs_destroyed = _destroy_epochs(store_dir, older_than_s)
        del scan, slots
    finally:
        index.close()
        os.close(fd)


def _wipe_offline(store_dir: str, sb: fmt.Superblock, slots: list[int]) -> int:
    fds = _data_fds(store_dir, sb)
    if fds is None:
        return 0
    start, n = wipe_range(sb)
    zeros = bytes(n)
    try:
        for s in slots:
            if os.pwrite(fds[0], zeros, s * sb.slot_bytes + start) != n:
                raise OSError(errno.EIO, "short write wiping a purged slot")
        os.fsync(fds[0])
        if hook.recorder is not None:
            hook.recorder.fsync_fd(fds[0])
    finally:
        os.close(fds[0])
    return len(slots)


def _wipe_stale_offline(store_dir: str, sb: fmt.Superblock, held: list[int]) -> int:
    """Overwrite the nonce and tag of every slot no record names (``held``:
    the slots that had one before the purge, wiped already or kept): a
    chunk invalidated, evicted or expired before the purge left its sealed
    image there, and its epoch key may live on for newer chunks. Only
    ranges that are not zero are written."""
    fds = _data_fds(store_dir, sb)
    if fds is None:
        return 0
    start, n = wipe_range(sb)
    zeros = bytes(n)
    taken = set(held)
    wiped = 0
    try:
        for s in range(sb.n_slots):
            if s in taken:
                continue
            at = s * sb.slot_bytes + start
            if os.pread(fds[0], n, at).count(0) == n:
                continue
            if os.pwrite(fds[0], zeros, at) != n:
                raise OSError(errno.EIO, "short write wiping a free slot")
            wiped += 1
        if wiped:
            os.fsync(fds[0])
            if hook.recorder is not None:
                hook.recorder.fsync_fd(fds[0])
    finally:
        os.close(fds[0])
    return wiped


def _purge_online(
    store_dir: str,
    sb: fmt.Superblock,
    lock_fd: int,
    older_than_s: float | None,
    out: PurgeResult,
    busy_retry_s: float,
) -> None:
    import nvmetier._table as _table

    tfd, table_map = _map(os.path.join(store_dir, TABLE_NAME), sb.table_bytes)
    ifd, index = _map(os.path.join(store_dir, INDEX_NAME), sb.index_bytes)
    table: Any = None
    try:
        head = _table.header(table_map)
        if not head["valid"]:
            out.error = f"the table is not valid ({head['problem']}): not purged"
            return
        table = _table.Table(
            table_map,
            index,
            lock_fd,
            n_paths=sb.n_paths,
            slot_bytes=sb.slot_bytes,
            row_bytes=sb.chunk_bytes,
            n_rows=0,
            lease_ns=1_000_000,
            watch_timeout_ns=1_000_000,
        )
        older_ns = 0 if older_than_s is None else int(older_than_s * 1e9)
        every = older_than_s is None
        keys: list[bytes] | None = []
        sets: list[int] | None = None
        deadline = time.monotonic() + busy_retry_s
        sealed = _is_sealed(sb)
        fds = _data_fds(store_dir, sb) if sealed and not every else None
        wipe = None if fds is None else (fds, sb.slot_bytes, *wipe_range(sb))
        while True:
            if wipe is None:
                got, cleared, marked, kept, busy = table.purge(older_ns, every, sets)
            else:
                got, cleared, marked, kept, busy, wiped, wipe_errors, stale = table.purge(
                    older_ns, every, sets, wipe
                )
                out.slots_wiped += wiped
                out.stale_wiped += stale
                if wipe_errors:
                    out.error = f"{wipe_errors} purged slots could not be overwritten (I/O error)"
            out.removed += cleared
            out.writing_marked += marked
            out.writing_kept += kept
            keys = None if got is None or keys is None else keys + got
            if not busy or time.monotonic() >= deadline:
                out.busy_sets = len(busy)
                break
            sets = busy
            time.sleep(0.1)
        if not _PURGE_UNSYNCED:
            index.flush()  # durable: a power loss does not bring purged records back
            _record_msync(store_dir)
        if fds is not None:
            for fd in fds:
                os.fsync(fd)
                if hook.recorder is not None:
                    hook.recorder.fsync_fd(fd)
                os.close(fd)
            fds = None
        if sealed:
            out.epochs_destroyed = _destroy_epochs(store_dir, older_than_s)
            table.bump_keys()  # sharers reload: one whose epoch is gone starts a new one
        if keys:
            gen, taken = table.purge_generation()
            if taken < gen:  # the previous purge's events are not taken yet: keep them
                first, _last, old = read_log(store_dir)
                keys = old + keys
                # Bounded (the root budget charges a store its log at this
                # size): the newest removals are kept.
                keys = keys[-max(1, PURGE_LOG_SLOTS * sb.n_slots) :]
            else:
                first = gen + 1
            write_log(store_dir, first, gen + 1, keys)
            table.bump_purge()
            out.events_logged = len(keys)
    finally:
        for fd in fds or ():
            os.close(fd)
        del table
        index.close()
        table_map.close()
        os.close(ifd)
        os.close(tfd)


# ----------------------------------------------------------------- a root
def purge(root: str, *, older_than_s: float | None, model: str | None = None) -> list[PurgeResult]:
    """Purge every store under ``root`` (a root_dir, or one store directory),
    or only those of ``model``.

    Raises:
        PurgeOperationalError: ROOT is not a root_dir or a store, or no store
            of ``model`` is under it.
    """
    from nvmetier.fsck import FsckOperationalError, find_stores

    try:
        stores = find_stores(root)
    except FsckOperationalError as exc:
        raise PurgeOperationalError(str(exc)) from exc
    results = []
    for store_dir in stores:
        r = purge_store(store_dir, older_than_s=older_than_s, model=model)
        if r is not None:
            results.append(r)
    if model is not None and not results:
        raise PurgeOperationalError(
            f"no store of model {model!r} under {root!r}; 'nvmetier info {root}' lists the "
            "stores and their models"
        )
    return results


def format_result(r: PurgeResult) -> str:
    """Human-readable lines for one store."""
    from nvmetier.config import format_size

    head = f"{r.path} ({r.model or 'unknown model'})"
    if r.error is not None:
        return f"{head}: not purged: {r.error}"
    lines = [
        f"{head}: removed {r.removed} chunks ({format_size(r.removed_bytes)})"
        + ("" if r.online else ", no process attached")
    ]
    if r.writing_marked:
        lines.append(f"  {r.writing_marked} writes in flight will not be published")
    if r.writing_kept:
        lines.append(f"  {r.writing_kept} writes in flight kept (newer than the cutoff)")
    if r.busy_sets:
        lines.append(
            f"  {r.busy_sets} sets not purged: held by a stopped or hung process "
            f"(attached: {holders(r.path)}); resume or kill it, then purge again"
        )
    if r.events_logged:
        lines.append(f"  {r.events_logged} removals logged for KV events")
    if r.epochs_destroyed or r.slots_wiped or r.stale_wiped:
        stale = f" (and {r.stale_wiped} free slots' of earlier chunks)" if r.stale_wiped else ""
        lines.append(
            f"  erased: {r.epochs_destroyed} data keys destroyed, {r.slots_wiped} slots' "
            f"nonces and tags overwritten{stale}"
        )
    return "\n".join(lines)


def overall_exit(results: Sequence[PurgeResult]) -> int:
    code = 0
    for r in results:
        code |= r.exit_code
    return code
