"""The root budget: one bound on the disk every store under a ``root_dir``
occupies, the filesystem reserve, and the give-way policy that makes room.

Owns every file write the budget makes, so that a crash explorer can hook
them here: the root-level record ``budget`` (``write_budget``: temp file,
fsync, rename, directory fsync), the root lock (``root_lock``: an exclusive
flock on the root directory itself, held around every store creation's check
and preallocation, and around ``nvmetier budget --set``), the removal of the
stores that give way (``give_way``, through ``reclaim._remove_dirs``), the
``shrunk`` note of a store made smaller than asked, and the last-use stamp
of a store (``touch_last_use``).

What counts: the allocated blocks (``st_blocks * 512``) of every file and
directory under the root, the record included. A store is
charged the larger of what it occupies now and what it may come to occupy
(its preallocated files, its keyring and purge log at their largest, a
little slack: ``store_charge``), so stores that grow their small files
after creation never carry the root past the budget.

Liveness: a store is live while any process holds it (attached, or opening,
closing, purging or repairing it): its ``lock.init`` or ``lock`` cannot be
taken. A store gives way only when both are taken without waiting, so a
stopped process (SIGSTOP, ``docker pause``) keeps its store, and nothing
ever waits on another process here past ``ROOT_LOCK_TIMEOUT_S``.

Lock order: a store's ``lock.init`` (the opener's own), then the root lock,
then other stores' ``lock.init`` taken without waiting. No cycle can form.

Threads: the constructing thread (a store open), the CLI's main thread; it
blocks (bounded). ``root_usage_cached`` is called from ``BlockStore.stats``
(vLLM's scheduler thread): a few ``stat`` calls at most every
``USAGE_REFRESH_S``, never a lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from nvmetier import format as fmt
from nvmetier.config import TierConfig, format_size
from nvmetier.errors import ConfigError, FormatError, StoreLockedError, StoreSpaceError
from nvmetier.locks import _is_linked, mark_init_busy, sharer_pids
from nvmetier.reclaim import _remove_dirs
from nvmetier.store_dir import (
    FILE_MODE,
    INIT_LOCK_NAME,
    LOCK_NAME,
    REMOVING_TAG,
    SUPERBLOCK_NAME,
    TABLE_NAME,
    fsync_dir,
)
from nvmetier.superblock import Layout

logger = logging.getLogger(__name__)

BUDGET_NAME = "budget"  # the root-level record (docs/format.md, "Root budget")
SHRUNK_NAME = "shrunk"  # in a store made smaller than its capacity_bytes
BUDGET_FORMAT = "nvmetier-root-budget"
BUDGET_VERSION = 1
# How long a store creation waits for another process's hold of the root
# lock (it creates a store, or changes the budget): holds last as long as a
# preallocation; a holder stopped or hung would hold it for ever.
ROOT_LOCK_TIMEOUT_S = float(os.environ.get("NVMETIER_ROOT_LOCK_TIMEOUT_S", "60"))
# Small files a store may add after its creation (probe files, temporary
# superblock and purge logs' directory blocks, ...), charged to every store.
STORE_SLACK_BYTES = 256 << 10
# The purge log keeps at most this many keys per slot of the store (purge.py).
PURGE_LOG_SLOTS = 1
PURGE_LOG_ENTRY_BYTES = 96
PURGE_LOG_HEAD_BYTES = 32
# Defaults of the config keys (TierConfig): the floor of a store made
# smaller, as a fraction of capacity_bytes, and the filesystem reserve.
DEFAULT_MIN_CAPACITY_FRACTION = 0.25
DEFAULT_FS_RESERVE_BYTES = 1 << 30
DEFAULT_FS_RESERVE_FRACTION = 0.05
USAGE_REFRESH_S = 5.0

# Test hook: free space of a directory, ``(total_bytes, free_bytes)`` where
# free is what an unprivileged writer may use (statvfs f_bavail).
SpaceFn = Callable[[str], tuple[int, int]]


def fs_space(path: str) -> tuple[int, int]:
    usage = shutil.disk_usage(path)
    return usage.total, usage.free


# ---------------------------------------------------------------- the policy
@dataclasses.dataclass(frozen=True)
class Policy:
    """What a process states about the root (from its ``TierConfig``).

    Attributes:
        budget_bytes: ``root_budget_bytes`` (None: none stated; the recorded
            budget, if any, still applies).
        min_capacity_bytes: the smallest store this process accepts when the
            budget or the filesystem reserve leaves less than its
            ``capacity_bytes`` (None: ``DEFAULT_MIN_CAPACITY_FRACTION`` of it).
        fs_reserve_bytes, fs_reserve_fraction: free space a creation leaves
            on the filesystem: the larger of the two. ``fs_reserve_bytes``
            None: ``DEFAULT_FS_RESERVE_BYTES``, or half the filesystem when
            that is smaller (a small dedicated volume is not left unusable).
    """

    budget_bytes: int | None = None
    min_capacity_bytes: int | None = None
    fs_reserve_bytes: int | None = None
    fs_reserve_fraction: float = DEFAULT_FS_RESERVE_FRACTION

    @classmethod
    def from_config(cls, cfg: TierConfig) -> Policy:
        return cls(
            cfg.root_budget_bytes,
            cfg.min_capacity_bytes,
            cfg.fs_reserve_bytes,
            cfg.fs_reserve_fraction,
        )

    def floor_bytes(self, capacity_bytes: int) -> int:
        if self.min_capacity_bytes is not None:
            return min(self.min_capacity_bytes, capacity_bytes)
        return int(capacity_bytes * DEFAULT_MIN_CAPACITY_FRACTION)

    def reserve_bytes(self, total_bytes: int) -> int:
        least = self.fs_reserve_bytes
        if least is None:
            least = min(DEFAULT_FS_RESERVE_BYTES, total_bytes // 2)
        return max(least, int(total_bytes * self.fs_reserve_fraction))


# ---------------------------------------------------------------- the record
def budget_path(root: str) -> str:
    return os.path.join(root, BUDGET_NAME)


def read_budget(root: str) -> int | None:
    """The budget recorded with ``root`` (None: none recorded).

    Raises:
        ConfigError: the record exists but is not one (edited by hand, or
            bit rot): names the file and the fix.
    """
    path = budget_path(root)
    try:
        with open(path, "rb") as f:
            raw = f.read(4096)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"root budget record {path!r} cannot be read: {exc.strerror}") from exc
    try:
        doc = json.loads(raw)
        ok = (
            isinstance(doc, dict)
            and doc.get("format") == BUDGET_FORMAT
            and doc.get("version") == BUDGET_VERSION
            and isinstance(doc.get("budget_bytes"), int)
            and not isinstance(doc["budget_bytes"], bool)
            and doc["budget_bytes"] > 0
        )
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(
            f"root budget record {path!r} is not valid ({raw[:80]!r}); record the budget "
            f"again with `nvmetier budget {root} --set SIZE` (or --unset)"
        )
    return int(doc["budget_bytes"])


def write_budget(root: str, budget_bytes: int | None) -> None:
    """Record ``budget_bytes`` with ``root`` durably (None removes the
    record): a temporary file, its fsync, a rename over the old record, then
    an fsync of ``root``. A crash leaves the old record or the new one (and
    at most a ``budget.tmp-PID`` file, removed by the next write). Call with
    the root lock held.

    Raises:
        OSError: a step failed; the old record may still be the one on disk.
    """
    path = budget_path(root)
    for name in os.listdir(root):
        if name.startswith(f"{BUDGET_NAME}.tmp-"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(root, name))
    if budget_bytes is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        fsync_dir(root)
        return
    doc = {
        "format": BUDGET_FORMAT,
        "version": BUDGET_VERSION,
        "budget_bytes": int(budget_bytes),
        "recorded_ns": time.time_ns(),
    }
    data = (json.dumps(doc, sort_keys=True) + "\n").encode()
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY | os.O_CLOEXEC, FILE_MODE)
    try:
        if os.write(fd, data) != len(data):
            raise OSError(errno.EIO, "short write of the root budget record")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(root)


def _mismatch(root: str, recorded: int, stated: int) -> ConfigError:
    return ConfigError(
        f"root_budget_bytes={stated} ({format_size(stated)}) differs from the budget recorded "
        f"with root_dir {root!r}: {recorded} ({format_size(recorded)}), which every store "
        f"under it shares; set root_budget_bytes to {recorded} (or leave it out to follow the "
        f"record), or change the record first: `nvmetier budget {root} --set "
        f"{format_size(stated).replace(' ', '')}`"
    )


def check_stated(roots: Sequence[str], policy: Policy) -> None:
    """Refuse a stated budget that differs from a root's record (lock-free:
    the record is replaced atomically).

    Raises:
        ConfigError: naming both values and the fix.
    """
    if policy.budget_bytes is None:
        return
    for root in roots:
        recorded = read_budget(root)
        if recorded is not None and recorded != policy.budget_bytes:
            raise _mismatch(root, recorded, policy.budget_bytes)


def effective_budget(root: str, policy: Policy) -> int | None:
    """The budget that binds ``root``: the record, else the stated one,
    which is then recorded. Call with the root lock held.

    Raises:
        ConfigError: a stated budget differs from the record.
    """
    recorded = read_budget(root)
    if policy.budget_bytes is None:
        return recorded
    if recorded is None:
        write_budget(root, policy.budget_bytes)
        logger.info(
            "nvmetier: recorded root budget %s with %s",
            format_size(policy.budget_bytes),
            root,
        )
        return policy.budget_bytes
    if recorded != policy.budget_bytes:
        raise _mismatch(root, recorded, policy.budget_bytes)
    return recorded


# ------------------------------------------------------------------ the lock
@contextlib.contextmanager
def root_lock(roots: Sequence[str], timeout_s: float | None = None) -> Iterator[None]:
    """Hold the root lock of every root: an exclusive flock on the root
    directory itself (no file to leave behind), taken in path order so two
    processes with overlapping roots never wait on each other in a cycle,
    each waited for at most ``timeout_s`` (default ``ROOT_LOCK_TIMEOUT_S``).

    Raises:
        StoreLockedError: another process held one past the bound.
    """
    from nvmetier.locks import InitLockTimeout, _flock_bounded

    bound = ROOT_LOCK_TIMEOUT_S if timeout_s is None else timeout_s
    fds: list[int] = []
    try:
        for root in sorted({os.path.realpath(r) for r in roots}):
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            fds.append(fd)
            try:
                _flock_bounded(fd, bound)
            except InitLockTimeout:
                raise StoreLockedError(
                    f"root_dir {root!r}: its root lock was held by another process for over "
                    f"{bound:g} s; a process creates a store or changes the root budget there, "
                    "or is stopped (SIGSTOP, docker pause) or hung doing so: resume or kill it "
                    "(`nvmetier budget` shows the processes using each store), then start again"
                ) from None
        yield
    finally:
        for fd in reversed(fds):
            os.close(fd)


# ----------------------------------------------------------------- the usage
def allocated_bytes(path: str) -> int:
    """``st_blocks * 512`` of ``path`` and, for a directory, everything
    below it (what ``du`` counts). A file removed meanwhile counts 0."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    total = st.st_blocks * 512
    if not os.path.isdir(path) or os.path.islink(path):
        return total
    with contextlib.suppress(OSError), os.scandir(path) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                total += allocated_bytes(entry.path)
            else:
                with contextlib.suppress(OSError):
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


