"""Adversarial review of the destroyed-epoch classification (nvt_seal.h:
nvt_keys_open's -EKEYREVOKED, nvt_keys_set's destroyed list): what an
attacker who controls ``Keys.set``'s input (a crafted ``keys`` file) or a
trailer can make of it. None of these may serve a byte, crash the process,
or turn a live epoch into a destroyed one. Native key table only (< 1 s)."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest

native = pytest.importorskip("nvmetier._crypto")

from nvmetier.engine.sealed import TRAILER_BYTES  # noqa: E402
from tests.integration.helpers import ROW as ROW_BYTES  # noqa: E402
from tests.integration.test_sealed_key_destroyed import ENGINES  # noqa: E402

ROW = 4096
MAX = 8192  # nvt_seal.h NVT_MAX_EPOCHS
FAR = 10**12  # seal window end, ns from now


def _ents(epochs):
    return [(e, os.urandom(32), os.urandom(8)) for e in epochs]


def _sealed_under(table, ents, epoch: int, row: bytes) -> bytearray:
    table.set(ents, epoch, time.time_ns() + FAR, 1 << 28, max(e for e, _k, _f in ents))
    slot = bytearray(ROW + TRAILER_BYTES)
    table.seal(5, 0, 0, row, slot)
    return slot


def _open(table, slot: bytes, dst: bytearray | None = None) -> int:
    try:
        table.open(
            5, 0, 0, bytes(slot[ROW:]), bytes(slot[:ROW]), bytearray(ROW) if dst is None else dst
        )
    except OSError as exc:
        return exc.errno or -1
    return 0


def _relabel(slot: bytearray, epoch: int) -> bytearray:
    out = bytearray(slot)
    out[ROW + 36 : ROW + 40] = epoch.to_bytes(4, "little")  # the trailer's epoch
    return out


def test_destroyed_is_a_keyword_as_documented() -> None:
    # Keys.set's docstring and the CHANGELOG name it ``destroyed=``.
    t = native.Keys(bytes(16), 7)
    ents = _ents([1, 2])
    slot = _sealed_under(t, ents, 1, os.urandom(ROW))
    t.set(ents[1:], -1, 0, 0, 2, destroyed=[1])
    assert _open(t, slot) == errno.EKEYREVOKED


def test_a_live_epoch_named_destroyed_still_opens() -> None:
    # A crafted keys file naming a live epoch destroyed too (a duplicate
    # entry): the live entry wins, the chunk is served intact.
    row = os.urandom(ROW)
    t = native.Keys(bytes(16), 7)
    ents = _ents([3, 4])
    slot = _sealed_under(t, ents, 4, row)
    t.set(ents, 4, time.time_ns() + FAR, 1 << 28, 4, 0, [4, 4, 3, 4])
    dst = bytearray(ROW)
    assert _open(t, slot, dst) == 0 and bytes(dst) == row


def test_unsorted_duplicate_and_extreme_epochs() -> None:
    t = native.Keys(bytes(16), 7)
    ents = _ents([10])
    slot = _sealed_under(t, ents, 10, os.urandom(ROW))
    t.set(ents, -1, 0, 0, 10, 0, [0xFFFFFFFF, 7, 0, 7, 3, 0xFFFFFFFF, 0])
    for e in (0, 3, 7, 0xFFFFFFFF):
        assert _open(t, _relabel(slot, e)) == errno.EKEYREVOKED, e
    for e in (1, 2, 4, 8, 9, 11, 0xFFFFFFFE):
        assert _open(t, _relabel(slot, e)) == errno.EBADMSG, e
    with pytest.raises(OverflowError):
        t.set(ents, -1, 0, 0, 10, 0, [-1])
    with pytest.raises(ValueError):
        t.set(ents, -1, 0, 0, 10, 0, [1 << 32])
    with pytest.raises(TypeError):
        t.set(ents, -1, 0, 0, 10, 0, 5)


def test_a_refused_set_leaves_the_table_as_it_was() -> None:
    row = os.urandom(ROW)
    t = native.Keys(bytes(16), 7)
    ents = _ents([1, 2])
    slot = _sealed_under(t, ents, 2, row)
    t.set(
        ents, 2, time.time_ns() + FAR, 1 << 28, 2, 0, list(range(100, 100 + MAX))
    )  # the cap: fine
    for bad in (list(range(MAX + 1)), [1, "x"], [1, 1 << 40]):
        with pytest.raises((ValueError, TypeError, OverflowError)):
            t.set([], -1, 0, 0, 2, 0, bad)
    dst = bytearray(ROW)
    assert _open(t, slot, dst) == 0 and bytes(dst) == row  # still held, still live
    assert _open(t, _relabel(slot, 100)) == errno.EKEYREVOKED


def test_the_destroyed_list_keeps_the_newest_at_its_cap() -> None:
    # Three full lists, then every held epoch dropped: the merge holds
    # 3 * MAX at once; the newest MAX stay, older ones fall back to EBADMSG.
    t = native.Keys(bytes(16), 7)
    top = 4 * MAX
    ents = _ents([top])
    slot = _sealed_under(t, ents, top, os.urandom(ROW))
    for base in (0, MAX, 2 * MAX):
        t.set(ents, -1, 0, 0, top, 0, list(range(base + MAX, base, -1)))
    t.set([], -1, 0, 0, top, 0, list(range(3 * MAX + 1, top)))  # top held before: now gone
    assert _open(t, slot) == errno.EKEYREVOKED
    assert _open(t, _relabel(slot, top - MAX + 1)) == errno.EKEYREVOKED
    assert _open(t, _relabel(slot, top - MAX)) == errno.EBADMSG
    assert _open(t, _relabel(slot, 1)) == errno.EBADMSG


def test_destroyed_leaves_dst_untouched_and_gives_no_checksum() -> None:
    t = native.Keys(bytes(16), 7)
    ents = _ents([1, 2])
    slot = _sealed_under(t, ents, 1, os.urandom(ROW))
    t.set(ents[1:], 2, time.time_ns() + FAR, 1 << 28, 2)
    dst = bytearray(b"\xa5" * ROW)
    assert _open(t, slot, dst) == errno.EKEYREVOKED
    assert dst == bytearray(b"\xa5" * ROW)


def test_reloads_racing_opens() -> None:
    # The rwlock: opens (GIL released) against reloads with full lists.
    row = os.urandom(ROW)
    t = native.Keys(bytes(16), 7)
    ents = _ents([MAX + 1])
    slot = _sealed_under(t, ents, MAX + 1, row)
    gone_slot = _relabel(slot, 5)
    t.set(ents, -1, 0, 0, MAX + 1, 0, [5])
    stop = threading.Event()
    bad: list[object] = []

    def opener() -> None:
        while not stop.is_set():
            dst = bytearray(ROW)
            rc = _open(t, slot, dst)
            if rc != 0 or bytes(dst) != row:
                bad.append(("live", rc))
            rc = _open(t, gone_slot)
            if rc != errno.EKEYREVOKED:
                bad.append(("gone", rc))

    threads = [threading.Thread(target=opener) for _ in range(2)]
    for th in threads:
        th.start()
    try:
        for i in range(30):
            lst = list(range(1, MAX + 1))[:: 1 if i % 2 else -1]
            t.set(ents, -1, 0, 0, MAX + 1, 0, lst)
    finally:
        stop.set()
        for th in threads:
            th.join()
    assert bad == []


def test_a_merge_of_three_full_tables() -> None:
    # Known destroyed (MAX) + the file's destroyed (MAX) + held and dropped
    # (MAX): the merge's scratch is exactly full (nvt_seal.c: merge_gone_locked).
    t = native.Keys(bytes(16), 7)
    top = 6 * MAX
    held = _ents(range(5 * MAX + 1, top + 1))
    slot = _sealed_under(t, held, top, os.urandom(ROW))
    t.set(held, -1, 0, 0, top, 0, list(range(2 * MAX + 1, 3 * MAX + 1)))
    t.set([], -1, 0, 0, top, 0, list(range(4 * MAX + 1, 5 * MAX + 1)))
    assert _open(t, slot) == errno.EKEYREVOKED
    assert _open(t, _relabel(slot, 5 * MAX + 1)) == errno.EKEYREVOKED
    assert _open(t, _relabel(slot, 5 * MAX)) == errno.EBADMSG


# ------------------------------------------------ a forged ``keys`` file
# Destroyed entries carry no key material and no MAC (only the entry's
# XXH3 checksum), so whoever can write ``keys`` can add any number of them.


def _forge_destroyed(store, epochs) -> None:
    from nvmetier import crypto

    ring = store._sealing.keyring
    used = {e.index for e in ring.epochs()}
    free = (i for i in range(crypto.KEYRING_ENTRIES) if i not in used)
    with ring._lock:
        for ep in epochs:
            e = crypto.Epoch(next(free), crypto.ENTRY_DESTROYED, ep, 0, 0, bytes(8), 1)
            ring._write_entry_locked(e)
    store._sealing._bump()  # announced, as a writer of `keys` does: sharers reload


@pytest.mark.parametrize("engine", ENGINES)
def test_a_forged_destroyed_entry_for_the_live_epoch_changes_nothing(
    tmp_path, buffer, engine
) -> None:
    from tests.integration.helpers import key, payload, store_keys
    from tests.integration.test_sealed_key_destroyed import _load_one, reload_keys, sealed

    store = sealed(tmp_path, buffer, engine)
    keys = [key(i) for i in range(4)]
    store_keys(store, buffer, keys)
    live = store._sealing.epoch
    _forge_destroyed(store, [live, live])
    reload_keys(store)
    assert store._sealing.epoch == live  # its own epoch is still live: no rotation
    o = _load_one(store, buffer, keys[1], job_id=2)
    assert o.success and bytes(buffer[:ROW_BYTES]) == payload(keys[1])
    store_keys(store, buffer, [key(9)], job_id=3)  # still seals
    o = _load_one(store, buffer, key(9), job_id=4)
    assert o.success and bytes(buffer[:ROW_BYTES]) == payload(key(9))
    stats = store.stats()
    assert stats["loads_key_destroyed"] == 0 and stats["auth_failures"] == 0
    store.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_trailer_relabelled_to_a_forged_destroyed_epoch_is_never_served(
    tmp_path, buffer, engine
) -> None:
    # With ``keys`` writable too, any epoch number can be made "destroyed"
    # (here one that never existed, below and above the newest): the
    # tampered load moves to loads_key_destroyed but is still a miss, freed.
    import struct

    from tests.integration.helpers import key, payload, store_keys
    from tests.integration.test_sealed_key_destroyed import (
        _load_one,
        _rewrite,
        _trailer_at,
        reload_keys,
        sealed,
    )

    store = sealed(tmp_path, buffer, engine)
    keys = [key(i) for i in range(4)]
    store_keys(store, buffer, keys)
    _forge_destroyed(store, [0, 1 << 20])
    reload_keys(store)
    for i, forged in ((1, 0), (2, 1 << 20)):
        path, at = _trailer_at(store, tmp_path, keys[i])
        _rewrite(path, at + 36, struct.pack("<I", forged))
        buffer[:ROW_BYTES] = bytes(ROW_BYTES)
        o = _load_one(store, buffer, keys[i], job_id=10 + i)
        assert not o.success and o.successful_keys == []
        # No key, so nothing was decrypted: the row never holds the chunk
        # (the threads engine reads the sealed bytes into it, then fails).
        assert bytes(buffer[:ROW_BYTES]) != payload(keys[i])
        assert not store.contains(keys[i])
    stats = store.stats()
    assert stats["loads_key_destroyed"] == 2 and stats["auth_failures"] == 0
    store.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_forged_last_epoch_number_is_a_clear_error_and_serves_what_was_stored(
    tmp_path, buffer, engine
) -> None:
    # A destroyed entry naming epoch 2**32 - 1 leaves no number for the next
    # epoch: the rotation fails with an error that names the keys file and
    # the fix (not a bare packing error), and the chunks already sealed are
    # still served. A store opened on the file refuses to start with the
    # same error.
    from nvmetier import crypto
    from tests.integration.helpers import key, make_store, payload, store_keys
    from tests.integration.test_sealed_key_destroyed import _load_one, reload_keys, sealed

    store = sealed(tmp_path, buffer, engine)
    keys = [key(i) for i in range(3)]
    store_keys(store, buffer, keys)
    _forge_destroyed(store, [crypto.EPOCH_LAST])
    with pytest.raises(crypto.KeyringError, match=r"keys.*epoch 4294967295.*remove the store"):
        store._sealing._rotate_locked()
    reload_keys(store)  # a reload is not a rotation: the live epoch stays
    o = _load_one(store, buffer, keys[1], job_id=7)
    assert o.success and bytes(buffer[:ROW_BYTES]) == payload(keys[1])
    store.close()
    with pytest.raises(crypto.KeyringError, match="epoch 4294967295"):
        make_store(
            str(tmp_path / "kv"),
            buffer,
            engine=engine,
            encryption={"key_file": str(tmp_path / "key")},
        )
