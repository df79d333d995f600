"""Index recovery (``nvmetier.recovery.scan_index``): what a scan keeps and what
it reports, for the native scan and its Python twin. No disk: each index is
built in a bytearray with ``format.pack_record``."""

from __future__ import annotations

import mmap
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nvmetier import format as fmt
from nvmetier import recovery
from nvmetier.recovery import ScanResult, scan_index

N_SLOTS = 32
WAYS = 4
N_SETS = N_SLOTS // WAYS
RB = fmt.RECORD_BYTES
_BODY = struct.Struct("<IBBHQQII88s")

needs_native = pytest.mark.skipif(
    not recovery.native_available(), reason="native extension nvmetier._uring is not built"
)
ENGINES = [pytest.param(True, id="native", marks=needs_native), pytest.param(False, id="python")]


@pytest.fixture(params=ENGINES)
def native(request: pytest.FixtureRequest) -> bool:
    return request.param


def key_in_set(target: int, start: int = 0, suffix: bytes = b"\0\0\0\0") -> bytes:
    """A vLLM-like key (hash bytes + 4-byte big-endian group, here zero) whose
    hash set is ``target``."""
    i = start
    while True:
        key = b"blockhash-%06d" % i + suffix
        if fmt.set_of(key, N_SETS) == target:
            return key
        i += 1


def home(key: bytes, way: int = 0) -> int:
    return fmt.set_of(key, N_SETS) * WAYS + way


def empty_index(n_slots: int = N_SLOTS) -> bytearray:
    return bytearray(n_slots * RB)


def put(buf: bytearray, slot: int, record: bytes) -> None:
    buf[slot * RB : (slot + 1) * RB] = record


def forge(
    slot: int,
    key: bytes,
    *,
    magic: int = fmt.RECORD_MAGIC,
    state: int = fmt.STATE_VALID,
    key_len: int | None = None,
    slot_field: int | None = None,
    payload: int = 7,
    stored_ns: int = 1000,
) -> bytes:
    """A record with any field values and a checksum that verifies at ``slot``."""
    body = _BODY.pack(
        magic,
        state,
        len(key) if key_len is None else key_len,
        0,
        payload,
        stored_ns,
        0,
        slot if slot_field is None else slot_field,
        key,
    )
    return body + struct.pack("<Q", fmt.record_checksum(body, slot))


def scan(buf: bytes | bytearray, native: bool, n_slots: int = N_SLOTS) -> ScanResult:
    return scan_index(buf, n_slots, WAYS, native=native)


def one_bad(buf: bytearray, native: bool) -> str:
    res = scan(buf, native)
    assert len(res.bad) == 1, res.bad
    return res.bad[0][1]


# --- basics -------------------------------------------------------------------
def test_empty_index_keeps_and_reports_nothing(native: bool) -> None:
    res = scan(empty_index(), native)
    assert res.slots.dtype == np.int64 and len(res.slots) == 0
    assert res.keys == [] and res.bad == []
    assert len(res.payload_checksums) == 0 and len(res.stored_ns) == 0
    assert res.newest_ns == 0


def test_zero_slots_is_an_empty_result(native: bool) -> None:
    res = scan_index(b"", 0, WAYS, native=native)
    assert len(res.slots) == 0 and res.bad == []


def test_every_valid_record_is_kept_with_its_fields(native: bool) -> None:
    buf = empty_index()
    expected = {}
    i = 0
    for s in range(N_SETS):
        for way in range(WAYS):
            key = key_in_set(s, start=i)
            i = int(key[10:16]) + 1
            slot = s * WAYS + way
            put(buf, slot, fmt.pack_record(slot, key, 1000 + slot, 5000 + slot))
            expected[slot] = key
    res = scan(buf, native)
    assert res.slots.tolist() == list(range(N_SLOTS))
    assert res.keys == [expected[s] for s in range(N_SLOTS)]
    assert res.payload_checksums.tolist() == [1000 + s for s in range(N_SLOTS)]
    assert res.stored_ns.tolist() == [5000 + s for s in range(N_SLOTS)]
    assert res.bad == []
    assert res.newest_ns == 5000 + N_SLOTS - 1


