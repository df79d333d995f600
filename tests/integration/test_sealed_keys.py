"""Encrypted stores as an attacker sees them (issue 28): no (key, nonce) is
ever used twice whatever a store's directory goes through (copied, restored,
rolled back, created afresh under one key file), and a purged or expired
chunk cannot be recovered from the store's files even with the key file.

The attacker (``recover``) works from docs/format.md alone, with the
``cryptography`` package: it unwraps whatever the ``keys`` file still holds
with the key file, then decrypts every slot in counter mode under every key
it found (no tag, no authenticated data needed), and looks for the chunks.
"""

from __future__ import annotations

import os
import shutil
import struct
import time

import pytest

pytest.importorskip("nvmetier._crypto")

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from nvmetier import crypto, purge
from nvmetier import format as fmt
from nvmetier.engine.sealed import parse_trailer
from tests.integration.helpers import (
    ROW,
    key,
    load_keys,
    make_store,
    payload,
    store_keys,
)

pytestmark = pytest.mark.timeout(120)


def new_key(tmp_path, name: str = "key") -> str:
    path = tmp_path / name
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return str(path)


def sealed(root, buffer, key_path: str, **kw):
    return make_store(str(root), buffer, encryption={"key_file": key_path}, **kw)


def slots_of(store_dir) -> list[bytes]:
    with open(os.path.join(store_dir, "superblock"), "rb") as f:
        sb = fmt.unpack_superblock(f.read())
    with open(os.path.join(store_dir, "data"), "rb") as f:
        data = f.read()
    return [data[i : i + sb.slot_bytes] for i in range(0, len(data), sb.slot_bytes)]


def trailers(store_dir) -> list[tuple[bytes, bytes, int, bytes]]:
    """(nonce, tag, epoch, epoch key fingerprint) of every sealed slot."""
    out = []
    for s in slots_of(store_dir):
        t = parse_trailer(s[ROW : ROW + 64])
        if t is not None:
            out.append(t)
    return out


def recover(store_dir, key_file: str, chunks: list[bytes]) -> list[bytes]:
    """Every chunk of ``chunks`` an attacker gets back from the store's
    files and the key file (docs/format.md, "Encrypted stores")."""
    op = crypto.KeySet(crypto.load_key_file(key_file))
    with open(os.path.join(store_dir, "keys"), "rb") as f:
        ring = f.read()
    epoch_keys = set()
    for copy in (0, 4096):
        h = ring[copy : copy + 4096]
        store_id = h[16:32]
        try:
            store_key = AESGCM(op.kek).decrypt(
                h[48:60], h[60:108], b"nvmetier v2 store key" + store_id
            )
        except InvalidTag:
            continue
        wrap = AESGCM(crypto._hkdf(store_key, b"nvmetier v2 epoch key wrapping", 32))
        for at in range(8192, len(ring), 128):
            e = ring[at : at + 128]  # whatever bytes are there, any state
            aad = b"nvmetier v2 epoch key" + store_id + e[8:12]
            try:
                epoch_keys.add(wrap.decrypt(e[28:40], e[40:88], aad))
            except InvalidTag:
                pass
    wanted = set(chunks)
    found = set()
    for s in slots_of(store_dir):
        if s[:ROW] in wanted:
            found.add(s[:ROW])  # in the clear
        nonce = s[ROW + 8 : ROW + 20]
        for k in epoch_keys:  # GCM's counter mode: blocks from 2 (no tag needed)
            dec = Cipher(algorithms.AES(k), modes.CTR(nonce + struct.pack(">I", 2))).decryptor()
            plain = dec.update(s[:ROW]) + dec.finalize()
            if plain in wanted:
                found.add(plain)
    return [c for c in chunks if c in found]


def chunks_of(keys) -> list[bytes]:
    return [payload(k) for k in keys]


@pytest.mark.parametrize("engine", ["threads", "uring"])
def test_a_copied_store_and_its_original_never_share_a_key_and_nonce(
    tmp_path, buffer, engine
) -> None:
    kf = new_key(tmp_path)
    a_root, b_root = tmp_path / "a", tmp_path / "b"
    old = [key(i) for i in range(8)]
    s = sealed(a_root, buffer, kf, engine=engine)
    store_keys(s, buffer, old)
    s.close()
    shutil.copytree(a_root, b_root)  # a backup, a snapshot, a node warmed from another
    new = [key(100 + i) for i in range(8)]
    for root in (a_root, b_root):
        s = sealed(root, buffer, kf, engine=engine)
        assert load_keys(s, buffer, old)[1] == old  # the copy serves what it holds
        store_keys(s, buffer, new, job_id=3)
        s.close()
    a, b = trailers(a_root / "store"), trailers(b_root / "store")
    # Each open sealed under its own random epoch key: the same chunks in the
    # same slots are different bytes, and no (key, nonce) pair repeats.
    pairs_a = {(t[3], t[0]) for t in a}
    pairs_b = {(t[3], t[0]) for t in b}
    shared = pairs_a & pairs_b
    assert len(shared) == len(old)  # exactly the chunks sealed before the copy
    new_fp_a = {t[3] for t in a} - {fp for fp, _n in shared}
    new_fp_b = {t[3] for t in b} - {fp for fp, _n in shared}
    assert new_fp_a and new_fp_b and not new_fp_a & new_fp_b
    slots_a, slots_b = slots_of(a_root / "store"), slots_of(b_root / "store")
    differ = sum(x != y for x, y in zip(slots_a, slots_b, strict=True) if x.strip(b"\0"))
    assert differ >= len(new)


