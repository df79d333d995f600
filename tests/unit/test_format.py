"""On-disk format: superblock and index records (no disk)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nvmetier import format as fmt
from nvmetier.errors import FormatError

IDENT = {"model_name": "m", "dtype": "float16", "chunk_bytes": 65536}


def _sb(**kw: object) -> fmt.Superblock:
    base = dict(
        chunk_bytes=65536,
        slot_bytes=65536,
        n_slots=64,
        ways=16,
        n_paths=2,
        created_ns=123,
        identity=IDENT,
    )
    base.update(kw)
    return fmt.Superblock(**base)  # type: ignore[arg-type]


def test_superblock_round_trips() -> None:
    sb = _sb(clean=True)
    data = fmt.pack_superblock(sb)
    assert len(data) % fmt.ALIGN_BYTES == 0
    assert fmt.unpack_superblock(data) == sb


def test_superblock_grows_for_a_long_identity() -> None:
    ident = {"layers": [f"model.layers.{i}.self_attn.attn" for i in range(200)]}
    sb = _sb(identity=ident)
    data = fmt.pack_superblock(sb)
    assert len(data) > fmt.ALIGN_BYTES
    assert fmt.unpack_superblock(data).identity == ident


@pytest.mark.parametrize("offset", [0, 9, 20, 100, 4090])
def test_superblock_bit_flip_is_detected(offset: int) -> None:
    data = bytearray(fmt.pack_superblock(_sb()))
    data[offset] ^= 0x10
    with pytest.raises(FormatError):
        fmt.unpack_superblock(bytes(data))


def test_superblock_of_another_version_names_the_fix() -> None:
    sb = dataclasses.replace(_sb(), format_version=fmt.FORMAT_VERSION + 1)
    with pytest.raises(FormatError, match="remove the store directory"):
        fmt.unpack_superblock(fmt.pack_superblock(sb))


def test_superblock_with_bad_magic_is_not_a_store() -> None:
    with pytest.raises(FormatError, match="not an nvmetier store"):
        fmt.unpack_superblock(b"X" * 4096)


def test_record_round_trips() -> None:
    key = bytes(range(36))
    raw = fmt.pack_record(7, key, 0xDEADBEEF, 99)
    assert len(raw) == fmt.RECORD_BYTES
    rec = fmt.unpack_record(raw, 7)
    assert rec == fmt.Record(7, key, 0xDEADBEEF, 99)


def test_empty_record_reads_as_none() -> None:
    assert fmt.unpack_record(fmt.EMPTY_RECORD, 3) is None


def test_record_is_bound_to_its_slot() -> None:
    raw = fmt.pack_record(7, b"k" * 36, 1, 2)
    with pytest.raises(fmt.RecordError):
        fmt.unpack_record(raw, 8)


@given(st.integers(0, fmt.RECORD_BYTES * 8 - 1))
def test_any_record_bit_flip_is_detected(bit: int) -> None:
    raw = bytearray(fmt.pack_record(5, b"q" * 36, 42, 43))
    raw[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(fmt.RecordError):
        fmt.unpack_record(bytes(raw), 5)


def test_torn_record_is_detected() -> None:
    old = fmt.pack_record(5, b"a" * 36, 1, 1)
    new = fmt.pack_record(5, b"b" * 36, 2, 2)
    torn = new[:64] + old[64:]
    with pytest.raises(fmt.RecordError):
        fmt.unpack_record(torn, 5)


def test_overlong_key_is_refused() -> None:
    with pytest.raises(ValueError):
        fmt.pack_record(0, b"x" * (fmt.KEY_MAX_BYTES + 1), 0, 0)


@given(
    capacity=st.integers(1 << 20, 1 << 40),
    chunk=st.sampled_from([4096, 65536, 262144, 2 << 20, 12288]),
    ways=st.integers(1, 64),
    paths=st.integers(1, 4),
)
def test_geometry_never_exceeds_capacity(capacity: int, chunk: int, ways: int, paths: int) -> None:
    try:
        slot_bytes, n_slots = fmt.geometry(capacity, chunk, ways, paths, IDENT)
    except FormatError:
        return
    sb = _sb(chunk_bytes=chunk, slot_bytes=slot_bytes, n_slots=n_slots, ways=ways, n_paths=paths)
    # Superblock + its temporary copy + two lock files + one block per directory.
    reserved = 2 * sb.superblock_bytes + 2 * 4096 + paths * 4096
    assert fmt.reserved_bytes(IDENT, paths) == reserved
    used = reserved + fmt.align_up(sb.index_bytes) + sb.table_bytes + n_slots * slot_bytes
    assert used <= capacity
    assert n_slots % (ways * paths) == 0
    # Nearly all of the budget is used: less than one more unit would fit.
    one_unit = (ways * paths) * (slot_bytes + fmt.RECORD_BYTES) + paths * fmt.table_set_bytes(ways)
    assert capacity - used < one_unit + 3 * 4096


def test_geometry_too_small_says_what_is_needed() -> None:
    with pytest.raises(FormatError, match="needs at least"):
        fmt.geometry(100_000, 65536, 16, 1, IDENT)


def test_slot_location_stripes_over_paths() -> None:
    sb = _sb()
    assert [sb.slot_location(s) for s in range(4)] == [(0, 0), (1, 0), (0, 65536), (1, 65536)]


def test_key_seed_differs_per_key() -> None:
    assert fmt.key_seed(b"a") != fmt.key_seed(b"b")


@pytest.mark.parametrize("ways", [1, 3, 16, 64, 100, 1024])
def test_table_size_matches_the_native_layout(ways: int) -> None:
    _table = pytest.importorskip("nvmetier._table")
    n_slots = ways * 10
    assert fmt.table_bytes(n_slots, ways) == fmt.align_up(_table.table_bytes(n_slots, ways))