def store_charge(sb: fmt.Superblock) -> list[int]:
    """What a store of superblock ``sb`` may come to occupy, per root (its
    main root first): superblock (twice: rewritten through a temporary
    file), lock files, directories, index, table, data files, its keyring
    at its largest (sealed), its purge log at its largest (twice: replaced
    through a temporary file), and ``STORE_SLACK_BYTES``."""
    meta = fmt.reserved_bytes(sb.identity, 1) + fmt.align_up(sb.index_bytes) + sb.table_bytes
    if "encryption" in sb.identity:
        from nvmetier.crypto import KEYRING_BYTES

        meta += fmt.align_up(KEYRING_BYTES)
    log = PURGE_LOG_HEAD_BYTES + PURGE_LOG_SLOTS * sb.n_slots * PURGE_LOG_ENTRY_BYTES
    meta += 2 * fmt.align_up(log) + STORE_SLACK_BYTES
    data = fmt.align_up(sb.data_file_bytes)
    return [meta + data] + [data + fmt.ALIGN_BYTES] * (sb.n_paths - 1)


def layout_charge(layout: Layout, n_paths: int) -> list[int]:
    """``store_charge`` of the store ``layout`` would create over ``n_paths`` roots.

    Raises:
        FormatError: the layout holds no complete set.
    """
    ways, slot_bytes, n_slots = layout.geometry(n_paths)
    sb = fmt.Superblock(
        chunk_bytes=layout.chunk_bytes,
        slot_bytes=slot_bytes,
        n_slots=n_slots,
        ways=ways,
        n_paths=n_paths,
        created_ns=0,
        identity=layout.identity,
    )
    return store_charge(sb)


