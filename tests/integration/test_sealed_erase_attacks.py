"""Erasure attacks on sealed stores the earlier reviews left out: chunks
that left the table before a purge (invalidated by vLLM, evicted, expired)
but whose sealed image is still on disk. The attacker holds the store's
files after the purge and the key file (``recover`` of test_sealed_keys.py).
"""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("nvmetier._crypto")

from nvmetier import purge
from tests.integration.helpers import ROW, key, load_keys, store_keys
from tests.integration.test_sealed_keys import chunks_of, new_key, recover, sealed

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("online", [True, False], ids=["online", "offline"])
def test_purge_older_than_erases_chunks_invalidated_before_it(tmp_path, buffer, online) -> None:
    """A chunk vLLM invalidated (its record gone, its slot free but not
    written again) is older than the cutoff like the others: the purge must
    erase it too, though its epoch lives on for newer chunks."""
    kf = new_key(tmp_path)
    root = tmp_path / "kv"
    old, new = [key(i) for i in range(8)], [key(100 + i) for i in range(8)]
    s = sealed(root, buffer, kf)
    store_keys(s, buffer, old)
    gone = old[:3]
    for k in gone:
        assert s.invalidate(k)
    time.sleep(1.2)
    store_keys(s, buffer, new, job_id=3, first_row=8)
    if not online:
        s.close()
    (r,) = purge.purge(str(root), older_than_s=1.0)
    assert r.error is None and r.epochs_destroyed == 0
    assert recover(root / "store", kf, chunks_of(old)) == []
    if online:
        s.close()
    s = sealed(root, buffer, kf)
    assert load_keys(s, buffer, new, job_id=4)[1] == new
    s.close()


@pytest.mark.parametrize("engine", ["threads", "uring"])
def test_the_last_epoch_number_seals_and_opens_then_no_number_is_reused(
    tmp_path, buffer, engine
) -> None:
    """A forged destroyed entry at 2**32 - 2 (test_sealed_key_destroyed_attacks
    covers 2**32 - 1): the next rotation makes epoch 2**32 - 1, which seals
    and opens like any other (no wrap to 0 in the native table's unsigned
    comparisons); the one after fails with the clear error instead of
    wrapping to an epoch number that already named another key."""
    from nvmetier import crypto
    from tests.integration.test_sealed_key_destroyed import reload_keys
    from tests.integration.test_sealed_key_destroyed import sealed as sealed_events
    from tests.integration.test_sealed_key_destroyed_attacks import _forge_destroyed

    store = sealed_events(tmp_path, buffer, engine)
    before, after = [key(i) for i in range(3)], [key(50 + i) for i in range(3)]
    store_keys(store, buffer, before)
    _forge_destroyed(store, [crypto.EPOCH_LAST - 1])
    reload_keys(store)
    store._sealing._rotate_locked()
    assert store._sealing.epoch == crypto.EPOCH_LAST
    store_keys(store, buffer, after, job_id=2)
    assert load_keys(store, buffer, before + after, job_id=3)[1] == before + after
    with pytest.raises(crypto.KeyringError, match="epoch 4294967295"):
        store._sealing._rotate_locked()
    assert store._sealing.epoch == crypto.EPOCH_LAST
    assert load_keys(store, buffer, after, job_id=4)[1] == after
    stats = store.stats()
    assert stats.get("auth_failures", 0) == 0 and stats.get("loads_key_destroyed", 0) == 0
    store.close()


def test_a_pre_purge_copy_of_data_and_index_put_back_is_served_while_its_epoch_lives(
    tmp_path, buffer
) -> None:
    """The limit of a purge against someone who can write the store's files
    (docs/operations.md, "What a purge and the retention erase"): the slot
    images and index records of chunks that ``purge --older-than`` removed,
    put back from a copy taken before it, are served again while their
    epoch key lives (nothing the purge can write without the key file can
    tell a put-back record from the original: the tag binds key, store,
    epoch and slot, not when). Once the epoch is destroyed (``--all``, the
    retention, or a later ``--older-than`` past its window) they are misses
    counted in ``loads_key_destroyed``. The attacker gains no plaintext: only
    a holder of the key file opens them, and they are the bytes stored."""
    import shutil

    kf = new_key(tmp_path)
    root = tmp_path / "kv"
    store_dir = root / "store"
    old, new = [key(i) for i in range(4)], [key(100 + i) for i in range(4)]
    s = sealed(root, buffer, kf)
    store_keys(s, buffer, old)
    time.sleep(1.2)
    store_keys(s, buffer, new, job_id=2)
    s.close()
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("data", "index"):
        shutil.copy2(store_dir / name, copy / name)
    (r,) = purge.purge(str(root), older_than_s=1.0)
    assert r.removed == 4 and r.slots_wiped == 4 and r.epochs_destroyed == 0

    def put_back() -> None:
        for name in ("data", "index"):
            shutil.copy2(copy / name, store_dir / name)

    # A copy of `data` alone (or stale flash blocks of it) and today's
    # `keys` decrypt them with the key file too, while the epoch lives.
    assert recover(store_dir, kf, chunks_of(old)) == []
    shutil.copy2(copy / "data", store_dir / "data")
    assert recover(store_dir, kf, chunks_of(old)) == chunks_of(old)
    put_back()
    s = sealed(root, buffer, kf)
    assert load_keys(s, buffer, old, job_id=3)[1] == old  # served again
    s.close()
    (r,) = purge.purge(str(root), older_than_s=None)
    assert r.epochs_destroyed >= 1
    put_back()
    assert recover(store_dir, kf, chunks_of(old + new)) == []
    s = sealed(root, buffer, kf)
    assert load_keys(s, buffer, old + new, job_id=4)[1] == []
    stats = s.stats()
    assert stats["loads_key_destroyed"] == 8 and stats.get("auth_failures", 0) == 0
    s.close()


