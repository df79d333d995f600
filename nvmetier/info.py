"""``nvmetier info``: what a store holds and what this machine can run.

Owns: the report of a store's geometry, layout identity, occupancy, the age
of its records and its shutdown state, plus the engine facts of the machine
(io_uring usable or why not, O_DIRECT usable at ROOT or why not). Runs on the
CLI's main thread; blocks while it reads the index.

Read-only and lock-free: info never takes the store's lock (a running server
keeps serving), so numbers read from a store in use are a snapshot that may
be a few records stale. Whether a process holds the store is read from OFD
locks with ``F_OFD_GETLK`` (``files.store_held``): info takes no lock, so it
never makes an opening vLLM fail nor a closing one skip its sweep.
The O_DIRECT probe writes and removes one 4 KiB file in the directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import re
import struct
import textwrap
import time
from typing import Any

from nvmetier import budget, recovery
from nvmetier import format as fmt
from nvmetier.config import format_duration, format_size
from nvmetier.errors import FormatError
from nvmetier.files import (
    INDEX_NAME,
    SUPERBLOCK_NAME,
    TABLE_NAME,
    holders,
    probe_o_direct,
    sharer_pids,
    store_held,
)
from nvmetier.fsck import FsckOperationalError, find_stores

# (label, upper bound in seconds); the last bucket takes everything older.
AGE_BUCKETS: tuple[tuple[str, float], ...] = (
    ("lt_1min", 60.0),
    ("lt_1h", 3600.0),
    ("lt_1day", 86400.0),
    ("older", float("inf")),
)
_AGE_LABELS = {"lt_1min": "< 1 min", "lt_1h": "< 1 h", "lt_1day": "< 1 day", "older": "older"}


_PER_RANK = re.compile(r"_dp\d+$")


@dataclasses.dataclass
class StoreInfo:
    """Facts about one store directory."""

    path: str
    error: str | None = None
    format_version: int | None = None
    identity: dict[str, Any] | None = None
    created_ns: int = 0
    clean_shutdown: bool | None = None
    in_use_by: str | None = None  # pids attached, comma-separated (None: nobody)
    sharers: list[int] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    chunk_bytes: int = 0
    slot_bytes: int = 0
    ways: int = 0
    n_paths: int = 0
    slots_total: int = 0
    slots_used: int = 0
    bad_records: int = 0
    capacity_bytes: int = 0
    disk_bytes: int = 0
    bytes_used: int = 0
    ages: dict[str, int] = dataclasses.field(default_factory=dict)
    oldest_ns: int | None = None
    newest_ns: int | None = None
    # Retention the ages are measured against (None: none known), where it
    # came from ("--retention", or "table": the latest process to open it),
    # the records by fraction of it, and those past it (never served).
    retention_s: float | None = None
    retention_source: str | None = None
    retention_ages: dict[str, int] = dataclasses.field(default_factory=dict)
    past_retention: int = 0
    # Encryption at rest: the store's cipher (None: plaintext) and the key
    # fingerprint of the latest process to open it (None: unknown).
    encryption: str | None = None
    key_fingerprint: str | None = None
    # The root budget (nvmetier.budget): allocated bytes of the store's
    # files in its main root (du), their share of the root's budget (None:
    # no budget), and when it was last opened, closed or written.
    disk_usage_bytes: int = 0
    budget_share_pct: float | None = None
    last_use_ns: int | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Record ages as fractions of the retention; the last takes those past it.
RETENTION_BUCKETS: tuple[tuple[str, float], ...] = (
    ("lt_25pct", 0.25),
    ("lt_50pct", 0.5),
    ("lt_75pct", 0.75),
    ("lt_100pct", 1.0),
    ("past", float("inf")),
)
_RETENTION_LABELS = {
    "lt_25pct": "< 25%",
    "lt_50pct": "< 50%",
    "lt_75pct": "< 75%",
    "lt_100pct": "<= 100%",
    "past": "past (never served)",
}
# A record stamped further ahead of now than this (or than the retention)
# has no known age: the table treats it as past retention (nvt_core.c).
_CLOCK_HORIZON_NS = 3600 * 10**9
# The table header's magic, version and retention_s (native/nvt_layout.h).
_TABLE_HEAD = struct.Struct("<8sI52xI")
_KEY_FP_OFFSET = 72  # the latest sealed opener's key fingerprint (nvt_table.h)


def table_retention_s(store_dir: str) -> float | None:
    """The retention that the latest process to open the store set in its
    table header (None: none, or not a table of this version)."""
    try:
        with open(os.path.join(store_dir, TABLE_NAME), "rb") as f:
            head = f.read(_TABLE_HEAD.size)
    except OSError:
        return None
    if len(head) < _TABLE_HEAD.size:
        return None
    magic, version, secs = _TABLE_HEAD.unpack(head)
    if magic != b"NVTTABLE" or version != fmt.TABLE_VERSION or not secs:
        return None
    return float(secs)


def table_key_fingerprint(store_dir: str) -> str | None:
    """The key fingerprint (hex) that the latest process to open an
    encrypted store wrote into its table header (None: none yet)."""
    try:
        with open(os.path.join(store_dir, TABLE_NAME), "rb") as f:
            head = f.read(_KEY_FP_OFFSET + 8)
    except OSError:
        return None
    fp = head[_KEY_FP_OFFSET : _KEY_FP_OFFSET + 8]
    return fp.hex() if len(fp) == 8 and any(fp) else None


def _past_retention(stored_ns: int, now_ns: int, retention_ns: int) -> bool:
    if stored_ns > now_ns:
        return stored_ns - now_ns > min(retention_ns, _CLOCK_HORIZON_NS)
    return now_ns - stored_ns > retention_ns


def store_info(
    store_dir: str, now_ns: int | None = None, retention_s: float | None = None
) -> StoreInfo:
    """Read one store's superblock and index (never raises for a bad store:
    the problem is reported in ``error``). Ages are also measured against
    ``retention_s``, else against the retention in the store's table."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    out = StoreInfo(path=store_dir)
    out.disk_usage_bytes = budget.allocated_bytes(store_dir)
    out.last_use_ns = budget.last_use_ns(store_dir) or None
    if retention_s is not None:
        out.retention_s, out.retention_source = retention_s, "--retention"
    else:
        out.retention_s = table_retention_s(store_dir)
        out.retention_source = "table" if out.retention_s else None
    with contextlib.suppress(OSError):  # an unreadable lock: not known to be in use
        if store_held(store_dir):
            out.sharers = sharer_pids(store_dir)
            out.in_use_by = ", ".join(str(p) for p in out.sharers) or holders(store_dir)
    if _PER_RANK.search(os.path.basename(os.path.normpath(store_dir))):
        out.notes.append(
            "a per-rank store (data-parallel rank in its name): sharing 'node', the default, "
            "puts every rank in one store, so this one is only used with sharing 'process'; "
            "nvmetier never deletes it: remove it when no longer needed"
        )
    sb_path = os.path.join(store_dir, SUPERBLOCK_NAME)
    try:
        with open(sb_path, "rb") as f:
            sb = fmt.unpack_superblock(f.read(), where=sb_path)
    except (OSError, FormatError) as exc:
        out.error = f"{exc.strerror} ({sb_path!r})" if isinstance(exc, OSError) else str(exc)
        return out
    out.format_version = sb.format_version
    out.identity = sb.identity
    if sb.identity.get("encryption"):
        out.encryption = str(sb.identity["encryption"])
        out.key_fingerprint = table_key_fingerprint(store_dir)
    out.created_ns = sb.created_ns
    out.clean_shutdown = sb.clean
    out.chunk_bytes, out.slot_bytes = sb.chunk_bytes, sb.slot_bytes
    out.ways, out.n_paths, out.slots_total = sb.ways, sb.n_paths, sb.n_slots
    out.capacity_bytes = sb.n_slots * sb.slot_bytes
    out.disk_bytes = (
        sb.superblock_bytes + fmt.align_up(sb.index_bytes) + sb.table_bytes + out.capacity_bytes
    )
    index_path = os.path.join(store_dir, INDEX_NAME)
    try:
        with open(index_path, "rb") as f:
            if os.fstat(f.fileno()).st_size < sb.index_bytes:
                out.error = f"{index_path!r} is shorter than the geometry says; run nvmetier fsck"
                return out
            index = mmap.mmap(f.fileno(), sb.index_bytes, access=mmap.ACCESS_READ)
    except OSError as exc:
        out.error = f"{index_path!r}: {exc.strerror}"
        return out
    try:
        # The rules a store open applies: what it would serve is what is used.
        scan = recovery.scan_index(index, sb.n_slots, sb.ways)
    finally:
        index.close()
    out.bad_records = len(scan.bad)
    stamps = scan.stored_ns.tolist()
    out.slots_used = len(stamps)
    out.bytes_used = len(stamps) * sb.slot_bytes
    out.ages = {label: 0 for label, _ in AGE_BUCKETS}
    for ns in stamps:
        age_s = max(0, now_ns - ns) / 1e9
        for label, bound in AGE_BUCKETS:
            if age_s < bound:
                out.ages[label] += 1
                break
    if stamps:
        out.oldest_ns, out.newest_ns = min(stamps), max(stamps)
    if out.retention_s:
        ret_ns = int(out.retention_s * 1e9)
        out.retention_ages = {label: 0 for label, _ in RETENTION_BUCKETS}
        for ns in stamps:
            if _past_retention(ns, now_ns, ret_ns):
                out.retention_ages["past"] += 1
                continue
            frac = max(0, now_ns - ns) / ret_ns
            for label, bound in RETENTION_BUCKETS:
                if frac <= bound if bound == 1.0 else frac < bound:
                    out.retention_ages[label] += 1
                    break
        out.past_retention = out.retention_ages["past"]
    return out