@dataclasses.dataclass
class Share:
    """One entry of a root and what it holds against the budget.

    Attributes:
        name: the entry's name under the root.
        kind: ``store`` (a superblock), ``incomplete`` (a store's main
            directory without a superblock: being created, or a creation
            killed), ``removing`` (a removal killed midway), ``part`` (a
            striped store's data directory, or anything else nvmetier did
            not make) or ``root`` (the budget record and lock).
        disk_bytes: allocated bytes now (``du``).
        charge_bytes: what it counts against the budget
            (``max(disk_bytes, store_charge)`` for a store).
        last_use_ns: the latest open, close or write (wall clock).
        pids: processes attached.
        live: held by a process (attached, opening, closing, purging).
        model: the model of the store's layout identity.
        n_paths: roots the store spans.
        capacity_bytes: data bytes of the store.
    """

    name: str
    path: str
    kind: str
    disk_bytes: int = 0
    charge_bytes: int = 0
    last_use_ns: int = 0
    pids: list[int] = dataclasses.field(default_factory=list)
    live: bool = False
    model: str | None = None
    n_paths: int = 1
    capacity_bytes: int = 0

    def to_json(self, budget_bytes: int | None) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["share_of_budget_pct"] = (
            None if not budget_bytes else round(100.0 * self.disk_bytes / budget_bytes, 2)
        )
        return out