def test_scan_does_not_modify_the_index(native: bool) -> None:
    buf = empty_index()
    key = key_in_set(3)
    put(buf, home(key), fmt.pack_record(home(key), key, 1, 2))
    put(buf, 0, b"\xff" * RB)
    before = bytes(buf)
    scan(buf, native)
    assert bytes(buf) == before


def test_scan_reads_an_mmap(native: bool) -> None:
    key = key_in_set(2)
    with mmap.mmap(-1, N_SLOTS * RB) as mm:
        mm[home(key) * RB : (home(key) + 1) * RB] = fmt.pack_record(home(key), key, 1, 2)
        res = scan_index(mm, N_SLOTS, WAYS, native=native)
        assert res.keys == [key]
        del res
        # No export of the mapping survives the scan: it can close.


def test_scan_reads_a_memoryview(native: bool) -> None:
    buf = empty_index()
    key = key_in_set(5)
    put(buf, home(key, 2), fmt.pack_record(home(key, 2), key, 1, 2))
    with memoryview(buf) as view:
        assert scan_index(view, N_SLOTS, WAYS, native=native).slots.tolist() == [home(key, 2)]


def test_only_the_first_n_slots_are_scanned(native: bool) -> None:
    buf = empty_index(N_SLOTS * 2)
    put(buf, N_SLOTS, b"\x01" * RB)
    assert scan(buf, native).bad == []


# --- keys -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "suffix",
    [b"\0\0\0\0", b"\0\0\0\x01", b"\0" * 40, b""],
    ids=["group0", "group1", "many_zeros", "none"],
)
def test_key_trailing_zero_bytes_are_kept(native: bool, suffix: bytes) -> None:
    buf = empty_index()
    key = key_in_set(1, suffix=suffix)
    put(buf, home(key), fmt.pack_record(home(key), key, 1, 2))
    assert scan(buf, native).keys == [key]


def test_empty_and_longest_keys_are_kept(native: bool) -> None:
    buf = empty_index()
    longest = b"\0" * (fmt.KEY_MAX_BYTES - 1) + b"\x01"
    for way, key in enumerate((b"", longest)):
        put(buf, home(key, way), fmt.pack_record(home(key, way), key, 1, 2))
    res = scan(buf, native)
    assert sorted(res.keys) == sorted([b"", longest])
    assert all(type(k) is bytes for k in res.keys)


# --- bad records ------------------------------------------------------------------
def test_bit_flip_in_body_is_a_checksum_mismatch(native: bool) -> None:
    buf = empty_index()
    key = key_in_set(4)
    slot = home(key)
    rec = bytearray(fmt.pack_record(slot, key, 1, 2))
    rec[40] ^= 0x10
    put(buf, slot, bytes(rec))
    assert scan(buf, native).bad == [(slot, recovery.REASON_CHECKSUM)]


def test_bit_flip_in_stored_checksum_is_a_checksum_mismatch(native: bool) -> None:
    buf = empty_index()
    key = key_in_set(4)
    rec = bytearray(fmt.pack_record(home(key), key, 1, 2))
    rec[RB - 1] ^= 0x80
    put(buf, home(key), bytes(rec))
    assert one_bad(buf, native) == recovery.REASON_CHECKSUM


def test_bit_flip_in_magic_is_bad_magic(native: bool) -> None:
    buf = empty_index()
    key = key_in_set(4)
    rec = bytearray(fmt.pack_record(home(key), key, 1, 2))
    rec[0] ^= 0x01
    put(buf, home(key), bytes(rec))
    assert one_bad(buf, native) == recovery.REASON_BAD_MAGIC


def test_torn_record_head_only_is_a_checksum_mismatch(native: bool) -> None:
    buf = empty_index()
    key = key_in_set(6)
    rec = fmt.pack_record(home(key), key, 1, 2)
    put(buf, home(key), rec[:64] + bytes(64))
    assert one_bad(buf, native) == recovery.REASON_CHECKSUM