def _crash_between_header_writes(store_dir, pre_rekey_keys: bytes) -> None:
    """The ``keys`` file as a crash (power loss, kill -9) between the two
    header writes of a rekey leaves it: Keyring.rekey writes the copy not
    in use first (copy 1 of a fresh file), fsyncs, then copy 0; copy 0 is
    still the one wrapped by the old key file (older sequence)."""
    path = os.path.join(str(store_dir), "keys")
    with open(path, "r+b") as f:
        f.seek(0)
        f.write(pre_rekey_keys[:4096])


@pytest.mark.parametrize("then", ["rekey_again", "open_with_new"])
def test_a_rekey_cut_between_its_header_writes_leaves_no_copy_the_old_key_opens(
    tmp_path, buffer, then
) -> None:
    """The newer header copy (the new key's) wins at open, so the store
    looks rotated; but the other copy still wraps the store key under the
    old key file: current files + old key file -> every chunk, past and
    future. The interrupted rotation must be finished, by the rekey run
    again (it said "does not open this store" and exit 4 before) or by the
    next open with the new key file."""
    from nvmetier import rekey

    kf, nf = new_key(tmp_path, "old"), new_key(tmp_path, "new")
    root = tmp_path / "kv"
    store_dir = root / "store"
    keys = [key(i) for i in range(4)]
    s = sealed(root, buffer, kf)
    store_keys(s, buffer, keys)
    s.close()
    pre = (store_dir / "keys").read_bytes()
    (res,) = rekey.rekey(str(root), kf, nf)
    assert res.rekeyed
    _crash_between_header_writes(store_dir, pre)
    assert recover(store_dir, kf, chunks_of(keys)) == chunks_of(keys)  # the hole
    if then == "rekey_again":
        (res,) = rekey.rekey(str(root), kf, nf)
        assert res.rekeyed and res.error is None, res.error
    else:
        s = sealed(root, buffer, nf)
        assert load_keys(s, buffer, keys, job_id=2)[1] == keys
        s.close()
    assert recover(store_dir, kf, chunks_of(keys)) == []
    assert recover(store_dir, nf, chunks_of(keys)) == chunks_of(keys)


@pytest.mark.parametrize("engine", ["threads", "uring"])
def test_a_rolled_back_keys_file_never_makes_a_live_process_seal_under_anothers_key(
    tmp_path, buffer, engine
) -> None:
    """``keys`` put back from an older copy under a live process (epoch N,
    its own key), then another opener makes epoch N again (a new random
    key, its number free in the old copy). The live process reloads at the
    announcement: it must not take the file's epoch N (the other's key) as
    its own and seal under it too (two processes on one key, each counting
    only its own seals against the per-key bound); it moves to a fresh
    epoch, and what it stores then loads back."""
    import shutil

    from nvmetier import crypto
    from nvmetier.engine.sealed import parse_trailer
    from nvmetier.keyring import Keyring
    from tests.integration.test_sealed_key_destroyed import reload_keys

    kf = new_key(tmp_path)
    root = tmp_path / "kv"
    store_dir = root / "store"
    s = sealed(root, buffer, kf, engine=engine)
    s.close()
    backup = tmp_path / "keys.old"
    shutil.copy(store_dir / "keys", backup)
    a = sealed(root, buffer, kf, engine=engine)
    mine = a._sealing.epoch
    with open(store_dir / "keys", "r+b") as f:  # in place: the open fd sees it
        f.write(backup.read_bytes())
    ring = Keyring.open(str(store_dir))
    try:
        other, _ = ring.new_epoch(ring.store_keys(crypto.KeySet.from_file(kf)), 3600.0)
    finally:
        ring.close()
    assert other.epoch == mine
    a._sealing._bump()  # announced, as any maker of an epoch does
    reload_keys(a)
    ks = [key(200 + i) for i in range(3)]
    store_keys(a, buffer, ks, job_id=2)
    assert load_keys(a, buffer, ks, job_id=3)[1] == ks
    a.close()
    used = set()
    with open(store_dir / "data", "rb") as f:
        data = f.read()
    for at in range(ROW, len(data), 4096):
        t = parse_trailer(data[at : at + 64])
        if t is not None:
            used.add(t[3])
    assert other.fingerprint not in used


def test_purge_all_leaves_no_wrapped_key_in_a_torn_entry(tmp_path, buffer) -> None:
    """An entry whose checksum fails (a write torn by a crash, a flipped
    bit) is skipped by every reader, so its chunks are already misses; but
    its wrapped key may be intact, and the key file unwraps it (``recover``
    tries every entry's bytes). ``purge --all`` must not leave it behind."""
    kf = new_key(tmp_path)
    root = tmp_path / "kv"
    store_dir = root / "store"
    keys = [key(i) for i in range(4)]
    s = sealed(root, buffer, kf)
    store_keys(s, buffer, keys)
    s.close()
    with open(store_dir / "keys", "r+b") as f:  # entry 0's checksum, one bit
        f.seek(8192 + 120)
        b = f.read(1)
        f.seek(8192 + 120)
        f.write(bytes([b[0] ^ 1]))
    assert recover(store_dir, kf, chunks_of(keys)) == chunks_of(keys)
    (r,) = purge.purge(str(root), older_than_s=None)
    assert r.error is None
    assert recover(store_dir, kf, chunks_of(keys)) == []
