"""On-disk layout: the superblock and the index records. No I/O.

Owns: the byte-level format (see docs/format.md), ``FORMAT_VERSION``, and
pack/unpack/verify helpers. Pure functions, callable from any thread.

A store directory holds:

- ``superblock``: a versioned header with the store geometry and the layout
  identity (a JSON object), checksummed as a whole;
- ``index``: ``n_slots`` fixed-size records, one per slot, each with its own
  checksum (``RECORD_BYTES`` each, slot ``s`` at offset ``s * RECORD_BYTES``);
- ``table``: the process-shared slot table (``native/nvt_layout.h``), derived
  from the records and rebuilt from them when its consistency is not proven;
- ``data`` (in each root directory): the slots, ``slot_bytes`` each.
"""

from __future__ import annotations

import dataclasses
import json
import os.path
import struct
from typing import Any

import xxhash

from nvmetier.errors import FormatError, FormatVersionError

# Changing any layout below requires bumping FORMAT_VERSION.
# 2: the process-shared slot table (file ``table``) joined the store.
# 3: table v3: 64-bit lease/claim stamps, per-slot lease pins and epoch, a
#    flags byte per slot, the set mutex's holder in the set head.
# 4: sealed stores: a random data key per epoch wrapped in the file ``keys``
#    (no ``nonce`` file), random nonces, trailer v2 (epoch), the store and the
#    slot in the authenticated data; table header keys_gen at offset 80.
FORMAT_VERSION = 4
MAGIC = b"NVMETIER"
ALIGN_BYTES = 4096

# --- superblock -------------------------------------------------------------
_SB_HEAD = struct.Struct("<8sIIQQQIIIIQQII")
SB_HEAD_BYTES = _SB_HEAD.size
assert SB_HEAD_BYTES == 80, SB_HEAD_BYTES
SB_CHECKSUM_BYTES = 8
SB_FLAG_CLEAN = 1

# --- index record -----------------------------------------------------------
RECORD_BYTES = 128
RECORD_MAGIC = 0x5254564E  # "NVTR" little-endian
KEY_MAX_BYTES = 88
_REC = struct.Struct("<IBBHQQII88s")
assert _REC.size == RECORD_BYTES - 8, _REC.size
_REC_SUM = struct.Struct("<Q")
STATE_EMPTY = 0
STATE_VALID = 1
EMPTY_RECORD = bytes(RECORD_BYTES)

# --- shared slot table (native/nvt_layout.h holds the same layout) ------------
TABLE_HEADER_BYTES = 8192
TABLE_VERSION = 3  # native/nvt_layout.h NVT_TABLE_VERSION
TABLE_SET_HEAD_BYTES = 64
# Slot numbers are 32-bit in the table's ops and watches (NVT_MAX_SLOTS).
MAX_SLOTS = 2**32 - 1


def table_set_bytes(ways: int) -> int:
    """Bytes of one set of the table (``nvt_layout`` in native/nvt_layout.h):
    the 64-byte head, then arrays of tag, state, owner, flags (u8), owner_inc,
    pins (u16), last, gen, epoch (u32), stamp and fp (u64), each 8-byte
    aligned, padded to 64."""

    def a8(n: int) -> int:
        return (n + 7) // 8 * 8

    body = 4 * a8(ways) + 2 * a8(2 * ways) + 3 * a8(4 * ways) + 16 * ways
    return (TABLE_SET_HEAD_BYTES + body + 63) // 64 * 64