def machine_info(root: str) -> dict[str, Any]:
    """Engine facts of this machine: io_uring and O_DIRECT at ``root``."""
    from nvmetier.engine import uring_status
    from nvmetier.memory import probe_shm_pages

    uring_ok, uring_why = uring_status()
    o_direct_ok, o_direct_why = probe_o_direct(root)
    return {
        "uring_usable": uring_ok,
        "uring_reason": uring_why,
        "o_direct_usable": o_direct_ok,
        "o_direct_reason": o_direct_why,
        "o_direct_dir": root,
        "cpu_tier_pages": probe_shm_pages(),
    }


def info(root: str, retention_s: float | None = None) -> dict[str, Any]:
    """Everything ``nvmetier info`` reports about ROOT, as one JSON-able dict.

    Raises:
        FsckOperationalError: ROOT names no store.
    """
    is_root = not os.path.exists(os.path.join(root, SUPERBLOCK_NAME))
    try:
        dirs = find_stores(root)
    except FsckOperationalError:
        # A root with a budget recorded but no store (yet) still reports it.
        if not (is_root and os.path.exists(budget.budget_path(root))):
            raise
        dirs = []
    stores = [store_info(d, retention_s=retention_s) for d in dirs]
    # The root budget and every entry's share of it (ROOT a root_dir), else
    # the root that holds the store.
    budget_root = root if is_root else os.path.dirname(os.path.normpath(root))
    shares = budget.report(budget_root)
    limit = shares["budget_bytes"]
    for s in stores:
        if limit:
            s.budget_share_pct = round(100.0 * s.disk_usage_bytes / limit, 2)
    return {
        "root": root,
        "machine": machine_info(root),
        "stores": [s.to_json() for s in stores],
        "budget": shares,
        # The figures the metrics export, at the top level for scripts.
        "root_budget_bytes": limit or 0,
        "root_used_bytes": shares["used_bytes"],
    }