@pytest.mark.parametrize("engine", ["threads", "uring"])
def test_a_rolled_back_store_never_reuses_a_key_and_nonce(tmp_path, buffer, engine) -> None:
    kf = new_key(tmp_path)
    root, snap = tmp_path / "kv", tmp_path / "snapshot"
    s = sealed(root, buffer, kf, engine=engine)
    store_keys(s, buffer, [key(i) for i in range(4)])
    s.close()
    shutil.copytree(root, snap)
    again = [key(50 + i) for i in range(8)]
    s = sealed(root, buffer, kf, engine=engine)
    store_keys(s, buffer, again, job_id=3)
    s.close()
    before = {(t[3], t[0]) for t in trailers(root / "store")}
    shutil.rmtree(root)
    shutil.copytree(snap, root)  # the VM rolled back: keys file and all
    s = sealed(root, buffer, kf, engine=engine)
    store_keys(s, buffer, again, job_id=3)  # the same chunks, stored again
    assert load_keys(s, buffer, again)[1] == again
    s.close()
    after = {(t[3], t[0]) for t in trailers(root / "store")}
    fresh = after - {
        (fp, n) for fp, n in after if fp in {f for f, _ in before} and (fp, n) in before
    }
    assert len(fresh) >= len(again)
    # the rolled-back open sealed under an epoch key the first timeline never had
    assert {fp for fp, _n in fresh}.isdisjoint({fp for fp, _n in before - after})


def test_fresh_stores_under_one_key_file_share_no_data_key(tmp_path, buffer) -> None:
    kf = new_key(tmp_path)
    ids, fps = set(), set()
    for i in range(6):
        root = tmp_path / f"kv{i}"
        s = sealed(root, buffer, kf)
        store_keys(s, buffer, [key(1)])  # the same chunk in the same slot each time
        s.close()
        ring = crypto.Keyring.open(str(root / "store"))
        ids.add(ring.store_id)
        ring.close()
        fps |= {t[3] for t in trailers(root / "store")}
    assert len(ids) == 6 and len(fps) == 6


@pytest.mark.parametrize("online", [False, True], ids=["offline", "online"])
def test_purge_all_leaves_nothing_the_key_file_recovers(tmp_path, buffer, online) -> None:
    kf = new_key(tmp_path)
    root = tmp_path / "kv"
    keys = [key(i) for i in range(16)]
    s = sealed(root, buffer, kf)
    store_keys(s, buffer, keys)
    assert recover(root / "store", kf, chunks_of(keys)) == chunks_of(keys)  # the attacker works
    if not online:
        s.close()
    (r,) = purge.purge(str(root), older_than_s=None)
    assert r.error is None and r.removed == 16 and r.epochs_destroyed >= 1
    assert recover(root / "store", kf, chunks_of(keys)) == []
    if online:
        # The store goes on under a fresh epoch once it sees the purge.
        more = [key(500 + i) for i in range(4)]
        _wait_for_new_epoch(s)
        store_keys(s, buffer, more, job_id=5)
        assert load_keys(s, buffer, more, job_id=6)[1] == more
        s.close()
    assert recover(root / "store", kf, chunks_of(keys)) == []


def _wait_for_new_epoch(s) -> None:
    ring = crypto.Keyring.open(s.files.dirs[0])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if any(e.state == crypto.ENTRY_LIVE for e in ring.epochs()):
                return
            time.sleep(0.05)
    finally:
        ring.close()
    raise AssertionError("no new epoch after the purge")


@pytest.mark.parametrize("online", [False, True], ids=["offline", "online"])
def test_purge_older_than_erases_the_old_chunks_of_a_live_epoch(tmp_path, buffer, online) -> None:
    kf = new_key(tmp_path)
    root = tmp_path / "kv"
    old, new = [key(i) for i in range(8)], [key(100 + i) for i in range(8)]
    s = sealed(root, buffer, kf)
    store_keys(s, buffer, old)
    time.sleep(1.2)
    store_keys(s, buffer, new, job_id=3, first_row=8)
    if not online:
        s.close()
    # Old and new share this open's epoch: the old ones are overwritten.
    (r,) = purge.purge(str(root), older_than_s=1.0)
    assert r.error is None and r.removed == 8 and r.slots_wiped == 8
    assert recover(root / "store", kf, chunks_of(old)) == []
    if online:
        assert load_keys(s, buffer, new, job_id=4)[1] == new
        s.close()
    s = sealed(root, buffer, kf)
    assert load_keys(s, buffer, new, job_id=4)[1] == new
    assert load_keys(s, buffer, old, job_id=5)[1] == []
    s.close()


def test_expired_chunks_are_erased_within_the_documented_bound(tmp_path, buffer) -> None:
    # retention 1 s: epochs of 1 s; an epoch's key is destroyed once its
    # window ended more than the retention ago (format.md: the bound).
    kf = new_key(tmp_path)
    root = tmp_path / "kv"
    keys = [key(i) for i in range(8)]
    s = sealed(root, buffer, kf, retention=1)
    store_keys(s, buffer, keys)
    t0 = time.monotonic()
    bound_s = 1 + 2 * 1 + 1  # retention + two epochs + a housekeeping tick's slack
    while recover(root / "store", kf, chunks_of(keys)) and time.monotonic() - t0 < bound_s + 3:
        time.sleep(0.25)
    assert recover(root / "store", kf, chunks_of(keys)) == []
    assert time.monotonic() - t0 <= bound_s + 3
    more = [key(300 + i) for i in range(4)]
    store_keys(s, buffer, more, job_id=3)  # the store goes on
    assert load_keys(s, buffer, more, job_id=4)[1] == more
    s.close()