def last_use_ns(store_dir: str) -> int:
    """When the store was last opened, closed or written: the latest mtime of
    its lock (stamped at every open and close), table, superblock and index."""
    latest = 0
    for name in (LOCK_NAME, TABLE_NAME, SUPERBLOCK_NAME, "index", INIT_LOCK_NAME):
        with contextlib.suppress(OSError):
            latest = max(latest, os.stat(os.path.join(store_dir, name)).st_mtime_ns)
    if not latest:
        with contextlib.suppress(OSError):
            latest = os.stat(store_dir).st_mtime_ns
    return latest


def touch_last_use(store_dir: str) -> None:
    """Stamp the store used now (its ``lock`` file's mtime): at every open
    and close, so the least recently used store is the one to give way."""
    with contextlib.suppress(OSError):
        os.utime(os.path.join(store_dir, LOCK_NAME))


def _held(store_dir: str) -> bool:
    from nvmetier.locks import store_held

    with contextlib.suppress(OSError):
        return store_held(store_dir)
    return False


def root_shares(root: str, skip: str | None = None) -> list[Share]:
    """Every entry of ``root`` with its share (``skip``: a name left out).
    Never raises: an entry that cannot be read counts what ``du`` sees."""
    out: list[Share] = []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return out
    for name in names:
        if name == skip:
            continue
        path = os.path.join(root, name)
        disk = allocated_bytes(path)
        if name == BUDGET_NAME or name.startswith(f"{BUDGET_NAME}.tmp-"):
            out.append(Share(name, path, "root", disk, disk))
            continue
        if not os.path.isdir(path) or os.path.islink(path):
            out.append(Share(name, path, "part", disk, disk))
            continue
        if REMOVING_TAG in name:
            out.append(Share(name, path, "removing", disk, disk))
            continue
        share = Share(name, path, "part", disk, disk, last_use_ns=last_use_ns(path))
        sb_path = os.path.join(path, SUPERBLOCK_NAME)
        try:
            with open(sb_path, "rb") as f:
                sb = fmt.unpack_superblock(f.read(), where=sb_path)
        except (OSError, FormatError):
            if os.path.exists(os.path.join(path, INIT_LOCK_NAME)):
                share.kind = "incomplete"
                share.live = _held(path)
            out.append(share)
            continue
        share.kind = "store"
        share.n_paths = sb.n_paths
        share.capacity_bytes = sb.n_slots * sb.slot_bytes
        share.charge_bytes = max(disk, store_charge(sb)[0])
        model = sb.identity.get("model_name", sb.identity.get("model"))
        share.model = None if model is None else str(model)
        share.live = _held(path)
        share.pids = sharer_pids(path) if share.live else []
        out.append(share)
    return out


