"""The root budget: one bound on the disk every store under a ``root_dir``
occupies, the filesystem reserve, and the give-way policy that makes room.

Owns every file write the budget makes, so that a crash explorer can hook
them here: the root-level record ``budget`` (``write_budget``: temp file,
fsync, rename, directory fsync), the root lock (``root_lock``: an exclusive
flock on the root directory itself, held around every store creation's check
and preallocation, and around ``nvmetier budget --set``), the removal of the
stores that give way (``give_way`` -> ``remove_store``, which renames a store
aside and deletes it through ``reclaim``), the
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
ever waits on another process here past ``ROOT_LOCK_TIMEOUT_S``. A store
gives way as a dead process's private store is reclaimed
(``reclaim._reclaim_if_free``: renamed aside under its ``lock.init``, then
deleted).

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
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from nvmetier import format as fmt
from nvmetier.config import TierConfig, format_size
from nvmetier.crashsim import hook
from nvmetier.errors import ConfigError, FormatError, StoreLockedError, StoreSpaceError
from nvmetier.reclaim import _reclaim_if_free
from nvmetier.root_usage import (
    BUDGET_NAME,
    PURGE_LOG_SLOTS,
    STORE_SLACK_BYTES,
    Share,
    allocated_bytes,
    last_use_ns,
    layout_charge,
    root_shares,
    root_used_bytes,
    store_charge,
)
from nvmetier.store_dir import (
    LOCK_NAME,
    REMOVING_TAG,
    fsync_dir,
    write_file,
)
from nvmetier.superblock import Layout

# Re-exported: the budget's callers and hooks import them from here.
__all__ = [
    "BUDGET_NAME",
    "PURGE_LOG_SLOTS",
    "STORE_SLACK_BYTES",
    "Admission",
    "Policy",
    "Share",
    "accepts_shrunk",
    "admit",
    "allocated_bytes",
    "check_stated",
    "effective_budget",
    "give_way",
    "last_use_ns",
    "layout_charge",
    "read_budget",
    "record_stated",
    "remove_store",
    "report",
    "root_lock",
    "root_shares",
    "root_usage_cached",
    "root_used_bytes",
    "set_budget",
    "store_charge",
    "touch_last_use",
    "write_budget",
]

logger = logging.getLogger(__name__)

SHRUNK_NAME = "shrunk"  # in a store made smaller than its capacity_bytes
BUDGET_FORMAT = "nvmetier-root-budget"
BUDGET_VERSION = 1
# How long a store creation waits for another process's hold of the root
# lock (it creates a store, or changes the budget): holds last as long as a
# preallocation; a holder stopped or hung would hold it for ever.
ROOT_LOCK_TIMEOUT_S = float(os.environ.get("NVMETIER_ROOT_LOCK_TIMEOUT_S", "60"))
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
    rec = hook.recorder
    for name in os.listdir(root):
        if name.startswith(f"{BUDGET_NAME}.tmp-"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(root, name))
                if rec is not None:
                    rec.unlink(os.path.join(root, name))
    if budget_bytes is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            if rec is not None:
                rec.unlink(path)
        fsync_dir(root)
        return
    doc = {
        "format": BUDGET_FORMAT,
        "version": BUDGET_VERSION,
        "budget_bytes": int(budget_bytes),
        "recorded_ns": time.time_ns(),
    }
    data = (json.dumps(doc, sort_keys=True) + "\n").encode()
    write_file(path, data, tmp=f"{path}.tmp-{os.getpid()}")
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


def record_stated(roots: Sequence[str], policy: Policy) -> None:
    """At every open: refuse a stated budget that differs from a root's
    record (lock-free), and record it where none is (under the root lock).

    Raises:
        ConfigError: naming both values and the fix.
        StoreLockedError: the root lock held past its bound.
    """
    check_stated(roots, policy)
    if policy.budget_bytes is None:
        return
    if all(read_budget(r) is not None for r in roots):
        return
    with root_lock(roots):
        for r in roots:
            effective_budget(r, policy)


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


# ------------------------------------------------------------ last use
def touch_last_use(store_dir: str) -> None:
    """Stamp the store used now (its ``lock`` file's mtime): at every open
    and close, so the least recently used store is the one to give way."""
    with contextlib.suppress(OSError):
        os.utime(os.path.join(store_dir, LOCK_NAME))


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
def _sweep_removing(root: str) -> None:
    """Delete the ``.removing-`` directories under ``root``: stores already
    renamed aside by a removal that a crash cut short (no process uses them;
    a removal still running beside us deletes the same files, harmlessly)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            if REMOVING_TAG in name:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def remove_store(dirs: Sequence[str], why: str) -> bool:
    """Remove the store in ``dirs`` whole if no process holds it (the one
    removal the budget makes: a hook point). Returns whether it was removed."""
    return _reclaim_if_free(dirs, why)


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
            gone = dirs is not None and remove_store(
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
        own = os.path.join(r, store_name)  # made by the opener's lock.init: same filesystem
        total, free = space(own if os.path.isdir(own) else r)
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


def scratch_room(roots: Sequence[str], policy: Policy, space: SpaceFn = fs_space) -> int:
    """Bytes a short-lived scratch file may take on each of ``roots`` now
    without passing a root's budget (every store's charge counted) or the
    filesystem reserve: the least over the roots. Call with the root lock
    held, and keep it while the scratch exists (the staging probe)."""
    room: list[int] = []
    for r in roots:
        total, free = space(r)
        fits = max(0, free - policy.reserve_bytes(total))
        b = read_budget(r)
        if b is not None:
            used = sum(s.charge_bytes for s in root_shares(r))
            fits = min(fits, max(0, b - used))
        room.append(fits)
    return min(room, default=0)


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
    write_file(path, data)


def shrunk_note(store_dir: str) -> int | None:
    """The capacity_bytes asked of a store made smaller (None: not one)."""
    try:
        with open(os.path.join(store_dir, SHRUNK_NAME), "rb") as f:
            doc = json.loads(f.read(4096))
        return int(doc["asked_capacity_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def accepts_shrunk(store_dir: str, sb: fmt.Superblock, layout: Layout, policy: Policy) -> bool:
    """Whether the store in ``store_dir`` (superblock ``sb``), whose geometry
    is not what ``layout`` asks, is the one this configuration asked for and
    got smaller (its ``shrunk`` note names ``layout.capacity_bytes``).

    Raises:
        ConfigError: it was made smaller than this process's floor.
    """
    asked = shrunk_note(store_dir)
    n_paths = len(layout.capacity_per_path or ()) or sb.n_paths
    if asked != layout.capacity_bytes or sb.n_paths != n_paths:
        return False
    floor = policy.floor_bytes(layout.capacity_bytes)
    made = sb.n_slots * sb.slot_bytes
    if made < floor * 9 // 10:
        raise ConfigError(
            f"store {store_dir!r} was made {format_size(made)} under the root budget, below "
            f"min_capacity_bytes={floor} ({format_size(floor)}); lower min_capacity_bytes, or "
            "remove the store to create it again"
        )
    return True


def clear_shrunk_note(store_dir: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(store_dir, SHRUNK_NAME))
        if hook.recorder is not None:
            hook.recorder.unlink(os.path.join(store_dir, SHRUNK_NAME))


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
