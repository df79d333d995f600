"""Encryption at rest on real files (``encryption: {"key_file": ...}``):
round trips through both engines, nothing in the clear on disk, a wrong or
rotated key, a tampered chunk, trailer or record, unique nonces."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("nvmetier._crypto")

from nvmetier import format as fmt
from nvmetier import purge
from nvmetier.engine.sealed import TRAILER_BYTES, parse_trailer
from nvmetier.errors import ConfigError, FormatError
from tests.integration.helpers import ROW, key, load_keys, make_store, payload, store_keys

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def key_file(tmp_path) -> str:
    return new_key(tmp_path, "key")


def new_key(tmp_path, name: str) -> str:
    path = tmp_path / name
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return str(path)


def sealed(tmp_path, buffer, key_path: str, **kw):
    return make_store(str(tmp_path / "kv"), buffer, encryption={"key_file": key_path}, **kw)


def files_of(tmp_path) -> tuple[str, str]:
    d = tmp_path / "kv" / "store"
    return str(d / "data"), str(d / "index")


def slot_offset(store, k: bytes) -> int:
    slot = store.slot_of(k)
    assert slot is not None
    _f, off = store.sb.slot_location(slot)
    return int(off)


@pytest.mark.parametrize("o_direct", [True, False], ids=["odirect", "buffered"])
def test_sealed_chunks_load_back_byte_for_byte(tmp_path, buffer, key_file, o_direct) -> None:
    store = sealed(tmp_path, buffer, key_file, o_direct=o_direct)
    keys = [key(i) for i in range(40)]
    (outcome,) = store_keys(store, buffer, keys)
    assert outcome.success
    # Sealing never touches the primary's bytes (vLLM keeps using them).
    assert all(bytes(buffer[i * ROW : (i + 1) * ROW]) == payload(k) for i, k in enumerate(keys))
    loaded, good = load_keys(store, buffer, keys)
    assert loaded.success and good == keys
    assert store.describe()["encryption"] == "aes-256-gcm/v1"
    store.close()
    store = sealed(tmp_path, buffer, key_file)  # and after a restart
    loaded, good = load_keys(store, buffer, keys)
    assert loaded.success and good == keys
    store.close()


def test_nothing_is_in_the_clear_on_disk(tmp_path, buffer, key_file) -> None:
    store = sealed(tmp_path, buffer, key_file)
    keys = [os.urandom(36) for _ in range(20)]  # vLLM's keys: 32-byte hashes + group
    store_keys(store, buffer, keys)
    store.close()
    with open(key_file, "rb") as f:
        secret = f.read()
    everything = b""
    for d, _dirs, fs in os.walk(tmp_path / "kv"):
        for name in fs:
            with open(os.path.join(d, name), "rb") as f:
                everything += f.read()
    for k in keys:
        assert payload(k)[:256] not in everything
        assert k not in everything and k[:32] not in everything
    assert secret not in everything


def test_another_key_file_is_refused_naming_both_keys_and_the_fix(tmp_path, buffer) -> None:
    # Format 4: the store's keys are wrapped by the key file that created it;
    # another key file opens nothing (and reads nothing), at open.
    a, b = new_key(tmp_path, "a"), new_key(tmp_path, "b")
    store = sealed(tmp_path, buffer, a)
    store_keys(store, buffer, [key(i) for i in range(8)])
    store.close()
    with pytest.raises(ConfigError, match="nvmetier rekey") as err:
        sealed(tmp_path, buffer, b)
    assert b in str(err.value)
    store = sealed(tmp_path, buffer, a)  # the right key still opens everything
    assert all(store.contains(key(i)) for i in range(8))
    store.close()


@pytest.mark.parametrize("staging", ["on", "off"])
def test_a_tampered_chunk_is_a_counted_miss_and_freed(tmp_path, buffer, key_file, staging) -> None:
    # staged: the slot image is read into the arena and opened into the row
    store = sealed(tmp_path, buffer, key_file, enable_kv_events=True, staging=staging)
    keys = [key(i) for i in range(8)]
    store_keys(store, buffer, keys)
    store.take_events()
    data, _index = files_of(tmp_path)
    off = slot_offset(store, keys[3]) + 1000
    with open(data, "r+b") as f:
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ 0x10]))
    outcome, good = load_keys(store, buffer, keys)
    assert not outcome.success and good == keys[:3] + keys[4:]
    stats = store.stats()
    assert stats["auth_failures"] == 1 and stats["checksum_failures"] == 1
    assert not store.contains(keys[3])
    assert store.take_events() == [(True, [keys[3]])]
    store.close()


@pytest.mark.parametrize("staging", ["on", "off"])
def test_a_tampered_trailer_is_a_miss(tmp_path, buffer, key_file, staging) -> None:
    # staged: the slot image is read into the arena and opened into the row
    store = sealed(tmp_path, buffer, key_file, staging=staging)
    keys = [key(i) for i in range(4)]
    store_keys(store, buffer, keys)
    data, _index = files_of(tmp_path)
    off = slot_offset(store, keys[1]) + ROW + 8  # the nonce
    with open(data, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 1]))
    _outcome, good = load_keys(store, buffer, keys)
    assert good == [keys[0], keys[2], keys[3]]
    assert store.stats()["auth_failures"] == 1
    store.close()


def test_a_tampered_record_is_dropped_at_open(tmp_path, buffer, key_file) -> None:
    store = sealed(tmp_path, buffer, key_file)
    keys = [key(i) for i in range(4)]
    store_keys(store, buffer, keys)
    slot = store.slot_of(keys[2])
    store.close()
    _data, index = files_of(tmp_path)
    with open(index, "r+b") as f:
        f.seek(slot * fmt.RECORD_BYTES + 40)  # inside the key MAC
        b = f.read(1)
        f.seek(slot * fmt.RECORD_BYTES + 40)
        f.write(bytes([b[0] ^ 1]))
    store = sealed(tmp_path, buffer, key_file)
    assert store.stats()["records_dropped_at_open"] == 1
    _outcome, good = load_keys(store, buffer, keys)
    assert good == [keys[0], keys[1], keys[3]]
    store.close()


def test_a_chunk_moved_under_another_keys_record_never_opens(tmp_path, buffer, key_file) -> None:
    # The attacker has the disk, not the key: copy K1's sealed slot over
    # K2's and make K2's record expect it (payload checksum, record checksum
    # recomputed). The tag binds the chunk to its key: K2 is a miss.
    store = sealed(tmp_path, buffer, key_file)
    k1, k2 = key(1), key(2)
    store_keys(store, buffer, [k1, k2])
    s1, s2 = store.slot_of(k1), store.slot_of(k2)
    o1, o2 = slot_offset(store, k1), slot_offset(store, k2)
    slot_bytes = store.sb.slot_bytes
    store.close()
    data, index = files_of(tmp_path)
    with open(data, "r+b") as f:
        f.seek(o1)
        sealed_k1 = f.read(slot_bytes)
        f.seek(o2)
        f.write(sealed_k1)
    with open(index, "r+b") as f:
        f.seek(s1 * fmt.RECORD_BYTES)
        r1 = fmt.unpack_record(f.read(fmt.RECORD_BYTES), s1)
        f.seek(s2 * fmt.RECORD_BYTES)
        r2 = fmt.unpack_record(f.read(fmt.RECORD_BYTES), s2)
        assert r1 is not None and r2 is not None
        forged = fmt.pack_record(s2, r2.key, r1.payload_checksum, r2.stored_ns)
        f.seek(s2 * fmt.RECORD_BYTES)
        f.write(forged)
    store = sealed(tmp_path, buffer, key_file)
    _outcome, good = load_keys(store, buffer, [k1, k2])
    assert good == [k1]
    assert store.stats()["auth_failures"] == 1
    store.close()


def test_every_write_gets_its_own_nonce(tmp_path, buffer, key_file) -> None:
    # Room for every key in its set whatever the keyed placement (the default
    # 16 MiB of 8 ways overflowed a set in ~2% of runs: a second-lifetime
    # store then evicted a first-lifetime chunk and its slot was read twice).
    room = {"capacity_bytes": "64MiB", "ways": 16}
    store = sealed(tmp_path, buffer, key_file, **room)
    keys = [key(i) for i in range(48)]
    store_keys(store, buffer, keys)
    offsets = [slot_offset(store, k) for k in keys]
    store.close()
    store = sealed(tmp_path, buffer, key_file, **room)  # a second process lifetime
    more = [key(500 + i) for i in range(16)]
    store_keys(store, buffer, more)
    offsets += [slot_offset(store, k) for k in more]
    assert all(store.slot_of(k) is not None for k in keys)  # nothing evicted
    store.close()
    assert len(set(offsets)) == 64  # 64 slots: a repeated nonce is a reused nonce
    data, _index = files_of(tmp_path)
    nonces = []
    with open(data, "rb") as f:
        for off in offsets:
            f.seek(off + ROW)
            parsed = parse_trailer(f.read(TRAILER_BYTES))
            assert parsed is not None
            nonces.append(parsed[0])
    assert len(set(nonces)) == len(nonces) == 64


def test_a_plaintext_store_is_never_opened_sealed(tmp_path, buffer, key_file) -> None:
    plain = make_store(str(tmp_path / "kv"), buffer)
    store_keys(plain, buffer, [key(1)])
    plain.close()
    with pytest.raises(FormatError):
        sealed(tmp_path, buffer, key_file)


def test_a_key_file_others_can_read_is_refused_at_open(tmp_path, buffer) -> None:
    path = new_key(tmp_path, "loose")
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        sealed(tmp_path, buffer, path)


def test_kv_events_name_the_offload_keys(tmp_path, buffer, key_file) -> None:
    store = sealed(tmp_path, buffer, key_file, enable_kv_events=True)
    keys = [key(i) for i in range(6)]
    store_keys(store, buffer, keys)
    events = store.take_events()
    assert not any(r for r, _ks in events)
    assert sorted(k for _r, ks in events for k in ks) == sorted(keys)
    (r,) = purge.purge(str(tmp_path / "kv"), older_than_s=None)
    assert r.removed == 6
    ((removed, got),) = store.take_events()
    assert removed and sorted(got) == sorted(keys)
    store.close()


def test_retention_and_purge_work_on_a_sealed_store(tmp_path, buffer, key_file) -> None:
    store = sealed(tmp_path, buffer, key_file, retention="1h")
    keys = [key(i) for i in range(6)]
    store_keys(store, buffer, keys)
    (r,) = purge.purge(str(tmp_path / "kv"), older_than_s=None)
    assert r.removed == 6 and not any(store.contains(k) for k in keys)
    store.close()


@pytest.mark.parametrize("engine", ["threads", "uring"])
@pytest.mark.parametrize("staging", ["on", "off"])
def test_a_sealed_store_stages_its_slot_images_only_when_staging_is_on(
    tmp_path, buffer, key_file, engine, staging
) -> None:
    # With staging the sealed slot image lives in the engine's huge-page
    # arena (sealed into it, opened out of it into the row); without it the
    # engine seals into its own bounce slot and opens in place. Both round-trip.
    if engine == "uring":
        from nvmetier.engine import uring_status

        if not uring_status()[0]:
            pytest.skip("io_uring unavailable")
    store = sealed(tmp_path, buffer, key_file, staging=staging, engine=engine)
    try:
        d = store.describe()
        assert d["engine"] == engine
        assert d["staging"] is (staging == "on")
        keys = [key(i) for i in range(16)]
        (outcome,) = store_keys(store, buffer, keys)
        assert outcome.success
        loaded, good = load_keys(store, buffer, keys)
        assert loaded.success and good == keys
        staged = store.engine.describe()["staged_bytes"]
        if staging == "on":
            # every store and every load went through the arena
            assert staged >= 2 * len(keys) * ROW
        else:
            assert staged == 0
    finally:
        store.close()
