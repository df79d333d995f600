"""A sealed chunk whose data key was destroyed is a miss, not corruption:
``nvmetier purge --all`` of a busy sealed store (loads in flight, chunks
published between the purge's clearing and its key destruction) counts
those loads in ``loads_key_destroyed``, never in ``checksum_failures`` or
``auth_failures`` (the counters operators alert on for corruption and
tampering). A tag that does not verify, or a trailer naming an epoch that
never existed, still counts as an authentication failure (nvt_seal.h:
nvt_keys_open). Both engines."""

from __future__ import annotations

import errno
import os
import struct
import threading
import time
from collections.abc import Sequence

import pytest

pytest.importorskip("nvmetier._crypto")

from nvmetier import crypto, fsck, purge
from nvmetier.engine import uring_status
from nvmetier.engine.base import OP_READ, IoEngine
from nvmetier.engine.sealed import TRAILER_BYTES
from tests.integration.helpers import (
    ROW,
    HeldOps,
    fill_rows,
    key,
    make_store,
    payload,
    run,
    store_keys,
)

pytestmark = pytest.mark.timeout(120)

ENGINES = [
    "threads",
    pytest.param(
        "uring",
        marks=pytest.mark.skipif(not uring_status()[0], reason="io_uring unavailable"),
    ),
]


def new_key(tmp_path) -> str:
    path = tmp_path / "key"
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return str(path)


def sealed(tmp_path, buffer, engine: str, **kw):
    return make_store(
        str(tmp_path / "kv"),
        buffer,
        engine=engine,
        encryption={"key_file": new_key(tmp_path)},
        enable_kv_events=True,
        **kw,
    )


def fsck_deep(tmp_path) -> fsck.StoreResult:
    keys = crypto.KeySet(crypto.load_key_file(str(tmp_path / "key")))
    return fsck.check_store(str(tmp_path / "kv" / "store"), deep=True, keys=keys)


def reload_keys(store) -> None:
    """The store's key housekeeping, now (its thread does the same within a
    second): it sees the purge, reloads the key table and rotates."""
    store._sealing.housekeep()


def purge_all_with(tmp_path, meanwhile) -> purge.PurgeResult:
    """``purge --all`` of the live store, running ``meanwhile()`` after its
    sets are cleared and before its data keys are destroyed: the window in
    which a busy store publishes chunks under a key about to go."""
    real = purge._destroy_epochs

    def racing(store_dir: str, older_than_s: float | None) -> int:
        meanwhile()
        return real(store_dir, older_than_s)

    purge._destroy_epochs = racing
    try:
        (r,) = purge.purge(str(tmp_path / "kv"), older_than_s=None)
    finally:
        purge._destroy_epochs = real
    assert r.error is None and r.epochs_destroyed >= 1
    return r


def submit_load(store, buffer, keys: Sequence[bytes], rows: Sequence[int], job_id: int) -> None:
    for r in rows:
        buffer[r * ROW : (r + 1) * ROW] = bytes(ROW)
    store.submit_load(job_id, list(keys), list(rows))


def served(buffer, keys: Sequence[bytes], rows: Sequence[int]) -> list[bytes]:
    return [
        k for k, r in zip(keys, rows, strict=True) if buffer[r * ROW : (r + 1) * ROW] == payload(k)
    ]


def removed_events(store) -> list[bytes]:
    return [k for is_removed, ks in store.take_events() if is_removed for k in ks]


