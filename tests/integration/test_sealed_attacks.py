"""An adversarial review of sealed stores (issue 28), as tests: the attacker
holds the store's files, the code and, for erasure and rotation, the old key
file. Each test passes when its attack fails; a test that fails is a break
(its docstring says what breaks and why).

The attacker's code uses the ``cryptography`` package and docs/format.md
(``recover`` of test_sealed_keys.py: every key the ``keys`` file still
unwraps, then counter-mode decryption of every slot with its trailer's nonce).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("nvmetier._crypto")

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from nvmetier import crypto, purge, rekey
from nvmetier.engine.sealed import parse_trailer
from nvmetier.errors import NvmeTierError
from tests.integration.helpers import ROW, key, load_keys, make_store, payload, store_keys
from tests.integration.test_sealed_keys import (
    chunks_of,
    new_key,
    recover,
    sealed,
    slots_of,
    trailers,
)

pytestmark = pytest.mark.timeout(120)

ENGINES = ["threads", "uring"]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRL = ROW  # a slot's trailer starts right after the ciphertext (ROW bytes)


def _data_path(root) -> str:
    return os.path.join(str(root), "store", "data")


def _slot_bytes(root) -> int:
    return len(slots_of(os.path.join(str(root), "store"))[0])


def _used_slots(root) -> list[int]:
    return [
        i
        for i, s in enumerate(slots_of(os.path.join(str(root), "store")))
        if s[TRL : TRL + 4] == b"NVTS"
    ]


def _patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


# ------------------------------------------- (1) (key, nonce) never twice
@pytest.mark.parametrize("engine", ENGINES)
def test_two_processes_sharing_one_store_never_share_a_key_and_nonce(
    tmp_path, buffer, engine
) -> None:
    """sharing: node, two sharers at once (two BlockStores: two sharers of
    the table, each its own epoch): every (epoch key, nonce) pair is unique
    and the two sharers seal under different epoch keys."""
    kf = new_key(tmp_path)
    root = tmp_path / "kv"
    a = sealed(root, buffer, kf, engine=engine)
    b = sealed(root, buffer, kf, engine=engine)
    try:
        store_keys(a, buffer, [key(i) for i in range(8)])
        store_keys(b, buffer, [key(100 + i) for i in range(8)], job_id=3)
        theirs = [key(100 + i) for i in range(8)]
        good: list[bytes] = []
        for attempt in range(5):  # the first load may fail (-ENOKEY) until a reloads
            good = load_keys(a, buffer, theirs, job_id=10 + attempt)[1]
            if good == theirs:
                break
            time.sleep(0.3)
        assert good == theirs
    finally:
        b.close()
        a.close()
    ts = trailers(root / "store")
    assert len(ts) == 16
    assert len({(t[3], t[0]) for t in ts}) == 16
    assert len({t[0] for t in ts}) == 16  # no nonce twice, whatever the key
    assert len({(t[2], t[3]) for t in ts}) == 2  # two epochs, two keys


def _torn_entry(store_dir, epoch: int) -> None:
    """What a kill -9 or power loss in the middle of rewriting ``epoch``'s
    entry (its window cut at close, or its destruction) leaves: the entry
    fails its checksum, so it counts as free."""
    path = os.path.join(str(store_dir), "keys")
    with open(path, "rb") as f:
        ring = f.read()
    for at in range(8192, len(ring), 128):
        e = ring[at : at + 128]
        if e[:4] == b"NVKE" and struct.unpack_from("<I", e, 8)[0] == epoch:
            _patch(path, at + 20, b"\xff" * 8)  # half-written: window, no checksum
            return
    raise AssertionError(f"no entry for epoch {epoch}")


@pytest.mark.parametrize("engine", ENGINES)
def test_a_torn_newest_entry_reuses_its_epoch_number_under_a_new_key_and_serves_misses(
    tmp_path, buffer, engine
) -> None:
    """The newest epoch's entry torn: the next epoch is ``1 + highest`` of the
    entries left, so the same number comes back under another random key.
    Its old chunks (same epoch number, same authenticated data) must be
    misses, never opened as anything, and the new key never equals the old."""
    kf = new_key(tmp_path)
    root = tmp_path / "kv"
    old = [key(i) for i in range(6)]
    s = sealed(root, buffer, kf, engine=engine)
    store_keys(s, buffer, old)
    s.close()
    ((epoch, fp_old),) = {(t[2], t[3]) for t in trailers(root / "store")}
    _torn_entry(root / "store", epoch)
    s = sealed(root, buffer, kf, engine=engine)
    try:
        outcome, good = load_keys(s, buffer, old)
        assert good == [] and not outcome.successful_keys  # misses, never wrong bytes
        assert bytes(buffer[: len(old) * ROW]) != b"".join(chunks_of(old))
        new = [key(50 + i) for i in range(4)]
        store_keys(s, buffer, new, job_id=3)
        assert load_keys(s, buffer, new, job_id=4)[1] == new
    finally:
        s.close()
    now = {(t[2], t[3]) for t in trailers(root / "store")}
    # the number came back under another key: the old chunks above were misses
    assert any(e == epoch and fp != fp_old for e, fp in now)


_EPOCH_LOOP = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {repo!r})
    from nvmetier import crypto
    op = crypto.KeySet(crypto.load_key_file({kf!r}))
    ring = crypto.Keyring.open({d!r}, create=True, operator=op)
    sk = ring.store_keys(op)
    print("go", flush=True)
    while True:
        e, _ = ring.new_epoch(sk, 3600)
        ring.retire(e.epoch, destroy=False)
    """
)