# --------------------------------------------------------------------- output
def _when(ns: int | None, now_ns: int) -> str:
    if ns is None:
        return "-"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))
    return f"{stamp} ({_age(now_ns - ns)} ago)"


def _age(delta_ns: int) -> str:
    s = max(0, delta_ns) / 1e9
    for unit, span in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= span:
            return f"{s / span:.1f} {unit}"
    return f"{s:.1f} s"


def format_info(report: dict[str, Any], now_ns: int | None = None) -> str:
    """The report of ``info`` for a person."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    lines: list[str] = []
    for s in report["stores"]:
        lines.append(f"{s['path']}:")
        if s["in_use_by"]:
            lines.append(
                f"  in use:          yes, by pid {s['in_use_by']} (numbers are a snapshot)"
            )
        for note in s.get("notes", []):
            lines.append(f"  note:            {note}")
        if s["error"] and s["identity"] is None:
            lines.append(f"  error:           {s['error']}")
            lines.append("")
            continue
        ident = ", ".join(f"{k}={v}" for k, v in sorted(s["identity"].items()))
        lines.append(
            textwrap.fill(
                ident,
                width=100,
                initial_indent="  layout identity: ",
                subsequent_indent=" " * 19,
                break_on_hyphens=False,
            )
        )
        if s.get("encryption"):
            fp = s.get("key_fingerprint") or "unknown"
            lines.append(
                f"  encryption:      {s['encryption']} (AES-256-GCM per chunk, keys in the index "
                f"as HMAC-SHA256), key fingerprint {fp}"
            )
        else:
            lines.append("  encryption:      none (chunks and keys in the clear)")
        lines.append(
            f"  format:          version {s['format_version']}, created "
            f"{_when(s['created_ns'], now_ns)}"
        )
        lines.append(
            f"  geometry:        {s['slots_total']} slots of {s['slot_bytes']} bytes "
            f"(chunk {s['chunk_bytes']}), {s['ways']} ways, {s['n_paths']} path(s)"
        )
        lines.append(
            f"  capacity:        {format_size(s['capacity_bytes'])} of data "
            f"({format_size(s['disk_bytes'])} on disk with index, table and superblock)"
        )
        pct = 100.0 * s["slots_used"] / max(1, s["slots_total"])
        lines.append(
            f"  used:            {s['slots_used']} slots ({pct:.1f}%), "
            f"{format_size(s['bytes_used'])}"
        )
        if s["bad_records"]:
            lines.append(
                f"  bad records:     {s['bad_records']} (dropped at the next open; "
                "run nvmetier fsck)"
            )
        if s["error"]:
            lines.append(f"  error:           {s['error']}")
        ages = ", ".join(f"{_AGE_LABELS[k]}: {v}" for k, v in s["ages"].items())
        lines.append(f"  record ages:     {ages}")
        if s["retention_s"]:
            source = (
                "given"
                if s["retention_source"] == "--retention"
                else "of the latest process to open it"
            )
            ages = ", ".join(f"{_RETENTION_LABELS[k]}: {v}" for k, v in s["retention_ages"].items())
            lines.append(
                f"  retention:       {format_duration(s['retention_s'])} ({source}); "
                f"{s['past_retention']} records past it"
            )
            lines.append(f"  age / retention: {ages}")
        else:
            lines.append("  retention:       none (chunks live until evicted)")
        lines.append(f"  oldest record:   {_when(s['oldest_ns'], now_ns)}")
        lines.append(f"  newest record:   {_when(s['newest_ns'], now_ns)}")
        clean = (
            "yes"
            if s["clean_shutdown"]
            else (
                "no (open now)"
                if s["in_use_by"]
                else "no (the last process crashed or was "
                "killed; the next open drops records that do not verify)"
            )
        )
        lines.append(f"  clean shutdown:  {clean}")
        share = (
            f" ({s['budget_share_pct']:.1f}% of the root budget)"
            if s.get("budget_share_pct") is not None
            else ""
        )
        lines.append(
            f"  on disk:         {format_size(s.get('disk_usage_bytes', 0))}{share}, "
            f"last use {_when(s.get('last_use_ns'), now_ns)}"
        )
        lines.append("")
    if report.get("budget") is not None:
        from nvmetier.cli import format_budget

        lines.append(format_budget(report["budget"]))
        lines.append("")
    m = report["machine"]
    uring = "usable" if m["uring_usable"] else f"not usable: {m['uring_reason']}"
    odirect = "usable" if m["o_direct_usable"] else f"not usable: {m['o_direct_reason']}"
    lines.append("this machine:")
    lines.append(f"  io_uring engine: {uring}")
    lines.append(f"  O_DIRECT:        {odirect} (probed in {m['o_direct_dir']})")
    shm = m.get("cpu_tier_pages")
    if shm:
        lines.append(f"  CPU tier pages:  {_pages_line(shm)}")
    return "\n".join(lines)


def _pages_line(shm: dict[str, Any]) -> str:
    """What vLLM's CPU tier (a /dev/shm file) gets here, and what the tier does."""
    modes = (
        f"THP {shm.get('thp_enabled')}, shmem THP {shm.get('thp_shmem_enabled')}, "
        f"{shm['shm_dir']} huge={shm.get('mount_huge') or 'never'}"
    )
    if "error" in shm:
        return f"unknown ({shm['error']}; {modes})"
    if shm.get("huge_page_share", 0) >= 0.9:
        return f"2 MiB huge pages ({modes}): loads move straight into it"
    staged = shm.get("thp_enabled") in ("always", "madvise")
    return f"4 KiB pages ({modes}): " + (
        "loads and stores are staged through huge pages (staging: auto)"
        if staged
        else "THP is off, so staging cannot help; see docs/vllm.md"
    )