@pytest.mark.parametrize("engine", ENGINES)
def test_loads_in_flight_across_purge_all_are_misses_not_auth_failures(
    tmp_path, buffer, engine
) -> None:
    held: list[HeldOps] = []

    def wrap(inner: IoEngine) -> IoEngine:
        held.append(HeldOps(inner, OP_READ))
        return held[0]

    store = sealed(tmp_path, buffer, engine, engine_wrapper=wrap)
    before = [key(i) for i in range(8)]
    during = [key(100 + i) for i in range(8)]
    store_keys(store, buffer, before)
    store.take_events()
    held[0].hold = True
    submit_load(store, buffer, before, range(16, 24), job_id=2)  # in flight: purged under it

    def meanwhile() -> None:
        # Published after the purge cleared its set, sealed under the key the
        # purge is about to destroy; a load of them is in flight across it.
        fill_rows(buffer, during, range(8, 16))
        store.submit_store(3, during, list(range(8, 16)))
        deadline = time.monotonic() + 30
        while not all(store.contains(k) for k in during) and time.monotonic() < deadline:
            store.poll()
            time.sleep(0.01)
        assert all(store.contains(k) for k in during)
        submit_load(store, buffer, during, range(32, 40), job_id=4)

    purge_all_with(tmp_path, meanwhile)
    assert held[0].held() == 16
    reload_keys(store)  # the destroyed epoch is now known to this process
    held[0].release()
    outcomes = {o.job_id: o for o in run(store)}
    assert not outcomes[2].success and not outcomes[4].success
    assert outcomes[4].successful_keys == []
    assert served(buffer, during, range(32, 40)) == []  # no byte of a destroyed key
    ok = list(outcomes[2].successful_keys or [])
    assert served(buffer, ok, [16 + before.index(k) for k in ok]) == ok  # nothing wrong
    stats = store.stats()
    assert stats["checksum_failures"] == 0 and stats["auth_failures"] == 0
    assert stats["loads_key_destroyed"] == len(during)
    assert not any(store.contains(k) for k in during)  # freed: nothing opens them again
    assert set(during) <= set(removed_events(store))
    # The store goes on under its new epoch.
    again = [key(200 + i) for i in range(4)]
    (o,) = store_keys(store, buffer, again, job_id=5)
    assert o.success
    submit_load(store, buffer, again, range(40, 44), job_id=6)
    (o,) = run(store)
    assert o.success and served(buffer, again, range(40, 44)) == again
    store.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_chunks_published_before_their_key_was_purged_load_as_key_destroyed(
    tmp_path, buffer, engine
) -> None:
    # No wrapper: the io_uring engine's workers apply completions themselves.
    store = sealed(tmp_path, buffer, engine)
    during = [key(100 + i) for i in range(8)]

    def meanwhile() -> None:
        fill_rows(buffer, during, range(8))
        store.submit_store(1, during, list(range(8)))
        (o,) = run(store)
        assert o.success

    purge_all_with(tmp_path, meanwhile)
    store.take_events()
    reload_keys(store)
    # fsck --deep counts them as sealed under a key it cannot open, not damage.
    res = fsck_deep(tmp_path)
    assert res.errors == [] and res.deep_other_key == len(during)
    submit_load(store, buffer, during, range(8), job_id=2)
    (o,) = run(store)
    assert not o.success and o.successful_keys == []
    assert served(buffer, during, range(8)) == []
    stats = store.stats()
    assert stats["checksum_failures"] == 0 and stats["auth_failures"] == 0
    assert stats["loads_key_destroyed"] == len(during)
    assert not any(store.contains(k) for k in during)
    assert sorted(removed_events(store)) == sorted(during)
    store.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_purges_of_a_busy_sealed_store_raise_no_corruption_alarm(tmp_path, buffer, engine) -> None:
    # The race as it happens: `purge --all` (the CLI's function, on another
    # thread) again and again while this thread stores and loads. Loads fail
    # by generation (loads_raced), find their key gone (load_keys_missing) or
    # find their epoch destroyed (loads_key_destroyed); none is corruption,
    # and every key a load reports served holds its own bytes.
    store = sealed(tmp_path, buffer, engine)
    stop = threading.Event()
    purges: list[purge.PurgeResult] = []

    def purger() -> None:
        while not stop.is_set():
            purges.extend(purge.purge(str(tmp_path / "kv"), older_than_s=None))
            time.sleep(0.02)

    thread = threading.Thread(target=purger, name="purger")
    thread.start()
    n, job, wrong, failed = 0, 1, 0, 0
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 10 and (time.monotonic() - t0 < 1 or len(purges) < 10):
            keys = [key(n + i) for i in range(16)]
            n += 16
            fill_rows(buffer, keys, range(16))
            store.submit_store(job, keys, list(range(16)))
            run(store)
            submit_load(store, buffer, keys, range(16, 32), job + 1)
            (o,) = run(store)
            job += 2
            ok = keys if o.success else list(o.successful_keys or [])
            failed += len(keys) - len(ok)
            wrong += len(ok) - len(served(buffer, ok, [16 + keys.index(k) for k in ok]))
    finally:
        stop.set()
        thread.join()
        stats = store.stats()
        store.close()
    assert all(r.error is None for r in purges) and len(purges) >= 10
    assert wrong == 0 and failed > 0
    assert stats["checksum_failures"] == 0 and stats["auth_failures"] == 0


def _trailer_at(store, tmp_path, k: bytes) -> tuple[str, int]:
    slot = store.slot_of(k)
    assert slot is not None
    _f, off = store.sb.slot_location(slot)
    return str(tmp_path / "kv" / "store" / "data"), int(off) + ROW


