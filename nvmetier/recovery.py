"""Index recovery at open: which records of the index file can be proven valid.

Owns: the classification of every index record at open time (valid, empty, or
bad with a reason) and the resolution of duplicate keys. It reads the mapped
index and never writes it: the caller (``StoreFiles._scan_records``, when the
first process attaches) zeroes the bad records and loads the valid ones into
the shared slot table; fsck and info apply the same rules.

Called once per open by the thread that opens the store; blocks for one pass
over the index (about 0.1-0.3 s per million slots with the native scan). A
pure function of its arguments: no locks, no I/O beyond the page faults of
the mapping, callable from any thread.

Two implementations that must give identical results:

- native: ``nvmetier._uring.scan_records`` walks every record in C without the
  GIL (zero check, record checksum, field checks, key hash, placement) and
  ``nvmetier._uring.record_keys`` builds the key objects;
- fallback: numpy finds the non-empty records and checks the fields; a Python
  loop over python-xxhash computes the checksums and key hashes. Used when the
  extension is not built, or forced with ``NVMETIER_NO_NATIVE_SCAN=1``.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import traceback
from typing import Any

import numpy as np
import xxhash

from nvmetier import format as fmt

try:  # The extension is optional (see setup.py); an old build lacks the scan.
    import nvmetier._uring as _native

    _native_scan: Any = getattr(_native, "scan_records", None)
    _native_keys: Any = getattr(_native, "record_keys", None)
except ImportError:  # pragma: no cover - depends on the build
    _native_scan = _native_keys = None

NO_NATIVE_ENV = "NVMETIER_NO_NATIVE_SCAN"

# Reason codes, shared with native/nvt_recovery.c (same numbers). The check
# order follows format.unpack_record: the first failing check names the record.
_CODE_OK = 0
_CODE_BAD_MAGIC = 1
_CODE_CHECKSUM = 2
_CODE_BAD_STATE = 3
_CODE_WRONG_SLOT = 4
_CODE_KEY_LEN = 5
_CODE_MISPLACED = 6
_CODE_DUPLICATE = 7

REASON_BAD_MAGIC = "bad magic"
REASON_CHECKSUM = "checksum mismatch"
REASON_BAD_STATE = "bad state"
REASON_WRONG_SLOT = "wrong slot"
REASON_KEY_LEN = "key_len > 88"
REASON_MISPLACED = "misplaced"
REASON_DUPLICATE = "duplicate"
_REASONS = (
    "",
    REASON_BAD_MAGIC,
    REASON_CHECKSUM,
    REASON_BAD_STATE,
    REASON_WRONG_SLOT,
    REASON_KEY_LEN,
    REASON_MISPLACED,
    REASON_DUPLICATE,
)

# The record layout of format.py as a numpy structured dtype.
# Changing the record layout requires bumping FORMAT_VERSION (and this dtype).
RECORD_DTYPE = np.dtype(
    [
        ("magic", "<u4"),
        ("state", "u1"),
        ("key_len", "u1"),
        ("_reserved", "<u2"),
        ("payload_checksum", "<u8"),
        ("stored_ns", "<u8"),
        ("_reserved2", "<u4"),
        ("slot", "<u4"),
        ("key", "V88"),
        ("checksum", "<u8"),
    ]
)
assert RECORD_DTYPE.itemsize == fmt.RECORD_BYTES, RECORD_DTYPE.itemsize
_KEY_OFFSET = 32
assert RECORD_DTYPE.fields is not None and RECORD_DTYPE.fields["key"][1] == _KEY_OFFSET
_BODY_BYTES = fmt.RECORD_BYTES - 8
assert _KEY_OFFSET + fmt.KEY_MAX_BYTES == _BODY_BYTES


@dataclasses.dataclass
class ScanResult:
    """What an index scan proved.

    Attributes:
        slots: int64, ascending: the slots whose record verifies, sits in its
            key's hash set and is the newest record of its key.
        keys: the key of each of those slots (exactly ``key_len`` bytes).
        payload_checksums: uint64, the payload checksum of each slot.
        stored_ns: uint64, the store time (unix ns) of each slot.
        bad: ``(slot, reason)``, ascending by slot, of every record that is not
            all zeros and not kept; reason is one of the ``REASON_*`` strings.
    """

    slots: np.ndarray
    keys: list[bytes]
    payload_checksums: np.ndarray
    stored_ns: np.ndarray
    bad: list[tuple[int, str]]

    @property
    def newest_ns(self) -> int:
        """The largest ``stored_ns`` kept, 0 when nothing was."""
        return int(self.stored_ns.max()) if len(self.stored_ns) else 0


def native_available() -> bool:
    """Whether the native scan is built (regardless of ``NVMETIER_NO_NATIVE_SCAN``)."""
    return _native_scan is not None and _native_keys is not None


def scan_index(
    index: memoryview | mmap.mmap | bytes | bytearray,
    n_slots: int,
    ways: int,
    *,
    native: bool | None = None,
    with_keys: bool = True,
) -> ScanResult:
    """Classify every record of an index without modifying it.

    A record is kept when it is valid (magic, record checksum seeded with its
    slot, state VALID, slot field equal to its position, ``key_len <= 88``),
    its slot lies in its key's hash set (``key_seed(key) % (n_slots // ways)``)
    and no other record of the same key is newer. Among records of one key the
    newest ``stored_ns`` is kept (the lowest slot on a tie); the others are
    reported as ``"duplicate"``. All-zero records are empty and not reported.

    Args:
        index: at least ``n_slots * RECORD_BYTES`` readable, contiguous bytes.
        n_slots: records to scan, a multiple of ``ways``.
        ways: slots per hash set.
        native: True to require the native scan, False to force the Python
            one, None (default) for native when built and not disabled by
            ``NVMETIER_NO_NATIVE_SCAN=1``.
        with_keys: False leaves ``keys`` empty (the shared table reads keys
            from the records itself): no Python object per record, so the
            scan leaves no private memory behind.

    Returns:
        The kept slots with their keys and fields, and the bad records.

    Raises:
        ValueError: bad geometry or an index shorter than ``n_slots`` records.
        RuntimeError: ``native=True`` and the native scan is not built.
    """
    if ways < 1 or n_slots < 0 or n_slots % ways:
        raise ValueError(f"n_slots={n_slots} must be a multiple of ways={ways} (ways >= 1)")
    if native is None:
        native = native_available() and os.environ.get(NO_NATIVE_ENV, "") not in ("1", "true")
    elif native and not native_available():
        raise RuntimeError("the native index scan (nvmetier._uring.scan_records) is not built")
    with memoryview(index) as view:
        nbytes = view.nbytes
    if nbytes < n_slots * fmt.RECORD_BYTES:
        raise ValueError(f"index of {nbytes} bytes is shorter than {n_slots} records")
    try:
        return _scan(index, n_slots, ways, native, with_keys)
    except BaseException as exc:
        # The frames of the traceback hold numpy views of ``index``; an mmap
        # cannot close while they live, so drop them before the caller cleans up.
        traceback.clear_frames(exc.__traceback__)
        raise


def _scan(index: Any, n_slots: int, ways: int, native: bool, with_keys: bool = True) -> ScanResult:
    recs = np.frombuffer(index, dtype=RECORD_DTYPE, count=n_slots)
    if native:
        slots, codes, seeds = _scan_native(index, n_slots, ways)
    else:
        slots, codes, seeds = _scan_python(index, recs, n_slots, ways)

    pos = np.flatnonzero(codes == _CODE_OK)  # positions in slots/codes/seeds
    kept = slots[pos]

    def keys_of(at: np.ndarray, recs: np.ndarray = recs) -> list[bytes]:
        return _native_keys(index, at) if native else _keys_python(index, recs, at)

    keys = keys_of(kept) if with_keys else []

    # Duplicates: records of one key share its hash, so equal seeds are the only
    # candidates; a sort finds them (none in a healthy index) in one pass.
    kept_seeds = seeds[pos]
    stored_ns = recs["stored_ns"][kept]
    by_value = np.sort(kept_seeds)
    same = by_value[1:] == by_value[:-1]
    if same.any():
        dup_values = np.unique(by_value[1:][same])
        candidates = np.flatnonzero(np.isin(kept_seeds, dup_values)).tolist()
        cand_keys = (
            keys if with_keys else dict(zip(candidates, keys_of(kept[candidates]), strict=True))
        )
        losers = _duplicate_losers(candidates, cand_keys, kept.tolist(), stored_ns.tolist())
        if losers:
            codes[pos[losers]] = _CODE_DUPLICATE
            keep = np.ones(len(kept), dtype=bool)
            keep[losers] = False
            kept_idx = np.flatnonzero(keep)
            if with_keys:
                keys = [keys[i] for i in kept_idx.tolist()]
            kept, stored_ns = kept[kept_idx], stored_ns[kept_idx]

    bad_pos = np.flatnonzero(codes != _CODE_OK)
    bad = list(
        zip(slots[bad_pos].tolist(), [_REASONS[c] for c in codes[bad_pos].tolist()], strict=True)
    )
    payload = recs["payload_checksum"][kept]
    del recs  # drop the export of ``index`` (an mmap cannot close while exported)
    return ScanResult(
        slots=kept.astype(np.int64, copy=False),
        keys=keys,
        payload_checksums=payload.astype(np.uint64, copy=False),
        stored_ns=stored_ns.astype(np.uint64, copy=False),
        bad=bad,
    )


def _duplicate_losers(
    candidates: list[int],
    keys: list[bytes] | dict[int, bytes],
    slots: list[int],
    stored_ns: list[int],
) -> list[int]:
    """Positions (ascending) of the records that a newer record of the same key
    supersedes. Equal hashes with different keys are not duplicates."""
    groups: dict[bytes, list[int]] = {}
    for i in candidates:
        groups.setdefault(keys[i], []).append(i)
    losers: list[int] = []
    for group in groups.values():
        if len(group) > 1:
            winner = max(group, key=lambda i: (stored_ns[i], -slots[i]))
            losers.extend(i for i in group if i != winner)
    return sorted(losers)


def _scan_native(index: Any, n_slots: int, ways: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # np.empty is lazily backed: only the pages written are touched.
    slots = np.empty(n_slots, dtype=np.int64)
    codes = np.empty(n_slots, dtype=np.uint8)
    seeds = np.empty(n_slots, dtype=np.uint64)
    m = _native_scan(index, n_slots, ways, slots, codes, seeds)
    return slots[:m], codes[:m], seeds[:m]


def _scan_python(
    index: Any, recs: np.ndarray, n_slots: int, ways: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The fallback twin of native/nvt_recovery.c: same slots, codes and seeds."""
    words = np.frombuffer(index, dtype=np.uint64, count=n_slots * fmt.RECORD_BYTES // 8)
    slots = np.flatnonzero(words.reshape(n_slots, fmt.RECORD_BYTES // 8).any(axis=1))
    del words
    slots = slots.astype(np.int64, copy=False)
    fields = recs[slots]
    codes = np.zeros(len(slots), dtype=np.uint8)
    seeds = np.zeros(len(slots), dtype=np.uint64)

    codes[fields["magic"] != fmt.RECORD_MAGIC] = _CODE_BAD_MAGIC
    todo = np.flatnonzero(codes == _CODE_OK)
    with memoryview(index) as view, view.cast("B") as mv:
        body = _BODY_BYTES
        rb = fmt.RECORD_BYTES
        digest = xxhash.xxh3_64_intdigest
        stored = fields["checksum"][todo].tolist()
        mismatch = [
            i
            for i, slot, want in zip(todo.tolist(), slots[todo].tolist(), stored, strict=True)
            if digest(mv[slot * rb : slot * rb + body], slot) != want
        ]
        codes[mismatch] = _CODE_CHECKSUM
        for code, failed in (
            (_CODE_BAD_STATE, fields["state"] != fmt.STATE_VALID),
            (_CODE_WRONG_SLOT, fields["slot"] != slots),
            (_CODE_KEY_LEN, fields["key_len"] > fmt.KEY_MAX_BYTES),
        ):
            codes[failed & (codes == _CODE_OK)] = code
        todo = np.flatnonzero(codes == _CODE_OK)
        key_lens = fields["key_len"][todo].tolist()
        seeds[todo] = np.fromiter(
            (
                digest(mv[slot * rb + _KEY_OFFSET : slot * rb + _KEY_OFFSET + kl])
                for slot, kl in zip(slots[todo].tolist(), key_lens, strict=True)
            ),
            dtype=np.uint64,
            count=len(key_lens),
        )
    n_sets = np.uint64(max(1, n_slots // ways))
    home = (seeds % n_sets).astype(np.int64)
    codes[(codes == _CODE_OK) & (home != slots // ways)] = _CODE_MISPLACED
    return slots, codes, seeds


def _keys_python(index: Any, recs: np.ndarray, slots: np.ndarray) -> list[bytes]:
    """The keys of valid records, exactly ``key_len`` bytes (trailing zeros kept)."""
    key_lens = recs["key_len"][slots].tolist()
    rb = fmt.RECORD_BYTES
    with memoryview(index) as view, view.cast("B") as mv:
        return [
            bytes(mv[s * rb + _KEY_OFFSET : s * rb + _KEY_OFFSET + kl])
            for s, kl in zip(slots.tolist(), key_lens, strict=True)
        ]