def test_torn_record_tail_only_is_bad_magic(native: bool) -> None:
    buf = empty_index()
    key = key_in_set(6)
    rec = fmt.pack_record(home(key), key, 1, 2)
    put(buf, home(key), bytes(64) + rec[64:])
    assert one_bad(buf, native) == recovery.REASON_BAD_MAGIC


def test_record_copied_to_another_slot_is_a_checksum_mismatch(native: bool) -> None:
    buf = empty_index()
    key = key_in_set(6)
    put(buf, home(key, 1), fmt.pack_record(home(key, 0), key, 1, 2))
    assert scan(buf, native).bad == [(home(key, 1), recovery.REASON_CHECKSUM)]


def test_wrong_slot_number_with_a_valid_checksum(native: bool) -> None:
    buf = empty_index()
    key = key_in_set(6)
    put(buf, home(key, 1), forge(home(key, 1), key, slot_field=home(key, 0)))
    assert scan(buf, native).bad == [(home(key, 1), recovery.REASON_WRONG_SLOT)]


@pytest.mark.parametrize("state", [fmt.STATE_EMPTY, 2, 255])
def test_unknown_state_with_a_valid_checksum_is_bad_state(native: bool, state: int) -> None:
    buf = empty_index()
    key = key_in_set(0)
    put(buf, home(key), forge(home(key), key, state=state))
    assert one_bad(buf, native) == recovery.REASON_BAD_STATE


@pytest.mark.parametrize("key_len", [fmt.KEY_MAX_BYTES + 1, 255])
def test_key_len_over_88_with_a_valid_checksum(native: bool, key_len: int) -> None:
    buf = empty_index()
    put(buf, 9, forge(9, b"\xab" * fmt.KEY_MAX_BYTES, key_len=key_len))
    assert scan(buf, native).bad == [(9, recovery.REASON_KEY_LEN)]


def test_record_outside_its_key_set_is_misplaced(native: bool) -> None:
    buf = empty_index()
    key = key_in_set(2)
    wrong = ((2 + 1) % N_SETS) * WAYS
    put(buf, wrong, fmt.pack_record(wrong, key, 1, 2))
    assert scan(buf, native).bad == [(wrong, recovery.REASON_MISPLACED)]


def test_junk_record_is_reported(native: bool) -> None:
    buf = empty_index()
    put(buf, 31, bytes(range(RB)))
    assert scan(buf, native).bad == [(31, recovery.REASON_BAD_MAGIC)]


@pytest.mark.parametrize("newest_way", [0, 1, 3])
def test_duplicate_key_keeps_the_newest_record(native: bool, newest_way: int) -> None:
    buf = empty_index()
    key = key_in_set(7)
    for way in (0, 1, 3):
        ns = 900 if way == newest_way else 100 + way
        put(buf, home(key, way), fmt.pack_record(home(key, way), key, way, ns))
    res = scan(buf, native)
    assert res.slots.tolist() == [home(key, newest_way)]
    assert res.keys == [key] and res.stored_ns.tolist() == [900]
    assert res.payload_checksums.tolist() == [newest_way]
    assert res.bad == [
        (home(key, w), recovery.REASON_DUPLICATE) for w in (0, 1, 3) if w != newest_way
    ]


def test_duplicate_key_with_equal_times_keeps_the_lowest_slot(native: bool) -> None:
    buf = empty_index()
    key = key_in_set(7)
    for way in (2, 3):
        put(buf, home(key, way), fmt.pack_record(home(key, way), key, way, 500))
    res = scan(buf, native)
    assert res.slots.tolist() == [home(key, 2)]
    assert res.bad == [(home(key, 3), recovery.REASON_DUPLICATE)]


def test_bad_records_are_listed_in_slot_order(native: bool) -> None:
    buf = empty_index()
    for slot in (30, 2, 17):
        put(buf, slot, b"\x01" * RB)
    assert [s for s, _ in scan(buf, native).bad] == [2, 17, 30]


