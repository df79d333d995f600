"""Sealing inside the engines (``Sealing``: the io_uring engine's native
workers and the thread engine's workers) over real files, and the native
HMAC of offload keys: the slot format is SealingEngine's (either reads the
other's chunks), loads open in place in the row, tampering fails only its
op with -EBADMSG, nonces are random and never repeat, and a key's MAC is
HMAC-SHA256."""

from __future__ import annotations

import errno
import hashlib
import hmac
import mmap
import os
import time

import pytest

pytest.importorskip("nvmetier._crypto")

from nvmetier import crypto
from nvmetier.engine import make_engine, uring_status
from nvmetier.engine.base import OP_READ, OP_WRITE, Op
from nvmetier.engine.sealed import (
    TRAILER_BYTES,
    SealingEngine,
    parse_trailer,
)
from nvmetier.engine.threads import ThreadEngine
from tests.integration.helpers import make_sealing

pytestmark = pytest.mark.timeout(60)

ROW = 16384
SLOT = ROW + 4096
ROWS = 16
ENGINES = [
    "threads",
    pytest.param(
        "uring", marks=pytest.mark.skipif(not uring_status()[0], reason="io_uring unavailable")
    ),
]


_URING_SKIP = pytest.mark.skipif(not uring_status()[0], reason="io_uring unavailable")
# (engine, staging): with staging the slot image is a span of the worker's
# huge-page arena; without it, a bounce slot (writes) or the row (reads).
RIGS = [
    pytest.param(("threads", False), id="threads"),
    pytest.param(("threads", True), id="threads-staged"),
    pytest.param(("uring", False), id="uring", marks=_URING_SKIP),
    pytest.param(("uring", True), id="uring-staged", marks=_URING_SKIP),
]