def _rewrite(path: str, at: int, data: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        assert os.pwrite(fd, data, at) == len(data)
    finally:
        os.close(fd)


def _load_one(store, buffer, k: bytes, job_id: int):
    submit_load(store, buffer, [k], [0], job_id)
    (o,) = run(store)
    return o


@pytest.mark.parametrize("engine", ENGINES)
def test_a_garbage_tag_under_a_live_epoch_still_counts_as_an_auth_failure(
    tmp_path, buffer, engine
) -> None:
    store = sealed(tmp_path, buffer, engine)
    keys = [key(i) for i in range(4)]
    store_keys(store, buffer, keys)
    path, at = _trailer_at(store, tmp_path, keys[1])
    _rewrite(path, at + 20, os.urandom(16))  # the tag (format.md: trailer offset 20)
    o = _load_one(store, buffer, keys[1], job_id=2)
    # (GCM decrypts before it checks the tag: the row may hold the chunk,
    # but the load is reported failed, never served.)
    assert not o.success and o.successful_keys == []
    stats = store.stats()
    assert stats["auth_failures"] == 1 and stats["checksum_failures"] == 1
    assert stats["loads_key_destroyed"] == 0
    store.close()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("epoch", [0, 1 << 20], ids=["below", "above"])
def test_a_trailer_naming_an_epoch_that_never_existed_counts_as_an_auth_failure(
    tmp_path, buffer, engine, epoch
) -> None:
    # 0 is below every epoch (they start at 1); 1 << 20 is above the newest
    # with none announced since the key table was read.
    store = sealed(tmp_path, buffer, engine)
    keys = [key(i) for i in range(4)]
    store_keys(store, buffer, keys)
    path, at = _trailer_at(store, tmp_path, keys[2])
    _rewrite(path, at + 36, struct.pack("<I", epoch))  # the epoch (trailer offset 36)
    o = _load_one(store, buffer, keys[2], job_id=2)
    assert not o.success and o.successful_keys == []
    stats = store.stats()
    assert stats["auth_failures"] == 1 and stats["checksum_failures"] == 1
    assert stats["loads_key_destroyed"] == 0
    assert not store.contains(keys[2])
    store.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_trailer_relabelled_with_a_destroyed_epoch_is_a_miss_counted_apart(
    tmp_path, buffer, engine
) -> None:
    # The attacker's gain (docs/operations.md): the epoch cannot be checked
    # without its key, so the failed load moves from auth_failures to
    # loads_key_destroyed; it stays a miss, freed, no byte served.
    store = sealed(tmp_path, buffer, engine)
    keys = [key(i) for i in range(4)]
    store_keys(store, buffer, keys)
    old = store._sealing.epoch
    (r,) = purge.purge(str(tmp_path / "kv"), older_than_s=None)
    assert r.epochs_destroyed >= 1
    reload_keys(store)
    assert store._sealing.epoch != old
    store_keys(store, buffer, keys, job_id=3)  # sealed under the new epoch
    path, at = _trailer_at(store, tmp_path, keys[0])
    _rewrite(path, at + 36, struct.pack("<I", old))
    o = _load_one(store, buffer, keys[0], job_id=4)
    assert not o.success and o.successful_keys == []
    stats = store.stats()
    assert stats["loads_key_destroyed"] == 1 and stats["auth_failures"] == 0
    assert not store.contains(keys[0])
    store.close()


def test_the_key_table_calls_destroyed_only_the_epochs_it_knows_were() -> None:
    import nvmetier._crypto as native

    row = os.urandom(4096)
    ents = [(e, os.urandom(32), os.urandom(8)) for e in (1, 2, 3)]
    keys = native.Keys(bytes(16), 7)
    slots = {}
    for e in (1, 2, 3):
        keys.set(ents, e, time.time_ns() + 10**12, 1 << 28, 3)
        slot = bytearray(4096 + TRAILER_BYTES)
        keys.seal(5, 0, 0, row, slot)
        slots[e] = slot

    def open_(table, e: int) -> int:
        s = slots[e]
        try:
            table.open(5, 0, 0, bytes(s[4096:]), bytes(s[:4096]), bytearray(4096))
        except OSError as exc:
            return exc.errno or 0
        return 0

    # Epoch 1 held, then left out by a reload: destroyed. Epoch 2 left out of
    # a table that never held it and not named destroyed: never existed.
    keys.set([ents[2]], 3, time.time_ns() + 10**12, 1 << 28, 3)
    assert open_(keys, 3) == 0
    assert open_(keys, 1) == errno.EKEYREVOKED
    fresh = native.Keys(bytes(16), 7)
    fresh.set([ents[2]], -1, 0, 0, 3)
    assert open_(fresh, 1) == errno.EBADMSG  # a number below the newest is not enough
    fresh.set([ents[2]], -1, 0, 0, 3, 0, [1, 2])  # the keys file names them destroyed
    assert open_(fresh, 1) == open_(fresh, 2) == errno.EKEYREVOKED
    fresh.set([ents[2]], -1, 0, 0, 3, 0, [])  # known destroyed stays so
    assert open_(fresh, 2) == errno.EKEYREVOKED
    bad = bytearray(slots[3])
    bad[4096 + 20 : 4096 + 36] = os.urandom(16)  # a garbage tag under a live epoch
    slots[4] = bad
    assert open_(fresh, 4) == errno.EBADMSG
    with pytest.raises(TypeError):
        fresh.set([], -1, 0, 0, 3, 0, ["1"])
    with pytest.raises(ValueError):
        fresh.set([], -1, 0, 0, 3, 0, [1 << 33])


def test_the_native_counters_report_every_sealing_counter(tmp_path, buffer) -> None:
    # counters() once built its dict from a format one pair short, which
    # silently dropped its last counter (stores_skipped_no_epoch).
    store = sealed(tmp_path, buffer, "threads")
    names = set(store._table.counters())
    assert {"auth_failures", "stores_skipped_no_epoch", "loads_key_destroyed"} <= names
    store.close()