# --- arguments ---------------------------------------------------------------------
def test_index_shorter_than_n_slots_raises(native: bool) -> None:
    with pytest.raises(ValueError, match="shorter"):
        scan_index(bytes(RB * 3), 4, 4, native=native)


@pytest.mark.parametrize(("n_slots", "ways"), [(30, 4), (32, 0), (-4, 4)])
def test_bad_geometry_raises(native: bool, n_slots: int, ways: int) -> None:
    with pytest.raises(ValueError, match="multiple of ways"):
        scan_index(empty_index(), n_slots, ways, native=native)


@pytest.mark.skipif(recovery.native_available(), reason="the native scan is built")
def test_requiring_a_missing_native_scan_raises() -> None:
    with pytest.raises(RuntimeError, match="not built"):
        scan_index(empty_index(), N_SLOTS, WAYS, native=True)


def test_env_forces_the_python_scan_with_the_same_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    buf = empty_index()
    key = key_in_set(1)
    put(buf, home(key), fmt.pack_record(home(key), key, 1, 2))
    put(buf, 0, b"\x02" * RB)
    monkeypatch.setenv(recovery.NO_NATIVE_ENV, "1")
    assert_same(scan_index(buf, N_SLOTS, WAYS), scan(buf, native=False))


# --- random mixes: native == Python == a record-by-record reference ---------------
_KEYS = [key_in_set(s, start=100 * k) for s in range(N_SETS) for k in range(2)] + [
    b"",
    b"\0" * 4,
    b"k" * fmt.KEY_MAX_BYTES,
]
# "valid" weighs 4x so that sets fill up and duplicates of a key are common.
_KINDS = ["empty", *["valid"] * 4, "flip", "torn", "junk", "state", "slot", "key_len", "copy"]

slot_plans = st.lists(
    st.tuples(
        st.sampled_from(_KINDS),
        st.integers(0, len(_KEYS) - 1),
        st.integers(0, 2**64 - 1),  # stored_ns
        st.integers(0, RB * 8 - 1),  # bit to flip / byte to tear at
        st.booleans(),  # place the key in this slot's set if it can
    ),
    min_size=N_SLOTS,
    max_size=N_SLOTS,
)


