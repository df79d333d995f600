"""What a root holds against its budget: the allocated bytes of every entry
under a ``root_dir``, what each store is charged (its largest size), when
each was last used and whether a process holds it.

Owns: nothing; read-only (``stat``, directory listings, superblock reads and
lock probes that take no lock: ``F_OFD_GETLK``). Below ``budget`` (which
owns every write of the root budget and re-exports these names). Called on
the constructing thread (a store's admission), the CLI (``nvmetier info``,
``nvmetier budget``) and, through ``budget.root_usage_cached``, vLLM's
scheduler thread (``root_used_bytes`` only: a few ``stat`` calls).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any

from nvmetier import format as fmt
from nvmetier.errors import FormatError
from nvmetier.locks import sharer_pids, store_held
from nvmetier.store_dir import INIT_LOCK_NAME, LOCK_NAME, REMOVING_TAG, SUPERBLOCK_NAME, TABLE_NAME
from nvmetier.superblock import Layout

BUDGET_NAME = "budget"  # the root-level record (docs/format.md, "Root budget")
# Small files a store may add after its creation (probe files, a temporary
# superblock, ...), charged to every store.
STORE_SLACK_BYTES = 256 << 10
# The purge log keeps at most this many keys per slot of the store (purge.py).
PURGE_LOG_SLOTS = 1
PURGE_LOG_ENTRY_BYTES = 96
PURGE_LOG_HEAD_BYTES = 32


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
        from nvmetier.keyring import KEYRING_BYTES

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


def _held(store_dir: str) -> bool:
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