def table_bytes(n_slots: int, ways: int) -> int:
    """Size of the ``table`` file of a store of ``n_slots`` in sets of ``ways``
    (whole pages, so it can be mapped)."""
    return align_up(TABLE_HEADER_BYTES + (n_slots // ways) * table_set_bytes(ways))


def align_up(n: int, align: int = ALIGN_BYTES) -> int:
    return (n + align - 1) // align * align


@dataclasses.dataclass(frozen=True)
class Superblock:
    """The store's geometry and identity.

    Attributes:
        chunk_bytes: bytes of one chunk (one primary row).
        slot_bytes: bytes one slot occupies in a data file (aligned).
        n_slots: total slots over all data files.
        ways: slots per hash set.
        n_paths: data files (one per root directory); slot ``s`` lives in file
            ``s % n_paths`` at offset ``(s // n_paths) * slot_bytes``.
        created_ns: creation time (unix ns).
        identity: the layout identity; data is served only to the same one.
        clean: set at orderly shutdown, cleared while the store is open.
    """

    chunk_bytes: int
    slot_bytes: int
    n_slots: int
    ways: int
    n_paths: int
    created_ns: int
    identity: dict[str, Any]
    clean: bool = False
    format_version: int = FORMAT_VERSION

    @property
    def n_sets(self) -> int:
        return self.n_slots // self.ways

    @property
    def slots_per_path(self) -> int:
        return self.n_slots // self.n_paths

    @property
    def data_file_bytes(self) -> int:
        return self.slots_per_path * self.slot_bytes

    @property
    def index_bytes(self) -> int:
        return self.n_slots * RECORD_BYTES

    @property
    def table_bytes(self) -> int:
        return table_bytes(self.n_slots, self.ways)

    def identity_json(self) -> bytes:
        return identity_json(self.identity)

    @property
    def superblock_bytes(self) -> int:
        return align_up(SB_HEAD_BYTES + len(self.identity_json()) + SB_CHECKSUM_BYTES)

    def slot_location(self, slot: int) -> tuple[int, int]:
        """``(file index, byte offset)`` of ``slot``."""
        return slot % self.n_paths, (slot // self.n_paths) * self.slot_bytes


def identity_json(identity: dict[str, Any]) -> bytes:
    """Canonical JSON of a layout identity (sorted keys, no spaces)."""
    return json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()


def identity_digest(identity: dict[str, Any]) -> int:
    return xxhash.xxh3_64_intdigest(identity_json(identity))


def pack_superblock(sb: Superblock) -> bytes:
    ident = sb.identity_json()
    size = sb.superblock_bytes
    head = _SB_HEAD.pack(
        MAGIC,
        sb.format_version,
        size,
        sb.chunk_bytes,
        sb.slot_bytes,
        sb.n_slots,
        sb.ways,
        RECORD_BYTES,
        sb.n_paths,
        SB_FLAG_CLEAN if sb.clean else 0,
        sb.created_ns,
        xxhash.xxh3_64_intdigest(ident),
        len(ident),
        0,
    )
    body = bytearray(size)
    body[:SB_HEAD_BYTES] = head
    body[SB_HEAD_BYTES : SB_HEAD_BYTES + len(ident)] = ident
    body[-SB_CHECKSUM_BYTES:] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(body[:-8])))
    return bytes(body)


def superblock_version(data: bytes) -> int | None:
    """The format version a superblock's bytes declare, or None when they are
    not an nvmetier superblock (too short, bad magic). Reads nothing else, so
    it works for every version, past and future."""
    if len(data) < 12:
        return None
    magic, version = struct.unpack_from("<8sI", data)
    return int(version) if magic == MAGIC else None


def unpack_superblock(data: bytes, where: str = "superblock") -> Superblock:
    """Parse and verify a superblock.

    Raises:
        FormatError: bad magic, unknown version, bad checksum or geometry.
    """
    if len(data) < SB_HEAD_BYTES + SB_CHECKSUM_BYTES:
        raise FormatError(f"{where}: truncated superblock ({len(data)} bytes)")
    (
        magic,
        version,
        size,
        chunk_bytes,
        slot_bytes,
        n_slots,
        ways,
        record_bytes,
        n_paths,
        flags,
        created_ns,
        ident_hash,
        ident_len,
        _reserved,
    ) = _SB_HEAD.unpack_from(data)
    if magic != MAGIC:
        raise FormatError(f"{where}: not an nvmetier store (bad magic {magic!r})")
    if version != FORMAT_VERSION:
        store_dir = os.path.dirname(os.path.abspath(where)) if where != "superblock" else where
        raise FormatVersionError(
            f"{where}: store format version {version}, this nvmetier reads version "
            f"{FORMAT_VERSION}; the cache can be rebuilt: remove the store directory "
            f"{store_dir!r} (rm -r) to start a new cache there",
            version,
        )
    if size > len(data) or size % ALIGN_BYTES:
        raise FormatError(f"{where}: superblock size {size} does not match the file")
    (stored_sum,) = struct.unpack_from("<Q", data, size - 8)
    if stored_sum != xxhash.xxh3_64_intdigest(data[: size - 8]):
        raise FormatError(f"{where}: superblock checksum mismatch (corrupted header)")
    ident = data[SB_HEAD_BYTES : SB_HEAD_BYTES + ident_len]
    if xxhash.xxh3_64_intdigest(ident) != ident_hash:
        raise FormatError(f"{where}: identity checksum mismatch")
    if record_bytes != RECORD_BYTES or ways == 0 or n_paths == 0 or n_slots % (ways * n_paths):
        raise FormatError(
            f"{where}: inconsistent geometry (slots={n_slots}, ways={ways}, paths={n_paths})"
        )
    if slot_bytes < chunk_bytes or slot_bytes % ALIGN_BYTES:
        raise FormatError(f"{where}: slot_bytes {slot_bytes} invalid for chunk {chunk_bytes}")
    return Superblock(
        chunk_bytes=chunk_bytes,
        slot_bytes=slot_bytes,
        n_slots=n_slots,
        ways=ways,
        n_paths=n_paths,
        created_ns=created_ns,
        identity=json.loads(ident),
        clean=bool(flags & SB_FLAG_CLEAN),
        format_version=version,
    )


def geometry(
    capacity_bytes: int,
    chunk_bytes: int,
    ways: int,
    n_paths: int,
    identity: dict[str, Any],
    per_path_bytes: tuple[int, ...] | None = None,
) -> tuple[int, int]:
    """``(slot_bytes, n_slots)`` that fit ``capacity_bytes`` in total, or each
    path's own budget when ``per_path_bytes`` is given (path 0 also holds the
    superblock and the index; every path holds as many slots).

    Disk usage = superblock + index (``RECORD_BYTES`` per slot) + the shared
    slot table + data files, never more than ``capacity_bytes``. ``n_slots`` is a multiple of
    ``ways * n_paths`` so every set is whole and every drive holds as many.

    Raises:
        FormatError: when not even one set fits, or when the capacity holds
            ``MAX_SLOTS`` slots or more (the caller turns it into a
            ConfigError naming capacity_bytes).
    """
    slot_bytes = align_up(chunk_bytes)
    if per_path_bytes is not None:
        overhead = reserved_bytes(identity, 1)
        n_slots = _per_path_slots(per_path_bytes, slot_bytes, ways, overhead)
    else:
        n_slots = _total_slots(capacity_bytes, slot_bytes, ways, n_paths, identity)
    if n_slots >= MAX_SLOTS:
        raise FormatError(
            f"capacity of {capacity_bytes} bytes makes {n_slots} slots of {slot_bytes} bytes; "
            f"a store holds fewer than 2^32 slots (slot numbers are 32-bit in the shared "
            f"table): use larger chunks or a smaller capacity_bytes"
        )
    return slot_bytes, n_slots


def _total_slots(
    capacity_bytes: int, slot_bytes: int, ways: int, n_paths: int, identity: dict[str, Any]
) -> int:
    unit = ways * n_paths
    overhead = reserved_bytes(identity, n_paths)
    usable = capacity_bytes - overhead - TABLE_HEADER_BYTES
    per_slot = slot_bytes + RECORD_BYTES + -(-table_set_bytes(ways) // ways)
    n_slots = max(0, usable // per_slot) // unit * unit

    # The index and table files are rounded up to whole pages so they can be mapped.
    def fits(n: int) -> bool:
        return overhead + _meta_bytes(n, ways) + n * slot_bytes <= capacity_bytes

    while n_slots and not fits(n_slots):
        n_slots -= unit
    while fits(n_slots + unit):  # the estimate may round a unit too low
        n_slots += unit
    if n_slots == 0:
        need = overhead + _meta_bytes(unit, ways) + unit * slot_bytes
        raise FormatError(
            f"capacity of {capacity_bytes} bytes holds no complete set: one set of {ways} ways "
            f"over {n_paths} path(s) of {slot_bytes}-byte slots needs at least {need} bytes"
        )
    return n_slots


def _meta_bytes(n_slots: int, ways: int) -> int:
    """Index plus table file bytes of ``n_slots`` slots."""
    return align_up(n_slots * RECORD_BYTES) + table_bytes(n_slots, ways)


def reserved_bytes(identity: dict[str, Any], n_dirs: int) -> int:
    """Disk a store uses besides its index and data files, counted in the bound.

    The superblock twice (it is rewritten through a temporary file), the lock
    files (``lock``, one block once it holds a pid, and ``lock.init``) and one
    block per store directory.
    """
    sb_bytes = align_up(SB_HEAD_BYTES + len(identity_json(identity)) + SB_CHECKSUM_BYTES)
    return 2 * sb_bytes + 2 * ALIGN_BYTES + n_dirs * ALIGN_BYTES


def _per_path_slots(caps: tuple[int, ...], slot_bytes: int, ways: int, overhead: int) -> int:
    n = len(caps)
    meta_per_slot = RECORD_BYTES + -(-table_set_bytes(ways) // ways)
    spp = min(
        [max(0, c - ALIGN_BYTES) // slot_bytes for c in caps[1:]]
        + [max(0, caps[0] - overhead - TABLE_HEADER_BYTES) // (slot_bytes + n * meta_per_slot)]
    )
    spp = spp // ways * ways
    while spp and overhead + _meta_bytes(spp * n, ways) + spp * slot_bytes > caps[0]:
        spp -= ways
    while overhead + _meta_bytes((spp + ways) * n, ways) + (spp + ways) * slot_bytes <= caps[
        0
    ] and all(c - ALIGN_BYTES >= (spp + ways) * slot_bytes for c in caps[1:]):
        spp += ways
    if spp == 0:
        raise FormatError(
            f"per-path capacities {list(caps)} hold no complete set of {ways} ways of "
            f"{slot_bytes}-byte slots on every path"
        )
    return spp * n


def key_seed(key: bytes) -> int:
    """The checksum seed of a chunk: XXH3-64 of its key.

    Seeding the payload checksum with the key means bytes stored for one key
    never verify as another key's, even if an index record points at them.
    """
    return xxhash.xxh3_64_intdigest(key)


def record_checksum(body: bytes | memoryview, slot: int) -> int:
    """Checksum of a record body (first 120 bytes), bound to its slot number."""
    return xxhash.xxh3_64_intdigest(body, slot)


def pack_record(slot: int, key: bytes, payload_checksum: int, stored_ns: int) -> bytes:
    """The 128-byte record of a valid slot."""
    if len(key) > KEY_MAX_BYTES:
        raise ValueError(f"key of {len(key)} bytes exceeds {KEY_MAX_BYTES}")
    body = _REC.pack(
        RECORD_MAGIC, STATE_VALID, len(key), 0, payload_checksum, stored_ns, 0, slot, key
    )
    return body + _REC_SUM.pack(record_checksum(body, slot))


@dataclasses.dataclass(frozen=True, slots=True)
class Record:
    slot: int
    key: bytes
    payload_checksum: int
    stored_ns: int


class RecordError(ValueError):
    """A record that is neither empty nor valid (torn, flipped, misplaced)."""


def unpack_record(data: bytes | memoryview, slot: int) -> Record | None:
    """Parse the record of ``slot``: ``None`` for an empty record.

    Raises:
        RecordError: the record is not all zeros and does not verify.
    """
    if len(data) != RECORD_BYTES:
        raise RecordError(f"record of {len(data)} bytes")
    body = data[: RECORD_BYTES - 8]
    magic, state, key_len, _r, payload, stored_ns, _r2, rec_slot, key = _REC.unpack_from(body)
    if magic == 0 and state == STATE_EMPTY and bytes(data) == EMPTY_RECORD:
        return None
    (stored_sum,) = _REC_SUM.unpack_from(data, RECORD_BYTES - 8)
    if magic != RECORD_MAGIC:
        raise RecordError(f"slot {slot}: bad record magic {magic:#x}")
    if stored_sum != record_checksum(body, slot):
        raise RecordError(f"slot {slot}: record checksum mismatch")
    if state != STATE_VALID:
        raise RecordError(f"slot {slot}: unknown state {state}")
    if rec_slot != slot or key_len > KEY_MAX_BYTES:
        raise RecordError(f"slot {slot}: record belongs to slot {rec_slot}")
    return Record(slot, key[:key_len], payload, stored_ns)


def set_of(key: bytes, n_sets: int) -> int:
    """The hash set of ``key``: its ``key_seed`` modulo the set count."""
    return key_seed(key) % n_sets