def build(plan: list[tuple[str, int, int, int, bool]]) -> bytearray:
    buf = empty_index()
    for slot, (kind, k, ns, bit, placed) in enumerate(plan):
        key = _KEYS[k]
        if placed:
            same_set = [x for x in _KEYS if fmt.set_of(x, N_SETS) == slot // WAYS]
            key = same_set[k % len(same_set)]
        ns %= 1 << 10 if kind == "valid" else 1 << 64  # small range: ties happen
        rec = fmt.pack_record(slot, key, k, ns)
        if kind == "empty":
            continue
        if kind == "flip":
            b = bytearray(rec)
            b[bit // 8] ^= 1 << (bit % 8)
            rec = bytes(b)
        elif kind == "torn":
            rec = rec[: bit // 8] + bytes(RB - bit // 8)
        elif kind == "junk":
            rec = bytes((bit + i) % 256 for i in range(RB))
        elif kind == "state":
            rec = forge(slot, key, state=2 + bit % 250)
        elif kind == "slot":
            rec = forge(slot, key, slot_field=(slot + 1 + bit) % 2**32)
        elif kind == "key_len":
            rec = forge(slot, key.ljust(fmt.KEY_MAX_BYTES, b"x"), key_len=89 + bit % 167)
        elif kind == "copy":
            rec = fmt.pack_record((slot + 1) % N_SLOTS, key, k, ns)
        put(buf, slot, rec)
    return buf


def reference(buf: bytes) -> tuple[list[tuple[int, bytes, int, int]], list[tuple[int, str]]]:
    """Record-by-record model of scan_index, independent of recovery.py."""
    bad: dict[int, str] = {}
    found = []
    for slot in range(N_SLOTS):
        rec = bytes(buf[slot * RB : (slot + 1) * RB])
        if rec == fmt.EMPTY_RECORD:
            continue
        magic, state, key_len, _, payload, ns, _, rslot, key = _BODY.unpack_from(rec)
        (checksum,) = struct.unpack_from("<Q", rec, RB - 8)
        key = key[:key_len]
        if magic != fmt.RECORD_MAGIC:
            bad[slot] = recovery.REASON_BAD_MAGIC
        elif checksum != fmt.record_checksum(rec[: RB - 8], slot):
            bad[slot] = recovery.REASON_CHECKSUM
        elif state != fmt.STATE_VALID:
            bad[slot] = recovery.REASON_BAD_STATE
        elif rslot != slot:
            bad[slot] = recovery.REASON_WRONG_SLOT
        elif key_len > fmt.KEY_MAX_BYTES:
            bad[slot] = recovery.REASON_KEY_LEN
        elif fmt.set_of(key, N_SETS) != slot // WAYS:
            bad[slot] = recovery.REASON_MISPLACED
        else:
            found.append((slot, key, payload, ns))
    best: dict[bytes, tuple[int, bytes, int, int]] = {}
    for rec in found:
        old = best.get(rec[1])
        if old is None or (rec[3], -rec[0]) > (old[3], -old[0]):
            best[rec[1]] = rec
    kept = sorted(best.values())
    for rec in found:
        if rec not in kept:
            bad[rec[0]] = recovery.REASON_DUPLICATE
    return kept, sorted(bad.items())


def assert_same(a: ScanResult, b: ScanResult) -> None:
    assert a.slots.dtype == b.slots.dtype == np.int64
    assert a.slots.tolist() == b.slots.tolist()
    assert a.keys == b.keys
    assert a.payload_checksums.tolist() == b.payload_checksums.tolist()
    assert a.stored_ns.tolist() == b.stored_ns.tolist()
    assert a.bad == b.bad


@settings(max_examples=300, deadline=None)
@given(plan=slot_plans)
def test_random_mix_matches_the_reference_model(plan: list) -> None:
    buf = build(plan)
    kept, bad = reference(buf)
    res = scan(buf, native=False)
    assert list(zip(res.slots.tolist(), res.keys, res.payload_checksums.tolist(),
                    res.stored_ns.tolist(), strict=True)) == kept  # fmt: skip
    assert res.bad == bad
    if recovery.native_available():
        assert_same(scan(buf, native=True), res)


@settings(max_examples=100, deadline=None)
@given(plan=slot_plans)
def test_kept_records_unpack_and_first_five_reasons_do_not(plan: list) -> None:
    buf = build(plan)
    res = scan(buf, native=recovery.native_available())
    for slot, key in zip(res.slots.tolist(), res.keys, strict=True):
        rec = fmt.unpack_record(bytes(buf[slot * RB : (slot + 1) * RB]), slot)
        assert rec is not None and rec.key == key
    unpackable = (recovery.REASON_MISPLACED, recovery.REASON_DUPLICATE)
    for slot, reason in res.bad:
        if reason not in unpackable:
            with pytest.raises(fmt.RecordError):
                fmt.unpack_record(bytes(buf[slot * RB : (slot + 1) * RB]), slot)


# --- the native functions' own argument checks ------------------------------------
@needs_native
def test_native_record_keys_rejects_a_slot_outside_the_index() -> None:
    from nvmetier import _uring

    with pytest.raises(IndexError):
        _uring.record_keys(empty_index(), np.array([N_SLOTS], dtype=np.int64))


@needs_native
def test_native_scan_rejects_short_outputs() -> None:
    from nvmetier import _uring

    out = np.empty(N_SLOTS - 1, dtype=np.int64)
    codes = np.empty(N_SLOTS, dtype=np.uint8)
    with pytest.raises(ValueError, match="out_slots"):
        _uring.scan_records(empty_index(), N_SLOTS, WAYS, out, codes, out)