def root_used_bytes(root: str) -> int:
    """Allocated bytes of everything under ``root`` now (what ``du`` counts,
    ``root``'s own directory block aside)."""
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    return sum(allocated_bytes(os.path.join(root, n)) for n in names)


_usage_cache: dict[str, tuple[float, int, int]] = {}


def root_usage_cached(root: str) -> tuple[int, int]:
    """``(budget_bytes or 0, used_bytes)`` of ``root``, refreshed at most
    every ``USAGE_REFRESH_S`` (metrics on vLLM's scheduler thread: a few
    ``stat`` calls, no lock). Never raises."""
    now = time.monotonic()
    hit = _usage_cache.get(root)
    if hit is not None and now - hit[0] < USAGE_REFRESH_S:
        return hit[1], hit[2]
    try:
        budget = read_budget(root) or 0
    except ConfigError:
        budget = 0
    used = root_used_bytes(root)
    _usage_cache[root] = (now, budget, used)
    return budget, used


# ------------------------------------------------------------------ give way
def _remove_if_free(dirs: Sequence[str], why: str) -> bool:
    """Remove the store (or incomplete store) in ``dirs`` if no process
    holds it: its ``lock.init`` and ``lock`` both taken without waiting (a
    stopped process keeps both). Removed as ``reclaim`` removes a store:
    renamed aside under ``lock.init``, then deleted."""
    main = dirs[0]
    init_path = os.path.join(main, INIT_LOCK_NAME)
    try:
        init_fd = os.open(init_path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(init_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # being opened, closed, purged or repaired now
        mark_init_busy(init_fd)
        if not _is_linked(init_fd, init_path):
            return False
        try:
            lock_fd = os.open(os.path.join(main, LOCK_NAME), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            lock_fd = -1
        except OSError:
            return False
        try:
            if lock_fd >= 0:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # attached (or stopped while attached): it stays
        finally:
            if lock_fd >= 0:
                os.close(lock_fd)
        logger.warning("nvmetier: removing %s: %s", main, why)
        _remove_dirs(dirs)
        return True
    finally:
        os.close(init_fd)


def _sweep_removing(root: str) -> None:
    """Delete the ``.removing-`` directories under ``root``: stores already
    renamed aside by a removal that a crash cut short (no process uses them;
    a removal still running beside us deletes the same files, harmlessly)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            if REMOVING_TAG in name:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _victim_dirs(share: Share, roots: Sequence[str]) -> list[str] | None:
    """The directories of ``share``'s store over every root it spans, when
    they are known (a striped store only under the same roots)."""
    if share.n_paths == 1:
        return [share.path]
    if len(roots) != share.n_paths or os.path.dirname(share.path) != os.path.normpath(roots[0]):
        return None
    dirs = [os.path.join(r, share.name) for r in roots]
    return dirs if all(os.path.isdir(d) for d in dirs) else None


def give_way(
    roots: Sequence[str], shares: list[Share], over_bytes: int, why: str
) -> tuple[int, list[Share]]:
    """Remove dead entries of ``roots[0]`` until ``over_bytes`` are freed:
    ``.removing-`` leftovers first, then incomplete stores, then stores in
    least-recently-used order. Call with the root lock held.

    Returns:
        ``(bytes freed, the stores removed)``.
    """
    freed = 0
    removed: list[Share] = []
    order = sorted(
        (s for s in shares if s.kind in ("removing", "incomplete", "store") and not s.live),
        key=lambda s: ({"removing": 0, "incomplete": 1, "store": 2}[s.kind], s.last_use_ns),
    )
    for share in order:
        if freed >= over_bytes:
            break
        if share.kind == "removing":
            shutil.rmtree(share.path, ignore_errors=True)
            gone = not os.path.exists(share.path)
        else:
            dirs = _victim_dirs(share, roots)
            gone = dirs is not None and _remove_if_free(
                dirs,
                f"{why} (least recently used: "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(share.last_use_ns / 1e9))}, "
                f"{format_size(share.disk_bytes)} on disk, no process attached)",
            )
        if gone:
            freed += share.charge_bytes
            if share.kind == "store":
                removed.append(share)
    return freed, removed


# ----------------------------------------------------------------- admission
@dataclasses.dataclass
class Admission:
    """What ``admit`` decided for a new store."""

    layout: Layout
    removed: list[Share]
    shrunk_from: int | None = None  # the capacity asked, when made smaller
    budget_bytes: int | None = None


def _scaled(layout: Layout, capacity_bytes: int) -> Layout:
    per_path = layout.capacity_per_path
    if per_path is not None:
        per_path = tuple(c * capacity_bytes // layout.capacity_bytes for c in per_path)
        capacity_bytes = sum(per_path)
    return dataclasses.replace(layout, capacity_bytes=capacity_bytes, capacity_per_path=per_path)


def _fits(layout: Layout, n: int, room: Sequence[int]) -> bool:
    try:
        need = layout_charge(layout, n)
    except FormatError:
        return False
    return all(a <= b for a, b in zip(need, room, strict=True))


def _largest_fitting(layout: Layout, n: int, room: Sequence[int], floor: int) -> Layout | None:
    """The largest layout of at most ``layout.capacity_bytes`` and at least
    ``floor`` whose charge fits ``room`` on every root (MiB steps)."""
    if _fits(layout, n, room):
        return layout
    lo, hi = max(1, floor) >> 20, layout.capacity_bytes >> 20
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        cand = _scaled(layout, max(mid << 20, 1))
        if _fits(cand, n, room):
            best, lo = cand, mid + 1
        else:
            hi = mid - 1
    if best is not None and best.capacity_bytes >= floor:
        return best
    return None


def admit(
    roots: Sequence[str],
    store_name: str,
    layout: Layout,
    policy: Policy,
    space: SpaceFn = fs_space,
) -> Admission:
    """Decide the layout of a new store under the budget and the filesystem
    reserve, giving way (removing dead stores, least recently used first)
    to make room. Call with the root lock held, before any big write.

    Raises:
        ConfigError: a stated budget differs from the record; or the layout
            holds no complete set.
        StoreSpaceError: not even ``min_capacity_bytes`` fits: names the
            stores holding the space and the fixes.
    """
    n = len(roots)
    budgets = [effective_budget(r, policy) for r in roots]
    try:
        need = layout_charge(layout, n)
    except FormatError as exc:
        raise ConfigError(f"capacity_bytes={layout.capacity_bytes} is too small: {exc}") from exc
    for r in roots:
        _sweep_removing(r)
    shares = [root_shares(r, skip=store_name) for r in roots]
    used = [sum(s.charge_bytes for s in sh) for sh in shares]
    removed: list[Share] = []
    over = max(
        (u + k - b for u, k, b in zip(used, need, budgets, strict=True) if b is not None),
        default=0,
    )
    if over > 0:
        # Dead stores give way on the main root (a striped store's parts go
        # with it); the other roots hold only data files of the same stores.
        freed, removed = give_way(
            roots,
            shares[0],
            over,
            f"root budget of {roots[0]} ({format_size(budgets[0] or 0)}) makes room for "
            f"{store_name}",
        )
        if freed:
            shares = [root_shares(r, skip=store_name) for r in roots]
            used = [sum(s.charge_bytes for s in sh) for sh in shares]
    room = []
    fs_notes = []
    for r, u, b in zip(roots, used, budgets, strict=True):
        total, free = space(
            os.path.join(r, store_name) if os.path.isdir(os.path.join(r, store_name)) else r
        )
        reserve = policy.reserve_bytes(total)
        fs_room = max(0, free - reserve)
        fs_notes.append((r, free, reserve))
        room.append(fs_room if b is None else min(fs_room, max(0, b - u)))
    floor = policy.floor_bytes(layout.capacity_bytes)
    chosen = _largest_fitting(layout, n, room, floor)
    if chosen is None:
        raise StoreSpaceError(
            _refusal(roots, store_name, layout, need, room, budgets, used, shares, fs_notes, floor)
        )
    shrunk = None
    if chosen.capacity_bytes < layout.capacity_bytes:
        shrunk = layout.capacity_bytes
        logger.warning(
            "nvmetier: %s: store %s made %s instead of capacity_bytes=%s (root budget %s, "
            "%s used by other stores; filesystem reserve %s); floor min_capacity_bytes=%s",
            roots[0],
            store_name,
            format_size(chosen.capacity_bytes),
            format_size(layout.capacity_bytes),
            format_size(budgets[0]) if budgets[0] else "none",
            format_size(used[0]),
            format_size(fs_notes[0][2]),
            format_size(floor),
        )
    return Admission(chosen, removed, shrunk, budgets[0])


def _refusal(
    roots: Sequence[str],
    store_name: str,
    layout: Layout,
    need: Sequence[int],
    room: Sequence[int],
    budgets: Sequence[int | None],
    used: Sequence[int],
    shares: Sequence[list[Share]],
    fs_notes: Sequence[tuple[str, int, int]],
    floor: int,
) -> str:
    """The message of a store refused: what it needs, what is left and why,
    the stores that hold the space, and the fixes."""
    i = max(range(len(roots)), key=lambda k: need[k] - room[k])
    root, free, reserve = fs_notes[i]
    parts = [
        f"store {store_name!r} under {root!r} needs {format_size(need[i])} "
        f"(capacity_bytes {format_size(layout.capacity_bytes)}; no less than "
        f"min_capacity_bytes {format_size(floor)}) but only {format_size(room[i])} is left"
    ]
    budget = budgets[i]
    if budget is not None:
        parts.append(
            f"the root budget is {format_size(budget)} and the other stores hold "
            f"{format_size(used[i])}"
        )
    parts.append(
        f"the filesystem has {format_size(free)} free and keeps {format_size(reserve)} "
        "free (fs_reserve_bytes / fs_reserve_fraction)"
    )
    holders = sorted(
        (s for s in shares[i] if s.kind in ("store", "incomplete")),
        key=lambda s: -s.disk_bytes,
    )
    if holders:
        parts.append(
            "stores holding the space: "
            + "; ".join(
                f"{s.name} ({s.model or 'unknown model'}, {format_size(s.disk_bytes)}, "
                + (
                    f"in use by pid {', '.join(map(str, s.pids)) or 'unknown'}"
                    if s.live
                    else "idle"
                )
                + ")"
                for s in holders[:8]
            )
        )
    fit = max(0, room[i]) * layout.capacity_bytes // max(1, need[i]) >> 20 << 20
    parts.append(
        "fix: lower capacity_bytes or min_capacity_bytes "
        + (f"(about {format_size(fit)} fits), " if fit else "(nothing fits now), ")
        + f"raise the budget (`nvmetier budget {roots[0]} --set SIZE`), stop a model's "
        "processes so its store can give way, or free space on that drive"
    )
    return "; ".join(parts)


# --------------------------------------------------------------- store notes
def write_shrunk_note(store_dir: str, asked_bytes: int, made_bytes: int) -> None:
    """Record in a store made smaller what its creator asked for, so that
    the same configuration reopens it (``shrunk_note``). Durable before the
    superblock claims the store."""
    path = os.path.join(store_dir, SHRUNK_NAME)
    data = json.dumps(
        {"asked_capacity_bytes": int(asked_bytes), "capacity_bytes": int(made_bytes)}
    ).encode()
    fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY | os.O_CLOEXEC, FILE_MODE)
    try:
        if os.write(fd, data) != len(data):
            raise OSError(errno.EIO, "short write of the shrunk note")
        os.fsync(fd)
    finally:
        os.close(fd)


def shrunk_note(store_dir: str) -> int | None:
    """The capacity_bytes asked of a store made smaller (None: not one)."""
    try:
        with open(os.path.join(store_dir, SHRUNK_NAME), "rb") as f:
            doc = json.loads(f.read(4096))
        return int(doc["asked_capacity_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clear_shrunk_note(store_dir: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(store_dir, SHRUNK_NAME))


# ----------------------------------------------------------------- reporting
def report(root: str) -> dict[str, Any]:
    """The budget of ``root`` and every store's share of it (``nvmetier
    info``/``budget``; JSON-able). Never takes a lock."""
    try:
        budget = read_budget(root)
        error = None
    except ConfigError as exc:
        budget, error = None, str(exc)
    shares = root_shares(root)
    used = sum(s.disk_bytes for s in shares)
    return {
        "root": root,
        "budget_bytes": budget,
        "used_bytes": used,
        "charged_bytes": sum(s.charge_bytes for s in shares),
        "used_pct": None if not budget else round(100.0 * used / budget, 2),
        "error": error,
        "stores": [s.to_json(budget) for s in shares if s.kind != "root"],
    }


def set_budget(root: str, budget_bytes: int | None) -> tuple[bool, list[Share], str]:
    """``nvmetier budget ROOT --set``: record a new budget (None: unbounded)
    once what the root holds fits under it, dead stores giving way in LRU
    order. Returns ``(recorded, stores removed, message)``; not recorded
    when live stores alone hold more than the new budget."""
    if not os.path.isdir(root):
        raise ConfigError(f"{root!r} is not a directory; give a root_dir")
    with root_lock([root]):
        removed: list[Share] = []
        if budget_bytes is not None:
            shares = root_shares(root)
            over = sum(s.charge_bytes for s in shares) - budget_bytes
            if over > 0:
                _freed, removed = give_way(
                    [root],
                    shares,
                    over,
                    f"root budget of {root} lowered to {format_size(budget_bytes)}",
                )
                shares = root_shares(root)
                over = sum(s.charge_bytes for s in shares) - budget_bytes
            if over > 0:
                live = [s for s in shares if s.live]
                return (
                    False,
                    removed,
                    f"not recorded: the stores in use hold {format_size(over)} more than "
                    f"{format_size(budget_bytes)} ("
                    + "; ".join(
                        f"{s.name}: {format_size(s.charge_bytes)}, pid "
                        f"{', '.join(map(str, s.pids)) or 'unknown'}"
                        for s in live
                    )
                    + "); stop those processes (their stores then give way) or set a larger "
                    "budget",
                )
        write_budget(root, budget_bytes)
        _usage_cache.pop(root, None)
    what = "unbounded" if budget_bytes is None else format_size(budget_bytes)
    return True, removed, f"root budget of {root}: {what}"
