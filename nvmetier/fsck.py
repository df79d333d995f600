"""``nvmetier fsck``: check (and optionally repair) stores on disk, offline.

Owns: finding the stores under a root, the checks, the repair of index
records, and the exit codes. Runs on the CLI's main thread and blocks (it
reads the whole index, and with ``deep`` every live slot). It never imports
vLLM and never opens a store through ``BlockStore``: it reads the files with
the format module's parsers, so it sees exactly what an open would see.

Checks, per store directory:

- the superblock parses and verifies (``format.unpack_superblock``);
- the index file and the main data file are at least as large as the
  geometry says (data files of other ``root_dir`` entries of a striped store
  are not known from ROOT and are reported as not checked);
- every index record: all zeros, or a record whose checksum verifies for its
  slot, with a known state, whose key hashes to the slot's set, and whose key
  appears in no earlier slot;
- with ``deep``: the payload checksum of every live slot, read with O_DIRECT
  (buffered when the filesystem refuses it).

Repair zeroes the records that fail (``format.EMPTY_RECORD``): a zeroed record
is an empty slot, a miss, which is exactly what a ``BlockStore`` open or load
would have made of it. Good records are never written. Problems a record
write cannot fix (superblock, file sizes, unreadable slots) are left for a
person; the usual fix is removing the store directory (it is a cache).

Locking: a check is read-only and works on a live store (processes attached
with ``sharing: node``): records change under the reader, so a record or a
payload that fails is read again, and reported only when it fails again with
the same record bytes (a slot being rewritten is not an error). A check takes
no lock (``files.store_held`` reads OFD locks only), so it never makes an
opening vLLM fail nor a closing one skip its sweep. ``--repair``
takes ``lock.init`` and the store's ``lock`` exclusively, without waiting, and
refuses (exit 8) while any process is attached, naming their pids: a repair
must not race a writer.

Exit codes follow e2fsck and are OR-ed over the stores: 0 clean, 1 errors
corrected, 4 errors left uncorrected, 8 operational error (not a store, store
in use, unreadable), 16 usage error (set by the CLI).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import mmap
import os
import time
from collections.abc import Iterator
from typing import Any, TextIO

import xxhash

from nvmetier import format as fmt
from nvmetier import recovery
from nvmetier.crashsim import hook
from nvmetier.errors import FormatError, FormatVersionError, NvmeTierError
from nvmetier.files import (
    DATA_NAME,
    INDEX_NAME,
    INIT_LOCK_NAME,
    LOCK_NAME,
    O_DIRECT,
    SUPERBLOCK_NAME,
    holders,
    mark_init_busy,
    sharer_pids,
    store_held,
)

EXIT_CLEAN = 0
EXIT_CORRECTED = 1
EXIT_UNCORRECTED = 4
EXIT_OPERATIONAL = 8
EXIT_USAGE = 16

# Error kinds a repair fixes by zeroing the slot's record.
RECORD_KINDS = frozenset({"record", "misplaced", "duplicate", "payload"})
# Error kinds of the store as a whole (no slot); a person must act.
STORE_KINDS = frozenset({"superblock", "index_missing", "index_size", "data_missing", "data_size"})


class FsckOperationalError(NvmeTierError):
    """fsck could not check a root or a store at all (exit 8)."""


@dataclasses.dataclass
class FsckError:
    """One problem found.

    Attributes:
        kind: ``record`` (torn or flipped record), ``misplaced`` (key not in
            the slot's set), ``duplicate`` (key already in an earlier slot),
            ``payload`` (data does not match the record's checksum),
            ``read_error`` (the slot could not be read), or one of
            ``STORE_KINDS``.
        detail: one line for a person.
        slot: the slot, or None for a store-level problem.
        repaired: the record was zeroed by ``--repair``.
    """

    kind: str
    detail: str
    slot: int | None = None
    repaired: bool = False


@dataclasses.dataclass
class StoreResult:
    """What fsck found in one store directory."""

    path: str
    identity: dict[str, Any] | None = None
    format_version: int | None = None
    slots: int = 0
    ways: int = 0
    n_paths: int = 0
    chunk_bytes: int = 0
    slot_bytes: int = 0
    live: int = 0
    clean_shutdown: bool | None = None
    deep: bool = False
    deep_checked: int = 0
    deep_unchecked: int = 0
    o_direct: bool | None = None
    sharers: list[int] = dataclasses.field(default_factory=list)  # pids attached (live check)
    errors: list[FsckError] = dataclasses.field(default_factory=list)
    operational_error: str | None = None
    elapsed_s: float = 0.0
    # Encrypted stores: whether the store is sealed, whether --deep had no
    # key to verify tags with (exit 8), and the live slots sealed under
    # another key (a rotated key's leftovers: misses, not corruption).
    encrypted: bool = False
    deep_no_key: bool = False
    deep_other_key: int = 0

    @property
    def repaired(self) -> int:
        return sum(e.repaired for e in self.errors)

    @property
    def exit_code(self) -> int:
        if self.operational_error is not None:
            return EXIT_OPERATIONAL
        if any(not e.repaired for e in self.errors):
            return EXIT_UNCORRECTED | (EXIT_OPERATIONAL if self.deep_no_key else 0)
        if self.deep_no_key:
            return EXIT_OPERATIONAL
        return EXIT_CORRECTED if self.errors else EXIT_CLEAN

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "identity": self.identity,
            "format_version": self.format_version,
            "slots": self.slots,
            "ways": self.ways,
            "n_paths": self.n_paths,
            "chunk_bytes": self.chunk_bytes,
            "slot_bytes": self.slot_bytes,
            "live": self.live,
            "clean_shutdown": self.clean_shutdown,
            "deep": self.deep,
            "deep_checked": self.deep_checked,
            "deep_unchecked": self.deep_unchecked,
            "o_direct": self.o_direct,
            "sharers": self.sharers,
            "errors": [dataclasses.asdict(e) for e in self.errors],
            "repaired": self.repaired,
            "exit_code": self.exit_code,
            "error": self.operational_error,
            "elapsed_s": round(self.elapsed_s, 3),
            "encrypted": self.encrypted,
            "deep_no_key": self.deep_no_key,
            "deep_other_key": self.deep_other_key,
        }


class _Payloads:
    """How a slot's payload is verified: XXH3-64 seeded with the key, or for
    an encrypted store its AES-GCM tag (the store's epoch keys, unwrapped
    with the operator's key) and the record's payload checksum (the tag's
    head)."""

    def __init__(self, sb: fmt.Superblock, keys: Any, store_dir: str = "") -> None:
        self.sb = sb
        self.keys = keys
        self.sealed = "encryption" in sb.identity
        self.digest = fmt.identity_digest(sb.identity)
        self.row = sb.chunk_bytes - (_sealed().TRAILER_BYTES if self.sealed else 0)
        self.native: Any = None
        self.epochs: dict[int, bytes] = {}
        if self.sealed and keys is not None:
            self._load_keys(store_dir)

    def _load_keys(self, store_dir: str) -> None:
        """The store's live epochs; none when the key file does not open the
        store (every chunk then counts as sealed under another key)."""
        from nvmetier import crypto
        from nvmetier.keyring import Keyring, KeyringError

        try:
            ring = Keyring.open(store_dir)
        except KeyringError:
            return
        try:
            skeys = ring.store_keys(self.keys)
            live, top = ring.load(skeys)
        except KeyringError:
            return
        finally:
            ring.close()
        self.native = crypto._native().Keys(ring.store_id, self.digest)
        self.native.set([(e.epoch, e.key, e.fingerprint) for e in live], -1, 0, 0, top)
        self.epochs = {e.epoch: e.fingerprint for e in live}

    def check(self, data: memoryview | bytes, rec: fmt.Record) -> str | None:
        """None when the payload verifies, ``"other_key"`` when it was sealed
        under a key this key file does not open (another key file, a
        destroyed epoch), else what is wrong."""
        if not self.sealed:
            digest = xxhash.xxh3_64_intdigest(data[: self.sb.chunk_bytes], fmt.key_seed(rec.key))
            return None if digest == rec.payload_checksum else "payload checksum mismatch"
        sealed = _sealed()
        trailer = data[self.row : self.sb.chunk_bytes]
        parsed = sealed.parse_trailer(trailer)
        if parsed is None:
            return "no sealed chunk trailer"
        _nonce, tag, epoch, fingerprint = parsed
        if self.native is None or self.epochs.get(epoch) != fingerprint:
            return "other_key"
        if sealed.checksum_of_tag(tag) != rec.payload_checksum:
            return "the record names another sealing of this slot"
        work = bytearray(data[: self.row])
        file_idx, offset = self.sb.slot_location(rec.slot)
        try:
            self.native.open(fmt.key_seed(rec.key), file_idx, offset, trailer, work, work)
        except OSError:
            return "authentication tag does not verify (tampered, torn or moved)"
        return None


def _sealed() -> Any:
    from nvmetier.engine import sealed

    return sealed


# --------------------------------------------------------------------- stores
def find_stores(root: str) -> list[str]:
    """The store directories ROOT names: ROOT itself when it holds a
    ``superblock``, else every direct subdirectory that does (sorted).

    Raises:
        FsckOperationalError: ROOT is missing, not a directory, unreadable,
            or holds no store.
    """
    if not os.path.exists(root):
        raise FsckOperationalError(f"{root!r} does not exist; give a root_dir or a store directory")
    if not os.path.isdir(root):
        raise FsckOperationalError(
            f"{root!r} is not a directory; give a root_dir or a store directory"
        )
    if os.path.exists(os.path.join(root, SUPERBLOCK_NAME)):
        return [root]
    try:
        names = sorted(os.listdir(root))
    except OSError as exc:
        raise FsckOperationalError(f"{root!r} cannot be listed: {exc.strerror}") from exc
    stores = [
        os.path.join(root, n)
        for n in names
        if os.path.isfile(os.path.join(root, n, SUPERBLOCK_NAME))
    ]
    if not stores and any(os.path.isfile(os.path.join(root, n, DATA_NAME)) for n in names):
        raise FsckOperationalError(
            f"{root!r} holds data files but no superblock: it is a secondary root_dir of a "
            "striped store; run fsck on the first root_dir entry"
        )
    if not stores:
        raise FsckOperationalError(
            f"{root!r} holds no nvmetier store (no superblock in it or in its subdirectories)"
        )
    return stores


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise


@contextlib.contextmanager
def store_lock(store_dir: str, write: bool) -> Iterator[list[int]]:
    """For a repair (``write``), hold the store exclusively for the block;
    for a check, only find out who is attached.

    Yields:
        The pids attached to the store (always empty for a repair).

    Raises:
        FsckOperationalError: a repair while processes are attached (or one
            is opening the store), or a lock file that cannot be opened.
    """
    if not write:
        yield sharer_pids(store_dir) if store_held(store_dir) else []
        return
    fds: list[int] = []
    try:
        for name in (INIT_LOCK_NAME, LOCK_NAME):
            lock_path = os.path.join(store_dir, name)
            try:
                fds.append(os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
            except OSError as exc:
                raise FsckOperationalError(
                    f"{lock_path!r} cannot be opened: {exc.strerror}"
                ) from exc
            try:
                locked = _try_flock(fds[-1])
            except OSError as exc:
                raise FsckOperationalError(
                    f"{lock_path!r} cannot be locked: {exc.strerror}"
                ) from exc
            if locked and name == INIT_LOCK_NAME:
                mark_init_busy(fds[-1])  # probes (info, a check) see the store in use
            if not locked:
                raise FsckOperationalError(
                    f"store {store_dir!r} is in use by another process (pid "
                    f"{holders(store_dir)}); --repair refuses to change a store "
                    "while processes are attached: stop them (vLLM shuts the tier down "
                    "cleanly) and run fsck --repair again, or check it live without --repair"
                )
        os.ftruncate(fds[-1], 0)
        os.pwrite(fds[-1], f"{os.getpid()}\n".encode(), 0)
        yield []
    finally:
        for fd in fds:
            os.close(fd)


# ------------------------------------------------------------------ progress
class Progress:
    """A one-line ``\\r`` progress bar on a terminal; silent otherwise."""

    def __init__(self, label: str, total: int, stream: TextIO | None, width: int = 30) -> None:
        self.label = label
        self.total = max(total, 1)
        self.stream = stream
        self.width = width
        self._last = 0.0

    def update(self, done: int, force: bool = False) -> None:
        if self.stream is None:
            return
        now = time.monotonic()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        frac = min(done / self.total, 1.0)
        fill = int(frac * self.width)
        bar = "#" * fill + "." * (self.width - fill)
        self.stream.write(f"\r{self.label} [{bar}] {frac:4.0%} {done}/{self.total}")
        self.stream.flush()

    def finish(self) -> None:
        if self.stream is None:
            return
        self.update(self.total, force=True)
        self.stream.write("\r\033[K")
        self.stream.flush()


# --------------------------------------------------------------------- checks
def _file_size(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None


def _check_size(res: StoreResult, name: str, kind: str, expected: int) -> bool:
    """One file of the store exists and is at least ``expected`` bytes."""
    path = os.path.join(res.path, name)
    size = _file_size(path)
    if size is None:
        res.errors.append(FsckError(f"{kind}_missing", f"{path!r} is missing"))
        return False
    if size < expected:
        res.errors.append(
            FsckError(f"{kind}_size", f"{path!r} is {size} bytes, expected {expected} (truncated)")
        )
        return False
    return True


def _check_files(res: StoreResult, sb: fmt.Superblock) -> tuple[bool, bool]:
    """Size checks. Returns (index usable, main data file usable)."""
    index_ok = _check_size(res, INDEX_NAME, "index", sb.index_bytes)
    data_ok = _check_size(res, DATA_NAME, "data", sb.data_file_bytes)
    return index_ok, data_ok


def _check_records(res: StoreResult, sb: fmt.Superblock, index: mmap.mmap) -> list[fmt.Record]:
    """Check every record by the rules a store open applies (``recovery.scan_index``:
    record checksum, fields, set placement, duplicates — the newest is kept).

    Returns the live records: exactly those a store open would keep.
    """
    scan = recovery.scan_index(index, sb.n_slots, sb.ways)
    for slot, reason in scan.bad:
        kind = _SCAN_KINDS.get(reason, "record")
        res.errors.append(FsckError(kind, f"slot {slot}: {reason}", slot))
    return [
        fmt.Record(slot, key, checksum, stored_ns)
        for slot, key, checksum, stored_ns in zip(
            scan.slots.tolist(),
            scan.keys,
            scan.payload_checksums.tolist(),
            scan.stored_ns.tolist(),
            strict=True,
        )
    ]


_SCAN_KINDS = {
    recovery.REASON_MISPLACED: "misplaced",
    recovery.REASON_DUPLICATE: "duplicate",
}


def _open_for_read(path: str, direct: bool) -> int:
    flags = os.O_RDONLY | os.O_CLOEXEC
    return os.open(path, flags | O_DIRECT) if direct and O_DIRECT else os.open(path, flags)


def _check_payloads(
    res: StoreResult,
    sb: fmt.Superblock,
    live: list[fmt.Record],
    stream: TextIO | None,
    payloads: _Payloads,
) -> None:
    """Read every live slot of the main data file and verify its checksum
    (or, sealed, its tag)."""
    data_path = os.path.join(res.path, DATA_NAME)
    mine = [r for r in live if sb.slot_location(r.slot)[0] == 0]
    res.deep_unchecked = len(live) - len(mine)
    # Read in file order: a sequential scan is what a disk does best.
    mine.sort(key=lambda r: r.slot)
    buf = mmap.mmap(-1, sb.slot_bytes)  # page aligned, as O_DIRECT needs
    direct = bool(O_DIRECT)
    try:
        fd = _open_for_read(data_path, direct)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        direct = False  # the filesystem refuses O_DIRECT at open
        fd = _open_for_read(data_path, direct)
    bar = Progress(f"{res.path}: reading", len(mine), stream)
    try:
        for i, rec in enumerate(mine):
            bar.update(i)
            _, offset = sb.slot_location(rec.slot)
            try:
                try:
                    got = os.preadv(fd, [buf], offset)
                except OSError as exc:
                    if not (direct and exc.errno == errno.EINVAL):
                        raise
                    # Took O_DIRECT at open but refuses the read: go buffered.
                    os.close(fd)
                    direct = False
                    fd = _open_for_read(data_path, direct)
                    got = os.preadv(fd, [buf], offset)
            except OSError as exc:
                res.errors.append(
                    FsckError(
                        "read_error",
                        f"slot {rec.slot}: read failed: {exc.strerror} (errno {exc.errno})",
                        rec.slot,
                    )
                )
                continue
            if got < sb.chunk_bytes:
                res.errors.append(
                    FsckError(
                        "read_error",
                        f"slot {rec.slot}: short read ({got} of {sb.chunk_bytes} bytes)",
                        rec.slot,
                    )
                )
                continue
            res.deep_checked += 1
            with memoryview(buf) as view:
                problem = payloads.check(view, rec)
            if problem == "other_key":
                res.deep_other_key += 1
            elif problem is not None:
                res.errors.append(
                    FsckError(
                        "payload", f"slot {rec.slot}: {problem} for key {rec.key.hex()}", rec.slot
                    )
                )
        bar.finish()
    finally:
        res.o_direct = direct
        os.close(fd)
        buf.close()


_LIVE_RETRIES = 3
_LIVE_PAUSE_S = 0.05


def _confirm_live(
    res: StoreResult,
    sb: fmt.Superblock,
    index: mmap.mmap,
    live: list[fmt.Record],
    payloads: _Payloads | None = None,
) -> None:
    """On a live store, keep only findings that survive re-reading.

    A sharer rewrites records and slots while we read: a record caught
    mid-write, or a payload read after its slot was claimed for another key,
    is not corruption. A finding is kept only when, after short pauses, the
    record bytes are unchanged and still fail (records), or the record is
    unchanged and the payload still fails (payloads).
    """
    rb = fmt.RECORD_BYTES
    by_slot = {r.slot: r for r in live}
    for _ in range(_LIVE_RETRIES):
        pending = [e for e in res.errors if e.slot is not None and e.kind != "read_error"]
        if not pending:
            return
        slots = [e.slot for e in pending if e.slot is not None]
        before = {slot: bytes(index[slot * rb : (slot + 1) * rb]) for slot in slots}
        time.sleep(_LIVE_PAUSE_S)
        for e in pending:
            slot = e.slot if e.slot is not None else 0
            now = bytes(index[slot * rb : (slot + 1) * rb])
            changed = now != before[slot]
            if e.kind == "payload":
                rec = by_slot.get(slot)
                still = (
                    rec is not None
                    and not changed
                    and now[32 : 32 + len(rec.key)] == rec.key
                    and payloads is not None
                    and _payload_fails(res, sb, rec, payloads)
                )
            else:
                still = not changed and _record_fails(now, slot, sb)
            if not still:
                res.errors.remove(e)


def _record_fails(raw: bytes, slot: int, sb: fmt.Superblock) -> bool:
    try:
        rec = fmt.unpack_record(raw, slot)
    except fmt.RecordError:
        return True
    return rec is not None and fmt.set_of(rec.key, sb.n_sets) != slot // sb.ways


def _payload_fails(
    res: StoreResult, sb: fmt.Superblock, rec: fmt.Record, payloads: _Payloads
) -> bool:
    file_idx, offset = sb.slot_location(rec.slot)
    if file_idx != 0:
        return False
    with open(os.path.join(res.path, DATA_NAME), "rb", buffering=0) as f:
        data = os.pread(f.fileno(), sb.chunk_bytes, offset)
    return payloads.check(data, rec) not in (None, "other_key")


def _repair(res: StoreResult) -> None:
    """Zero the record of every slot with a record-level error."""
    bad = sorted({e.slot for e in res.errors if e.kind in RECORD_KINDS and e.slot is not None})
    if not bad:
        return
    path = os.path.join(res.path, INDEX_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        for slot in bad:
            off = slot * fmt.RECORD_BYTES
            if os.pwrite(fd, fmt.EMPTY_RECORD, off) != fmt.RECORD_BYTES:
                raise OSError(errno.EIO, f"short write of the record of slot {slot}")
        os.fsync(fd)
        if hook.recorder is not None:
            hook.recorder.fsync(path)
    finally:
        os.close(fd)
    fixed = set(bad)
    for e in res.errors:
        if e.kind in RECORD_KINDS and e.slot in fixed:
            e.repaired = True


def check_store(
    store_dir: str,
    *,
    deep: bool = False,
    repair: bool = False,
    stream: TextIO | None = None,
    keys: Any = None,
) -> StoreResult:
    """Check one store directory (and repair it if ``repair``).

    Args:
        store_dir: a directory holding a ``superblock``.
        deep: also read every live slot and verify its payload checksum.
        repair: zero the records that fail; never touches good ones.
        stream: where the progress bar goes (None: no progress bar).
        keys: the operator key's ``crypto.KeySet``, to verify the tags of an
            encrypted store with ``deep`` (without it, exit 8 says so).

    Returns:
        The result; operational failures (in use, unreadable) are recorded in
        ``operational_error`` rather than raised.
    """
    res = StoreResult(path=store_dir, deep=deep)
    t0 = time.monotonic()
    try:
        with store_lock(store_dir, write=repair) as attached:
            res.sharers = attached
            _check_locked(res, deep, repair, stream, keys)
    except FsckOperationalError as exc:
        res.operational_error = str(exc)
    except OSError as exc:
        where = f" {exc.filename!r}" if exc.filename else ""
        res.operational_error = (
            f"store {store_dir!r}:{where} {exc.strerror or exc} (errno {exc.errno})"
        )
    res.elapsed_s = time.monotonic() - t0
    return res


def _check_locked(
    res: StoreResult, deep: bool, repair: bool, stream: TextIO | None, keys: Any = None
) -> None:
    sb_path = os.path.join(res.path, SUPERBLOCK_NAME)
    with open(sb_path, "rb") as f:
        raw = f.read()
    try:
        sb = fmt.unpack_superblock(raw, where=sb_path)
    except FormatError as exc:
        res.errors.append(FsckError("superblock", str(exc)))
        if isinstance(exc, FormatVersionError):
            res.format_version = exc.version  # another nvmetier's store, not damage
        return
    res.identity = sb.identity
    res.format_version = sb.format_version
    res.slots, res.ways, res.n_paths = sb.n_slots, sb.ways, sb.n_paths
    res.chunk_bytes, res.slot_bytes = sb.chunk_bytes, sb.slot_bytes
    res.clean_shutdown = sb.clean
    index_ok, data_ok = _check_files(res, sb)
    if not index_ok:
        return
    with open(os.path.join(res.path, INDEX_NAME), "rb") as f:
        # Sized again on this very file: an ephemeral store's last close may
        # have removed it and a new open created it since _check_files.
        if os.fstat(f.fileno()).st_size < sb.index_bytes:
            res.operational_error = (
                f"store {res.path!r}: its index changed while it was checked (an ephemeral "
                "store removed and created again by its users); run nvmetier fsck again"
            )
            return
        index = mmap.mmap(f.fileno(), sb.index_bytes, access=mmap.ACCESS_READ)
    try:
        live = _check_records(res, sb, index)
        if res.sharers:
            _confirm_live(res, sb, index, live)
        res.encrypted = "encryption" in sb.identity
        if deep and res.encrypted and keys is None:
            res.deep_no_key = True  # nothing to verify tags with
            deep = False
            res.deep_unchecked = len(live)
        if deep and data_ok:
            payloads = _Payloads(sb, keys, res.path)
            _check_payloads(res, sb, live, stream, payloads)
            if res.sharers:
                _confirm_live(res, sb, index, live, payloads)
            bad = {e.slot for e in res.errors if e.kind == "payload"}
            live = [r for r in live if r.slot not in bad]
    finally:
        index.close()
    if deep and not data_ok:
        res.deep_unchecked = len(live)
    res.live = len(live)
    if repair:
        _repair(res)


def fsck(
    root: str,
    *,
    deep: bool = False,
    repair: bool = False,
    stream: TextIO | None = None,
    keys: Any = None,
) -> list[StoreResult]:
    """Check every store ROOT names (see ``find_stores``).

    Raises:
        FsckOperationalError: ROOT names no store.
    """
    return [
        check_store(d, deep=deep, repair=repair, stream=stream, keys=keys)
        for d in find_stores(root)
    ]


def overall_exit(results: list[StoreResult]) -> int:
    """The exit codes of the stores OR-ed together, as e2fsck does."""
    code = 0
    for r in results:
        code |= r.exit_code
    return code


# Re-exported: the names ``nvmetier.fsck`` always had (the report needs the
# names above, so it is imported last).
from nvmetier.fsck_report import MAX_ERRORS_SHOWN as MAX_ERRORS_SHOWN  # noqa: E402
from nvmetier.fsck_report import format_result as format_result  # noqa: E402
from nvmetier.fsck_report import progress_stream as progress_stream  # noqa: E402