class Rig:
    def __init__(
        self, tmp_path, engine: str, nonce_block: int = 1 << 20, staging: bool = False
    ) -> None:
        self.fd = os.open(str(tmp_path / "data"), os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(self.fd, SLOT * 64)
        self.primary = mmap.mmap(-1, ROW * ROWS)
        self.primary.write(os.urandom(ROW * ROWS))
        self.sealing = make_sealing(tmp_path, ROW, SLOT)
        self.keys = self.sealing.keys
        self.engine = make_engine(
            engine,
            memoryview(self.primary),
            [self.fd],
            io_threads=4,
            queue_depth=8,
            sealing=self.sealing,
            staging=staging,
        )

    def run(self, ops, engine=None):
        eng = engine or self.engine
        eng.submit(ops)
        out = {}
        while len(out) < len(ops):
            for c in eng.wait_completions(5.0):
                out[c.op_id] = c
        return out

    def sealing_engine(self, n_bounce: int, n_threads: int) -> SealingEngine:
        """The Python SealingEngine over this rig's files and key table."""
        return SealingEngine(
            memoryview(self.primary),
            row_bytes=ROW,
            slot_bytes=SLOT,
            sealing=self.sealing,
            make_inner=lambda buf: ThreadEngine(buf, [self.fd], n_threads=2),
            n_bounce=n_bounce,
            n_threads=n_threads,
        )

    def close(self) -> None:
        self.engine.close()
        self.sealing.close()
        self.sealing.keyring.close()
        os.close(self.fd)
        self.primary.close()


@pytest.fixture(params=RIGS)
def rig(request, tmp_path):
    engine, staging = request.param
    r = Rig(tmp_path, engine, staging=staging)
    yield r
    r.close()


def test_round_trip_opens_in_place_and_the_disk_holds_only_ciphertext(rig) -> None:
    before = bytes(rig.primary)
    writes = [Op(i, OP_WRITE, 0, i * SLOT, i * ROW, ROW, 1000 + i) for i in range(ROWS)]
    done = rig.run(writes)
    assert all(c.result == ROW and c.checksum for c in done.values())
    assert bytes(rig.primary) == before  # the primary is only read
    for i in range(ROWS):
        slot = os.pread(rig.fd, SLOT, i * SLOT)
        assert before[i * ROW : (i + 1) * ROW] not in slot  # sealed, not copied
        parsed = parse_trailer(slot[ROW : ROW + TRAILER_BYTES])
        assert parsed is not None and parsed[2] == rig.sealing.epoch
        assert slot[ROW + TRAILER_BYTES :] == bytes(SLOT - ROW - TRAILER_BYTES)
    rig.primary[:] = bytes(len(rig.primary))
    # Rows read back into other rows: opened where they land.
    reads = [
        Op(100 + i, OP_READ, 0, i * SLOT, ((i + 3) % ROWS) * ROW, ROW, 1000 + i)
        for i in range(ROWS)
    ]
    got = rig.run(reads)
    for i in range(ROWS):
        assert got[100 + i].result == ROW
        assert got[100 + i].checksum == done[i].checksum
        j = (i + 3) % ROWS
        assert bytes(rig.primary[j * ROW : (j + 1) * ROW]) == before[i * ROW : (i + 1) * ROW]


@pytest.mark.parametrize("where", ["chunk", "trailer_tag", "trailer_magic", "seed"])
def test_tampering_fails_only_its_op_with_ebadmsg(rig, where) -> None:
    rig.run([Op(i, OP_WRITE, 0, i * SLOT, i * ROW, ROW, 7) for i in range(3)])
    seed = 7
    if where == "chunk":
        os.pwrite(rig.fd, bytes([os.pread(rig.fd, 1, SLOT + 5)[0] ^ 1]), SLOT + 5)
    elif where == "trailer_tag":
        at = SLOT + ROW + 20
        os.pwrite(rig.fd, bytes([os.pread(rig.fd, 1, at)[0] ^ 0x80]), at)
    elif where == "trailer_magic":
        os.pwrite(rig.fd, b"XXXX", SLOT + ROW)
    got = rig.run(
        [
            Op(
                10 + i,
                OP_READ,
                0,
                i * SLOT,
                i * ROW,
                ROW,
                8 if where == "seed" and i == 1 else seed,
            )
            for i in range(3)
        ]
    )
    assert got[11].result == -errno.EBADMSG and got[11].checksum == 0
    assert got[10].result == ROW and got[12].result == ROW
    if hasattr(rig.engine, "auth_failures"):
        assert rig.engine.auth_failures == 1
    if where != "trailer_magic":
        # GCM decrypted before its tag failed: a flipped ciphertext bit is the
        # same plaintext bit flipped. None of that is left in the row.
        assert bytes(rig.primary[ROW : 2 * ROW]) == bytes(ROW)
    assert bytes(rig.primary[0:ROW]) != bytes(ROW)  # the others opened


def test_an_op_of_another_length_fails_with_efault(rig) -> None:
    got = rig.run([Op(1, OP_WRITE, 0, 0, 0, ROW // 2, 1), Op(2, OP_READ, 0, 0, 0, 2 * ROW, 1)])
    assert got[1].result == -errno.EFAULT and got[2].result == -errno.EFAULT


def test_a_key_file_rotation_never_opens_old_chunks(rig, tmp_path) -> None:
    rig.run([Op(1, OP_WRITE, 0, 0, 0, ROW, 5)])
    # Another store (same epoch number, its own random key): nothing opens.
    (tmp_path / "other").mkdir()
    other = make_sealing(tmp_path / "other", ROW, SLOT, key=os.urandom(32))
    assert other.epoch == rig.sealing.epoch
    eng = ThreadEngine(memoryview(rig.primary), [rig.fd], n_threads=1, sealing=other)
    try:
        assert rig.run([Op(2, OP_READ, 0, 0, ROW, ROW, 5)], eng)[2].result == -errno.EBADMSG
    finally:
        eng.close()
        other.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_the_slot_format_is_sealing_engines(tmp_path, engine) -> None:
    """A chunk sealed in an engine opens through SealingEngine and back."""
    r = Rig(tmp_path, engine)
    try:
        want = bytes(r.primary[:ROW])
        assert r.run([Op(1, OP_WRITE, 0, 0, 0, ROW, 9)])[1].result == ROW
        old = r.sealing_engine(n_bounce=2, n_threads=1)
        try:
            assert r.run([Op(2, OP_READ, 0, 0, ROW, ROW, 9)], old)[2].result == ROW
            assert bytes(r.primary[ROW : 2 * ROW]) == want
            r.primary[2 * ROW : 3 * ROW] = os.urandom(ROW)
            want2 = bytes(r.primary[2 * ROW : 3 * ROW])
            assert r.run([Op(3, OP_WRITE, 0, SLOT, 2 * ROW, ROW, 4)], old)[3].result == ROW
        finally:
            old.close()
        assert r.run([Op(4, OP_READ, 0, SLOT, 3 * ROW, ROW, 4)])[4].result == ROW
        assert bytes(r.primary[3 * ROW : 4 * ROW]) == want2
    finally:
        r.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_nonces_are_random_and_never_repeat(tmp_path, engine) -> None:
    """Every seal draws its own 96 random bits (no counter, no file)."""
    r = Rig(tmp_path, engine)
    try:
        seen: set[bytes] = set()
        for rnd in range(8):
            got = r.run(
                [Op(rnd * 10 + i, OP_WRITE, 0, i * SLOT, i * ROW, ROW, 1) for i in range(5)]
            )
            assert all(c.result == ROW for c in got.values())
            for i in range(5):
                parsed = parse_trailer(os.pread(r.fd, TRAILER_BYTES, i * SLOT + ROW))
                assert parsed is not None
                assert parsed[0] not in seen
                seen.add(parsed[0])
        assert len(seen) == 40
    finally:
        r.close()


@pytest.mark.skipif(not uring_status()[0], reason="io_uring unavailable")
def test_a_key_table_without_a_sealing_epoch_fails_writes_with_eagain(tmp_path) -> None:
    import nvmetier._crypto as native
    import nvmetier._uring as _uring

    fd = os.open(str(tmp_path / "d"), os.O_CREAT | os.O_RDWR, 0o600)
    buf = mmap.mmap(-1, ROW)
    keys = native.Keys(bytes(16), 2)
    keys.set([(1, bytes(32), bytes(8))], -1, 0, 1 << 28, 1)
    eng = _uring.Engine(buf, [fd], sealing=(keys.capsule(), ROW, SLOT))
    try:
        got = []
        eng.submit([(1, 1, 0, 0, 0, ROW, 0, False)])
        while not got:
            got += eng.wait(5.0)
        assert got[0][1] == -errno.EAGAIN  # no epoch may seal: nothing written
        with pytest.raises(ValueError):
            _uring.Engine(buf, [fd], sealing=(keys.capsule(), ROW, ROW + 63))
        with pytest.raises(ValueError):
            _uring.Engine(buf, [fd], sealing=(object(), ROW, SLOT))
    finally:
        eng.close()
        buf.close()
        os.close(fd)


@pytest.mark.parametrize("n", [0, 1, 31, 55, 56, 63, 64, 65, 119, 1000])
def test_native_key_mac_is_hmac_sha256(n) -> None:
    import nvmetier._crypto as native

    mac_key = os.urandom(32)
    msg = os.urandom(n)
    want = hmac.digest(mac_key, msg, hashlib.sha256)
    km = native.KeyMac(mac_key)
    assert km(msg) == want and km(bytearray(msg)) == want
    assert km.many([msg, b"x"]) == [want, hmac.digest(mac_key, b"x", hashlib.sha256)]
    long_key = os.urandom(100)  # longer than a block: hashed first
    assert native.KeyMac(long_key)(msg) == hmac.digest(long_key, msg, hashlib.sha256)
    seen = []
    assert native.KeyMac(mac_key, lambda m: seen.append(m) or True)(msg) is True
    assert seen == [want]


def test_key_set_macs_and_mac_then_agree() -> None:
    keys = crypto.KeySet(os.urandom(32))
    ks = [os.urandom(16) for _ in range(5)]
    want = [hmac.digest(keys.mac_key, k, hashlib.sha256) for k in ks]
    assert [keys.key_mac(k) for k in ks] == want
    assert keys.key_macs(ks) == want
    assert keys.mac_then(lambda m: m[:4])(ks[0]) == want[0][:4]
    import nvmetier._crypto as native

    with pytest.raises(TypeError):
        native.KeyMac(b"k", then=3)
    with pytest.raises(TypeError):
        native.KeyMac(b"k")()


class Slots:
    """A data file of ``n`` slots, a primary of ``n`` random rows, a nonce
    source and a ``Sealing`` over them (the engines are the test's)."""

    def __init__(self, tmp_path, row: int = ROW, slot: int = SLOT, n: int = ROWS) -> None:
        self.row, self.slot, self.n = row, slot, n
        self.fd = os.open(str(tmp_path / "data"), os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(self.fd, slot * n)
        self.primary = mmap.mmap(-1, row * n)
        self.data = os.urandom(row * n)
        self.primary[:] = self.data
        self.sealing = make_sealing(tmp_path, row, slot, digest=7)

    def ops(self, kind: int, rows: range, base: int = 0, seed: int = 5) -> list[Op]:
        """One op per row i of ``rows``: row i <-> slot i, op_id base + i."""
        return [Op(base + i, kind, 0, i * self.slot, i * self.row, self.row, seed) for i in rows]

    def close(self) -> None:
        self.sealing.close()
        self.sealing.keyring.close()
        os.close(self.fd)
        self.primary.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_a_sealing_engine_stages_and_its_slots_read_back_either_way(tmp_path, engine) -> None:
    # Staged (slot image in the huge-page arena) and unstaged (bounce slot,
    # open in place) write the same slot format: each reads the other's.
    f = Slots(tmp_path)
    r = Rig.__new__(Rig)

    def engine_of(staging: bool):
        return make_engine(
            engine,
            memoryview(f.primary),
            [f.fd],
            io_threads=2,
            queue_depth=8,
            staging=staging,
            sealing=f.sealing,
        )

    staged, plain = engine_of(True), engine_of(False)
    try:
        d = staged.describe()
        assert d["staging"] is True and d["encryption"] == "aes-256-gcm"
        assert plain.describe()["staging"] is False
        first, second = range(ROWS // 2), range(ROWS // 2, ROWS)
        # the first half written staged, the second unstaged
        done = r.run(f.ops(OP_WRITE, first), staged)
        done.update(r.run(f.ops(OP_WRITE, second), plain))
        assert all(c.result == ROW for c in done.values())
        assert staged.describe()["staged_bytes"] == len(first) * ROW
        for i in range(ROWS):
            assert f.data[i * ROW : (i + 1) * ROW] not in os.pread(f.fd, SLOT, i * SLOT)
        f.primary[:] = bytes(len(f.primary))
        # and read back crosswise: the staged engine the unstaged rows, and so on
        got = r.run(f.ops(OP_READ, second, base=100), staged)
        got.update(r.run(f.ops(OP_READ, first, base=100), plain))
        assert all(got[100 + i].result == ROW for i in range(ROWS))
        assert all(got[100 + i].checksum == done[i].checksum for i in range(ROWS))
        assert bytes(f.primary) == f.data
        assert staged.describe()["staged_bytes"] == ROWS * ROW
        assert plain.describe()["staged_bytes"] == 0
    finally:
        staged.close()
        plain.close()
        f.close()


@pytest.mark.skipif(not uring_status()[0], reason="io_uring unavailable")
def test_a_sealed_op_that_finds_no_arena_span_moves_through_its_bounce_slot(tmp_path) -> None:
    # An arena of one span (the arena is one 2 MiB huge page; a 1 MiB row's
    # slot takes 17 of its 32 units): with several ops in flight the others
    # find it taken and take the unstaged path in the same ring; every op
    # still round-trips.
    from nvmetier.engine.uring import UringEngine

    f = Slots(tmp_path, row=1 << 20, slot=(1 << 20) + 4096)
    eng = UringEngine(
        memoryview(f.primary), [f.fd], queue_depth=8, staging_bytes=4096, sealing=f.sealing
    )
    r = Rig.__new__(Rig)
    try:
        done = r.run(f.ops(OP_WRITE, range(ROWS)), eng)
        assert all(c.result == f.row for c in done.values())
        f.primary[:] = bytes(len(f.primary))
        got = r.run(f.ops(OP_READ, range(ROWS), base=100), eng)
        assert all(c.result == f.row for c in got.values())
        assert bytes(f.primary) == f.data
        staged = eng.describe()["staged_bytes"]
        assert 0 < staged < 2 * ROWS * f.row  # both paths were taken
    finally:
        eng.close()
        f.close()


@pytest.mark.skipif(not uring_status()[0], reason="io_uring unavailable")
def test_a_sealed_arena_of_small_rows_maps_no_more_spans_than_a_worker_holds(tmp_path) -> None:
    # Every sealed op takes a whole span (its slot, rounded to 64 KiB units):
    # sized by the rows that fit the byte cap, an arena of small rows mapped
    # (and faulted in) many times what the plain tier maps (4 KiB rows: 16x).
    # A worker never holds more than 2 * queue_depth spans (its ops in
    # flight, and reads reaped but not yet opened), and each of them stages.
    from nvmetier.engine.uring import UringEngine

    f = Slots(tmp_path, row=4096, slot=8192, n=16)
    eng = UringEngine(
        memoryview(f.primary),
        [f.fd],
        queue_depth=8,
        max_inflight_bytes=4 << 20,
        staging_bytes=8 << 20,
        sealing=f.sealing,
    )
    r = Rig.__new__(Rig)
    try:
        # 2 * qd spans of one 64 KiB unit: one 2 MiB huge page (was 128 MiB)
        assert eng.describe()["worker_staging_bytes"] == [2 << 20]
        done = r.run(f.ops(OP_WRITE, range(f.n)), eng)
        assert all(c.result == f.row for c in done.values())
        f.primary[:] = bytes(len(f.primary))
        got = r.run(f.ops(OP_READ, range(f.n), base=100), eng)
        assert all(c.result == f.row for c in got.values())
        assert bytes(f.primary) == f.data
        assert eng.describe()["staged_bytes"] == 2 * f.n * f.row  # every op found a span
    finally:
        eng.close()
        f.close()


@pytest.mark.skipif(not uring_status()[0], reason="io_uring unavailable")
def test_every_failed_sealed_op_gives_its_arena_span_back(tmp_path) -> None:
    # An arena of one span (a 1 MiB row's slot takes 17 of a huge page's 32
    # units): after each kind of failure (no nonce, end of file, a slot cut
    # short, a bad tag, a bad trailer) the next op still stages, and a failed
    # read never leaves ciphertext in the row as a success.
    import nvmetier._crypto as native
    import nvmetier._uring as _uring

    f = Slots(tmp_path, row=1 << 20, slot=(1 << 20) + 4096, n=4)
    keys = native.Keys(bytes(16), 2)
    row, slot, n, fd, primary, data = f.row, f.slot, f.n, f.fd, f.primary, f.data
    eng = _uring.Engine(
        primary,
        [fd],
        queue_depth=4,
        workers=1,
        staging_bytes=4096,
        sealing=(keys.capsule(), row, slot),
    )

    def run(op_id, kind, file_off, seed=5):
        eng.submit([(op_id, kind, 0, file_off, 0, row, seed, False)])
        got = []
        while not got:
            got += eng.wait(5.0)
        return got[0][1]

    def staged_by(op_id, kind, file_off):
        before = eng.worker_stats()[0]["staged_bytes"]
        result = run(op_id, kind, file_off)
        return result, eng.worker_stats()[0]["staged_bytes"] - before

    try:
        assert eng.info()["workers"][0]["staging_bytes"] == 2 << 20
        assert run(1, OP_WRITE, 0) == -errno.EAGAIN  # no sealing epoch yet
        keys.set([(1, bytes(range(32)), bytes(8))], 1, time.time_ns() + 10**12, 1 << 28, 1)
        assert staged_by(2, OP_WRITE, 0) == (row, row)
        good = os.pread(fd, slot, 0)
        assert run(3, OP_READ, 10 * slot) == -errno.EIO  # past the end
        assert staged_by(4, OP_READ, 0) == (row, row)
        os.pwrite(fd, good[: row + 10], n * slot)  # ends in the trailer
        assert run(5, OP_READ, n * slot) == -errno.EIO
        assert staged_by(6, OP_READ, 0) == (row, row)
        os.pwrite(fd, bytes([good[7] ^ 1]), 7)  # a bad tag
        assert run(7, OP_READ, 0) == -errno.EBADMSG
        os.pwrite(fd, good[7:8], 7)
        assert staged_by(8, OP_READ, 0) == (row, row)
        os.pwrite(fd, b"XXXX", row)  # a bad trailer
        primary[:row] = bytes(row)
        assert run(9, OP_READ, 0) == -errno.EBADMSG
        assert bytes(primary[:row]) == bytes(row)  # untouched
        os.pwrite(fd, good[row : row + 4], row)
        assert run(10, OP_READ, 0, seed=6) == -errno.EBADMSG  # another key's chunk
        assert staged_by(11, OP_READ, 0) == (row, row)
        assert bytes(primary[:row]) == data[:row]
    finally:
        eng.close()
        f.close()


def test_a_slot_image_moved_to_another_slot_never_opens(rig) -> None:
    # The slot's place is in the authenticated data: the same bytes, the
    # same key's seed, another slot (or store) is EBADMSG, counted.
    rig.run([Op(1, OP_WRITE, 0, 0, 0, ROW, 5)])
    os.pwrite(rig.fd, os.pread(rig.fd, SLOT, 0), 3 * SLOT)
    got = rig.run([Op(2, OP_READ, 0, 3 * SLOT, ROW, ROW, 5), Op(3, OP_READ, 0, 0, 0, ROW, 5)])
    assert got[2].result == -errno.EBADMSG and got[3].result == ROW
    if hasattr(rig.engine, "auth_failures"):
        assert rig.engine.auth_failures == 1


def _neighbours_survive_a_failed_open(r: Rig, engine=None) -> None:
    """Slots 0..4 sealed from rows 0..4; slot 2's ciphertext tampered; read
    back into rows 9..13 (row 11 fails) with rows 8 and 14 sentinels, while
    writes of rows 0..4 (only read) run in the same batch. The failed row is
    zeros; every other row holds exactly what it should."""
    plain = [os.urandom(ROW) for _ in range(5)]
    for i, p in enumerate(plain):
        r.primary[i * ROW : (i + 1) * ROW] = p
    assert all(
        c.result == ROW
        for c in r.run(
            [Op(i, OP_WRITE, 0, i * SLOT, i * ROW, ROW, 50 + i) for i in range(5)], engine
        ).values()
    )
    at = 2 * SLOT + ROW - 1  # the last ciphertext byte: the tail of the zeroing
    os.pwrite(r.fd, bytes([os.pread(r.fd, 1, at)[0] ^ 1]), at)
    r.primary[8 * ROW : 15 * ROW] = b"\x5a" * (7 * ROW)
    ops = [Op(20 + i, OP_READ, 0, i * SLOT, (9 + i) * ROW, ROW, 50 + i) for i in range(5)]
    ops += [Op(30 + i, OP_WRITE, 0, (40 + i) * SLOT, i * ROW, ROW, 60 + i) for i in range(5)]
    got = r.run(ops, engine)
    assert got[22].result == -errno.EBADMSG
    assert all(got[i].result == ROW for i in (20, 21, 23, 24, 30, 31, 32, 33, 34))
    assert bytes(r.primary[11 * ROW : 12 * ROW]) == bytes(ROW)
    for i in (0, 1, 3, 4):
        assert bytes(r.primary[(9 + i) * ROW : (10 + i) * ROW]) == plain[i]
    for i in range(5):
        assert bytes(r.primary[i * ROW : (i + 1) * ROW]) == plain[i]  # only read
    assert bytes(r.primary[8 * ROW : 9 * ROW]) == b"\x5a" * ROW
    assert bytes(r.primary[14 * ROW : 15 * ROW]) == b"\x5a" * ROW


def test_a_failed_open_zeroes_its_row_and_no_neighbour(rig) -> None:
    _neighbours_survive_a_failed_open(rig)


def test_a_failed_open_through_sealing_engine_zeroes_its_row_and_no_neighbour(tmp_path) -> None:
    r = Rig(tmp_path, "threads")
    try:
        old = r.sealing_engine(n_bounce=3, n_threads=2)
        try:
            _neighbours_survive_a_failed_open(r, old)
        finally:
            old.close()
    finally:
        r.close()