def test_kill_9_while_epochs_are_made_never_gives_two_live_keys_one_epoch(tmp_path) -> None:
    """A process making and retiring epochs in a loop, killed -9 at random
    moments, ten times: the keys file always opens, no epoch number is live
    twice, and no two entries wrap the same data key."""
    kf = new_key(tmp_path)
    d = str(tmp_path / "store")
    os.mkdir(d)
    code = _EPOCH_LOOP.format(repo=REPO, kf=kf, d=d)
    for i in range(10):
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdout.readline().strip() == "go"
        time.sleep(0.02 + 0.013 * i)
        p.send_signal(signal.SIGKILL)
        p.wait()
    op = crypto.KeySet(crypto.load_key_file(kf))
    ring = crypto.Keyring.open(d)
    try:
        live, top = ring.load(ring.store_keys(op))
        ents = ring.epochs()
    finally:
        ring.close()
    assert len(ents) > 10 and top == max(e.epoch for e in ents)
    numbers = [e.epoch for e in ents]
    assert len(numbers) == len(set(numbers))
    assert len({e.key for e in live}) == len(live)


# --------------------------------------- (2) purged chunks stay unrecoverable
def test_purge_older_than_wipes_the_nonce_when_the_trailer_straddles_a_page(
    tmp_path, buffer
) -> None:
    """A chunk size whose trailer crosses a 4 KiB boundary (row = 64 KiB - 32):
    the nonce sits in the page before the slot's last one. The purge must
    still overwrite it (format.md: from the page holding the trailer)."""
    from nvmetier.config import TierConfig
    from nvmetier.store import BlockStore
    from tests.integration.helpers import IDENTITY

    row = ROW - 32
    kf = new_key(tmp_path)
    root = tmp_path / "kv"
    cfg = TierConfig.from_dict(
        {
            "root_dir": str(root),
            "capacity_bytes": "16MiB",
            "ways": 8,
            "encryption": {"key_file": kf},
        }
    )
    s = BlockStore(
        cfg,
        store_name="store",
        identity={**IDENTITY, "chunk_bytes": row},
        buffer=buffer,
        row_bytes=row,
    )
    keys = [key(i) for i in range(4)]
    for r, k in enumerate(keys):
        buffer[r * row : (r + 1) * row] = payload(k, row)
    s.submit_store(1, keys, list(range(4)))
    assert s.wait_idle(30)
    s.poll()
    s.close()
    with open(_data_path(root), "rb") as f:
        data = f.read()
    slot_bytes = ROW + 4096  # (row + 64) rounded up to 4 KiB
    used = [
        i for i in range(len(data) // slot_bytes) if data[i * slot_bytes + row :][:4] == b"NVTS"
    ]
    assert len(used) == 4
    nonces = [data[i * slot_bytes + row + 8 : i * slot_bytes + row + 20] for i in used]
    assert all((row + 8) // 4096 != (slot_bytes - 1) // 4096 for _ in used)  # it straddles
    time.sleep(1.1)
    (r,) = purge.purge(str(root), older_than_s=1.0)
    assert r.error is None and r.removed == 4
    with open(_data_path(root), "rb") as f:
        after = f.read()
    for n in nonces:
        assert n not in after


def test_purge_older_than_over_two_drives_leaves_old_chunks_recoverable_until_their_epoch_goes(
    tmp_path, buffer
) -> None:
    """Documented limit (operations.md): with several drives a purge
    --older-than does not overwrite removed slots; their epoch key lives on
    while its window has not ended before the cutoff. The attacker then
    recovers them with the key file. This test pins the limit so that the
    documentation's wording can be judged: nothing destroys that epoch
    unless a later purge or a retention does."""
    kf = new_key(tmp_path)
    r0, r1 = tmp_path / "d0", tmp_path / "d1"
    keys = [key(i) for i in range(8)]
    s = make_store([str(r0), str(r1)], buffer, encryption={"key_file": kf})
    store_keys(s, buffer, keys)
    time.sleep(1.1)
    (r,) = purge.purge(str(r0), older_than_s=1.0)  # online: the epoch seals on
    s.close()
    assert r.error is None and r.removed == len(keys) and r.slots_wiped == 0
    assert r.epochs_destroyed == 0
    # the attacker: each drive's data file read beside drive 0's keys file
    view = tmp_path / "view"
    shutil.copytree(str(r0 / "store"), str(view))
    shutil.copy(os.path.join(str(r1), "store", "data"), str(view / "data"))
    on_drive_1 = recover(view, kf, chunks_of(keys)) + recover(r0 / "store", kf, chunks_of(keys))
    assert sorted(on_drive_1) == sorted(chunks_of(keys)), (
        "expected the purged chunks to be recoverable (documented limit)"
    )
    with open(os.path.join(REPO, "docs", "operations.md")) as f:
        ops = " ".join(f.read().split())
    assert "With several `root_dir` drives the overwrite is not done" in ops
    assert "at most one window later" not in ops  # nothing destroys that key by itself


@pytest.mark.parametrize("engine", ENGINES)
def test_a_tampered_trailer_epoch_is_a_miss_not_a_failed_load_forever(
    tmp_path, buffer, engine
) -> None:
    """An attacker with write access sets a slot's trailer epoch far above
    every epoch the keys file names. The first load may fail (-ENOKEY: the
    table is reloaded), but once reloaded the epoch is above the keyring's
    highest, so it can never be opened: it must become a miss (the slot
    freed), never wrong bytes and never a load that fails for ever.

    BREAK (found in review, availability only: no wrong bytes): an epoch
    above the table's ``max_epoch`` is ``-ENOKEY`` for ever (nvt_keys_open),
    the load fails with ECANCELED and the slot stays READY
    (nvt_job_complete.c), so every lookup hits and every load of it fails.
    A fix: treat ``-ENOKEY`` as ``-EBADMSG`` when a reload that began after
    the slot was published still does not know the epoch (an epoch is in
    ``keys`` before its first seal)."""
    kf = new_key(tmp_path)
    root = tmp_path / "kv"
    keys = [key(i) for i in range(2)]
    s = sealed(root, buffer, kf, engine=engine)
    store_keys(s, buffer, keys)
    s.close()
    sb = _slot_bytes(root)
    for i in _used_slots(root):
        _patch(_data_path(root), i * sb + TRL + 36, struct.pack("<I", 0xFFFFFFF0))
    s = sealed(root, buffer, kf, engine=engine)
    try:
        results = []
        for attempt in range(4):
            outcome, good = load_keys(s, buffer, keys, job_id=10 + attempt)
            assert good == []
            results.append(outcome.success)
            time.sleep(0.2)
            if outcome.success:
                break
        lookups = [s.lookup(k) for k in keys]
    finally:
        s.close()
    # a failed load of a slot that can never open again is not a miss
    assert not any(lookups), f"slots kept READY after {results}: every later load fails"


@pytest.mark.parametrize("engine", ENGINES)
def test_slot_images_moved_or_replayed_never_load_as_another_key(tmp_path, buffer, engine) -> None:
    """Slot images swapped between two slots, or one replaced by an image
    sealed for another key earlier, or a slot of a copy of the store (same
    store id, same epoch numbers below the copy) moved in: misses, never
    another chunk's bytes."""
    kf = new_key(tmp_path)
    root, twin = tmp_path / "kv", tmp_path / "twin"
    keys = [key(i) for i in range(4)]
    s = sealed(root, buffer, kf, engine=engine)
    store_keys(s, buffer, keys)
    s.close()
    shutil.copytree(root, twin)
    # after the copy both store one more key, the same: same slot, same
    # store id, same epoch number (1 + the highest copied), another key
    extra = [key(10)]
    for r in (root, twin):
        t = sealed(r, buffer, kf, engine=engine)
        store_keys(t, buffer, extra, job_id=5)
        t.close()
    sb = _slot_bytes(root)
    with open(_data_path(root), "rb") as f:
        data = f.read()
    with open(_data_path(twin), "rb") as f:
        tdata = f.read()
    used = [i for i in _used_slots(root)]
    (c,) = [i for i in used if data[i * sb : (i + 1) * sb] != tdata[i * sb : (i + 1) * sb]]
    used.remove(c)
    assert (
        parse_trailer(data[c * sb + TRL :][:64])[2] == parse_trailer(tdata[c * sb + TRL :][:64])[2]
    )
    a, b = used[0], used[1]
    _patch(_data_path(root), a * sb, data[b * sb : (b + 1) * sb])  # a slot moved
    _patch(_data_path(root), c * sb, tdata[c * sb : (c + 1) * sb])  # from the copy
    keys = keys + extra
    s = sealed(root, buffer, kf, engine=engine)
    try:
        outcome, good = load_keys(s, buffer, keys)
        # a key reported loaded holds its own chunk (a failed key's row is
        # garbage vLLM never uses: GCM decrypted it before the tag failed)
        assert set(outcome.successful_keys) == set(good)
        stats = s.stats()
    finally:
        s.close()
    # the moved image is a miss; the twin's image of the same key (another
    # epoch key under an epoch number root never made) is a miss too
    assert len(good) == len(keys) - 2
    assert key(10) not in good
    assert stats.get("auth_failures", 0) == 2


# ------------------------------------------------------ (3) rekey and backups
@pytest.mark.parametrize("engine", ENGINES)
def test_after_rekey_the_old_key_file_opens_nothing_in_the_store(tmp_path, buffer, engine) -> None:
    kf, nf = new_key(tmp_path, "old"), new_key(tmp_path, "new")
    root = tmp_path / "kv"
    keys = [key(i) for i in range(6)]
    s = sealed(root, buffer, kf, engine=engine)
    store_keys(s, buffer, keys)
    (res,) = rekey.rekey(str(root), kf, nf)
    assert res.rekeyed and res.error is None
    more = [key(100 + i) for i in range(4)]
    store_keys(s, buffer, more, job_id=3)  # the live process goes on
    s.close()
    assert recover(root / "store", kf, chunks_of(keys + more)) == []
    assert recover(root / "store", nf, chunks_of(keys + more)) == chunks_of(keys + more)
    with pytest.raises(NvmeTierError, match="fingerprint"):
        sealed(root, buffer, kf, engine=engine)
    s = sealed(root, buffer, nf, engine=engine)
    try:
        assert load_keys(s, buffer, keys + more)[1] == keys + more
    finally:
        s.close()


def _recover_with_old_header(store_dir, old_keys_copy: str, key_file: str, chunks) -> list[bytes]:
    """recover() with the header pages of an old copy of ``keys`` spliced
    onto the current file (the attacker keeps the old copy)."""
    path = os.path.join(str(store_dir), "keys")
    with open(old_keys_copy, "rb") as f:
        old_head = f.read(8192)
    spliced = str(store_dir) + "-spliced"
    shutil.copytree(str(store_dir), spliced)
    _patch(os.path.join(spliced, "keys"), 0, old_head)
    assert os.path.getsize(path) == os.path.getsize(os.path.join(spliced, "keys"))
    return recover(spliced, key_file, chunks)


def test_a_pre_rekey_copy_of_keys_and_the_old_key_file_open_everything_written_later(
    tmp_path, buffer
) -> None:
    """Documented limit, and what it means: the store key never changes, so
    whoever keeps the old key file and any copy of ``keys`` from before the
    rotation unwraps the store key, and with it every epoch key of every
    later ``keys`` file: chunks written after the rekey *and* after a
    ``purge --all`` (which only makes new data keys under the same store
    key). Only a new store (remove the directory) cuts them off;
    operations.md must say so, not that rekey + purge --all does."""
    kf, nf = new_key(tmp_path, "old"), new_key(tmp_path, "new")
    root = tmp_path / "kv"
    s = sealed(root, buffer, kf)
    store_keys(s, buffer, [key(i) for i in range(2)])
    s.close()
    backup = str(tmp_path / "keys.backup")
    shutil.copy(os.path.join(str(root), "store", "keys"), backup)
    (res,) = rekey.rekey(str(root), kf, nf)
    assert res.rekeyed
    (p,) = purge.purge(str(root), older_than_s=None)
    assert p.error is None
    later = [key(300 + i) for i in range(4)]
    s = sealed(root, buffer, nf)
    store_keys(s, buffer, later, job_id=3)
    s.close()
    assert recover(root / "store", kf, chunks_of(later)) == []  # the old key file alone
    got = _recover_with_old_header(root / "store", backup, kf, chunks_of(later))
    assert got == chunks_of(later)  # the limit is real ...
    with open(os.path.join(REPO, "docs", "operations.md")) as f:
        ops = " ".join(f.read().split())
    # ... and the documentation must not promise that rekey + purge --all ends it
    assert "To cut a leaked key file off completely, rekey *and* `purge --all`" not in ops
    assert "remove the store directory" in ops[ops.index("What rekey does not do") :][:1200]


# ------------------------------------------------ (5) memory: dumps and forks
_VICTIM = textwrap.dedent(
    """
    import gc, mmap, os, sys
    sys.path.insert(0, {repo!r})
    from tests.integration.helpers import key, load_keys, make_store, store_keys
    mm = mmap.mmap(-1, 64 * 65536)
    buf = memoryview(mm)
    s = make_store({root!r}, buf, engine={engine!r}, encryption={{"key_file": {kf!r}}})
    store_keys(s, buf, [key(i) for i in range(4)])
    load_keys(s, buf, [key(i) for i in range(4)])
    gc.collect()
    print("ready", flush=True)
    sys.stdin.readline()
    s.close()
    """
)


def _regions(pid: int) -> list[tuple[int, int, str, list[str]]]:
    out: list[tuple[int, int, str, list[str]]] = []
    cur: list = []
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) (\S+)", line)
            if m:
                cur = [int(m[1], 16), int(m[2], 16), m[3]]
            elif line.startswith("VmFlags:"):
                out.append((cur[0], cur[1], cur[2], line.split()[1:]))
    return out


def _secrets(store_dir: str, kf: str) -> dict[str, bytes]:
    """What an attacker wants from a core dump: anything that, with the
    store's files, unwraps data keys (the operator key, its KEK, the store
    key's epoch-wrapping subkey) or is a data key."""
    op_key = crypto.load_key_file(kf)
    op = crypto.KeySet(op_key)
    with open(os.path.join(store_dir, "keys"), "rb") as f:
        head = f.read(4096)
    store_key = AESGCM(op.kek).decrypt(
        head[48:60], head[60:108], b"nvmetier v2 store key" + head[16:32]
    )
    out = {
        "operator key": op_key,
        "key-encryption key": op.kek,
        "store key": store_key,
        "epoch wrapping key": crypto._hkdf(store_key, b"nvmetier v2 epoch key wrapping", 32),
    }
    ring = crypto.Keyring.open(store_dir)
    try:
        for e in ring.load(ring.store_keys(op))[0]:
            assert e.key is not None
            out[f"epoch {e.epoch} key"] = e.key
    finally:
        ring.close()
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_a_core_dump_of_a_running_sealed_store_holds_no_key_that_unwraps_its_data(
    tmp_path, engine
) -> None:
    """BREAK (found in review): the key tables and arenas are MADV_DONTDUMP,
    but the Python objects around them are not: ``KeySet.kek`` (and the
    v1 ``seal_key``/``mac_key``) live on the Python heap for the store's
    lifetime (``BlockStore._operator``), and so does the epoch-wrapping key
    inside ``StoreKeys._wrap`` (a ``cryptography`` AESGCM object). A core
    dump of vLLM plus the store's ``keys`` file (or, for the KEK, the key
    file's role) unwraps every epoch key: every chunk of the store."""
    kf = new_key(tmp_path)
    root = str(tmp_path / "kv")
    code = _VICTIM.format(repo=REPO, root=root, engine=engine, kf=kf)
    p = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        secrets = _secrets(os.path.join(root, "store"), kf)
        found: dict[str, int] = {}
        with open(f"/proc/{p.pid}/mem", "rb", buffering=0) as mem:
            for lo, hi, perm, flags in _regions(p.pid):
                if "r" not in perm or "dd" in flags:
                    continue  # what a core dump leaves out
                try:
                    mem.seek(lo)
                    data = mem.read(hi - lo)
                except OSError:
                    continue
                for name, sec in secrets.items():
                    found[name] = found.get(name, 0) + data.count(sec)
    finally:
        assert p.stdin is not None
        p.stdin.write("\n")
        p.stdin.flush()
        p.wait(60)
    assert not {n: c for n, c in found.items() if c}, "in dumpable memory"


@pytest.mark.parametrize("engine", ENGINES)
def test_key_tables_are_dontdump_and_wipeonfork_and_arenas_dontdump(
    tmp_path, buffer, engine
) -> None:
    kf = new_key(tmp_path)
    s = sealed(tmp_path / "kv", buffer, kf, engine=engine)
    try:
        store_keys(s, buffer, [key(i) for i in range(4)])
        regions = _regions(os.getpid())
        wf = [r for r in regions if "wf" in r[3]]
        assert wf and all("dd" in r[3] for r in wf)  # the key tables
        arenas = s.engine.describe().get("worker_staging", [])  # io_uring's
        for addr, n in arenas:
            covering = [r for r in regions if r[0] < int(addr) + int(n) and r[1] > int(addr)]
            assert covering and all("dd" in r[3] for r in covering), (addr, n)
    finally:
        s.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_forked_child_holds_no_keys_fd_and_an_empty_key_table(tmp_path, buffer, engine) -> None:
    kf = new_key(tmp_path)
    s = sealed(tmp_path / "kv", buffer, kf, engine=engine)
    try:
        store_keys(s, buffer, [key(i) for i in range(4)])
        keys_path = os.path.realpath(os.path.join(str(tmp_path / "kv"), "store", "keys"))
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                os.close(r)
                fds = [
                    os.path.realpath(os.readlink(f"/proc/self/fd/{fd}"))
                    for fd in os.listdir("/proc/self/fd")
                    if os.path.exists(f"/proc/self/fd/{fd}")
                ]
                nonzero = 0
                with open("/proc/self/mem", "rb", buffering=0) as mem:
                    for lo, hi, _perm, flags in _regions(os.getpid()):
                        if "wf" in flags:
                            mem.seek(lo)
                            nonzero += sum(1 for b in mem.read(hi - lo) if b)
                os.write(w, f"{int(keys_path in fds)} {nonzero}".encode())
            finally:
                os._exit(0)
        os.close(w)
        os.waitpid(pid, 0)
        with os.fdopen(r) as f:
            has_fd, nonzero = map(int, f.read().split())
    finally:
        s.close()
    assert has_fd == 0 and nonzero == 0


# -------------------------------------------- (6) a damaged keys file
@pytest.mark.parametrize(
    "damage",
    ["empty", "half_header", "headers_only", "one_entry_short", "both_headers_bad"],
)
def test_a_damaged_keys_file_is_a_clear_error_never_silent(tmp_path, buffer, damage) -> None:
    """A truncated or corrupt ``keys`` file: opening the store is an error
    that names the file, what is wrong and the fix; never a crash, never a
    store that goes on with its keys silently gone (a truncation that drops
    entries would otherwise turn every chunk into a miss and reuse epoch
    numbers), and never plaintext on the drive."""
    kf = new_key(tmp_path)
    root = tmp_path / "kv"
    keys = [key(i) for i in range(4)]
    s = sealed(root, buffer, kf)
    store_keys(s, buffer, keys)
    s.close()
    path = os.path.join(str(root), "store", "keys")
    size = {
        "empty": 0,
        "half_header": 2048,
        "headers_only": 8192,
        "one_entry_short": os.path.getsize(path) - 128,
    }.get(damage)
    if size is not None:
        os.truncate(path, size)
    else:
        _patch(path, 100, b"\xa5" * 8)
        _patch(path, 4096 + 100, b"\xa5" * 8)
    with pytest.raises(NvmeTierError, match=r"keys") as exc:
        s = sealed(root, buffer, kf)
        s.close()
    msg = str(exc.value)
    assert "remove the store directory" in msg or "restore" in msg
    with open(_data_path(root), "rb") as f:
        data = f.read()
    assert not any(c in data for c in chunks_of(keys))


# ------------------------------------------------- a failed open's destination
# nvt_keys_open zeroes its destination after a decryption whose tag failed
# (no unauthenticated plaintext left in a row or span) and touches nothing on
# an early refusal. These drive the key table directly (no store): each case
# takes milliseconds.
_SID = b"S" * 16
_DIGEST = 0x5EA1
_LEN = 4096 + 123  # not a block multiple: the zeroing covers the tail block too


def _table(epochs, max_epoch=None, seal=-1, **kw):
    from nvmetier import _crypto

    t = _crypto.Keys(_SID, _DIGEST)
    far = time.time_ns() + 3600 * 10**9
    top = max(e for e, _k in epochs) if max_epoch is None else max_epoch
    t.set([(e, k, bytes([e]) * 8) for e, k in epochs], seal, far, 1 << 30, top, **kw)
    return t


def _sealed_image(seed=11, file_idx=1, off=8192):
    k1, k2 = os.urandom(32), os.urandom(32)
    sealer = _table([(1, k1), (2, k2)], seal=2)
    plain = os.urandom(_LEN)
    slot = bytearray(_LEN + 64)
    sealer.seal(seed, file_idx, off, plain, slot)
    return (k1, k2), plain, slot, (seed, file_idx, off)


@pytest.mark.parametrize("where", ["ciphertext", "tag", "aad"])
def test_a_failed_tag_zeroes_only_len_bytes_of_dst_and_leaves_src(where) -> None:
    """Staged (src != dst, dst longer): the tag fails, dst's first len bytes
    are zeros, its tail and the source span untouched; in place, the row is
    zeros. Breaks if the zeroing runs past len (a neighbour's bytes) or
    into the source, or leaves plaintext bits in the row."""
    (k1, k2), plain, slot, (seed, fi, off) = _sealed_image()
    if where == "ciphertext":
        slot[100] ^= 1
    elif where == "tag":
        slot[_LEN + 20] ^= 0x80
    opener = _table([(1, k1), (2, k2)])
    src = bytes(slot[:_LEN])
    dst = bytearray(b"\xaa" * (_LEN + 300))
    with pytest.raises(OSError) as exc:
        opener.open(seed + (where == "aad"), fi, off, bytes(slot[_LEN:]), src, dst)
    assert exc.value.errno == errno.EBADMSG
    assert bytes(dst[:_LEN]) == bytes(_LEN)
    assert bytes(dst[_LEN:]) == b"\xaa" * 300
    assert src == bytes(slot[:_LEN])
    row = bytearray(slot[:_LEN])
    with pytest.raises(OSError):
        opener.open(seed + (where == "aad"), fi, off, bytes(slot[_LEN:]), row, row)
    assert bytes(row) == bytes(_LEN)
    # The untampered image still opens: nothing shared was damaged.
    if where == "aad":
        assert opener.open(seed, fi, off, bytes(slot[_LEN:]), src, dst) >= 0
        assert bytes(dst[:_LEN]) == plain


def test_an_early_refusal_touches_nothing_and_enokey_retries_on_the_same_bytes() -> None:
    """ENOKEY (an epoch announced since the table was read), EKEYREVOKED, an
    epoch that never existed and a bad trailer leave dst as it was (in
    place: the ciphertext), so the retry after a reload opens those very
    bytes. Breaks if a refusal zeroed (or decrypted into) the row: the
    reload's retry would fail its tag and free a good slot."""
    (k1, k2), plain, slot, (seed, fi, off) = _sealed_image()
    trailer = bytes(slot[_LEN:])
    gen = bytearray(4)
    stale = _table([(1, k1)], gen_seen=0)  # read before epoch 2 was announced
    stale.watch(gen, 0)
    gen[0] = 1  # announced since
    row = bytearray(slot[:_LEN])
    for t, tr, want in [
        (stale, trailer, errno.ENOKEY),
        (_table([(1, k1)], max_epoch=2, destroyed=(2,)), trailer, errno.EKEYREVOKED),
        (_table([(1, k1)]), trailer, errno.EBADMSG),  # epoch 2 never existed here
        (_table([(1, k1), (2, k2)]), b"XXXX" + trailer[4:], errno.EBADMSG),
    ]:
        with pytest.raises(OSError) as exc:
            t.open(seed, fi, off, tr, row, row)
        assert exc.value.errno == want
        assert bytes(row) == bytes(slot[:_LEN])
        dst = bytearray(b"\x55" * _LEN)
        with pytest.raises(OSError):
            t.open(seed, fi, off, tr, bytes(row), dst)
        assert dst == b"\x55" * _LEN
    stale.set([(1, k1, b"\x01" * 8), (2, k2, b"\x02" * 8)], -1, 0, 0, 2, gen_seen=1)
    stale.open(seed, fi, off, trailer, row, row)  # the reload's retry
    assert bytes(row) == plain
    stale.watch(None)


def test_a_short_dst_or_trailer_is_refused_before_anything_is_written() -> None:
    (k1, k2), _plain, slot, (seed, fi, off) = _sealed_image()
    slot[5] ^= 1  # would fail its tag, were it tried
    t = _table([(1, k1), (2, k2)])
    dst = bytearray(b"\x33" * (_LEN - 1))
    with pytest.raises(OSError) as exc:
        t.open(seed, fi, off, bytes(slot[_LEN:]), bytes(slot[:_LEN]), dst)
    assert exc.value.errno == errno.EINVAL and dst == b"\x33" * (_LEN - 1)
    dst = bytearray(b"\x33" * _LEN)
    with pytest.raises(OSError) as exc:
        t.open(seed, fi, off, bytes(slot[_LEN : _LEN + 63]), bytes(slot[:_LEN]), dst)
    assert exc.value.errno == errno.EINVAL and dst == b"\x33" * _LEN
    with pytest.raises((TypeError, BufferError)):
        t.open(seed, fi, off, bytes(slot[_LEN:]), bytes(slot[:_LEN]), bytes(_LEN))
