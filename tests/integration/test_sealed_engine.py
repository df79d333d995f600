"""SealingEngine on its own over real files and the thread engine (a fault
injector between them): the primary is only read, what is read back is what
was sealed, inner errors fail only their op, and more ops than bounce slots
all complete."""

from __future__ import annotations

import errno
import mmap
import os

import pytest

from tests.integration.helpers import make_sealing

pytest.importorskip("nvmetier._crypto")

from nvmetier.engine.base import OP_READ, OP_WRITE, Op
from nvmetier.engine.sealed import SealingEngine, checksum_of_tag
from nvmetier.engine.threads import ThreadEngine
from tests.fault.faultkit import FaultyEngine

pytestmark = pytest.mark.timeout(60)

ROW = 16384
SLOT = ROW + 4096
ROWS = 32


@pytest.fixture
def rig(tmp_path):
    fd = os.open(str(tmp_path / "data"), os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, SLOT * 64)
    primary = mmap.mmap(-1, ROW * ROWS)
    primary.write(os.urandom(ROW * ROWS))
    sealing = make_sealing(tmp_path, ROW, SLOT, key=os.urandom(32))
    faulty: list[FaultyEngine] = []

    def inner(buf: memoryview) -> FaultyEngine:
        faulty.append(FaultyEngine(ThreadEngine(buf, [fd], n_threads=4)))
        return faulty[0]

    eng = SealingEngine(
        memoryview(primary),
        row_bytes=ROW,
        slot_bytes=SLOT,
        sealing=sealing,
        make_inner=inner,
        n_bounce=4,
        n_threads=2,
    )
    yield eng, primary, faulty[0]
    eng.close()
    sealing.close()
    os.close(fd)
    primary.close()


def run(eng, ops):
    eng.submit(ops)
    out = {}
    while len(out) < len(ops):
        for c in eng.wait_completions(5.0):
            out[c.op_id] = c
    return out


def test_round_trip_and_the_primary_is_only_read(rig) -> None:
    eng, primary, _faulty = rig
    before = bytes(primary)
    writes = [Op(i, OP_WRITE, 0, i * SLOT, i * ROW, ROW, 1000 + i) for i in range(12)]
    done = run(eng, writes)  # 12 ops through 4 bounce slots
    assert all(c.result == ROW and c.checksum for c in done.values())
    assert bytes(primary) == before
    primary[:] = bytes(len(primary))
    reads = [Op(100 + i, OP_READ, 0, i * SLOT, i * ROW, ROW, 1000 + i) for i in range(12)]
    got = run(eng, reads)
    assert all(got[100 + i].result == ROW for i in range(12))
    assert all(got[100 + i].checksum == done[i].checksum for i in range(12))
    assert bytes(primary[: 12 * ROW]) == before[: 12 * ROW]


def test_a_load_under_another_seed_never_opens(rig) -> None:
    eng, _primary, _faulty = rig
    run(eng, [Op(1, OP_WRITE, 0, 0, 0, ROW, 7)])
    (c,) = run(eng, [Op(2, OP_READ, 0, 0, ROW, ROW, 8)]).values()  # another key's seed
    assert c.result == -errno.EBADMSG


def test_an_inner_error_fails_only_its_op_and_frees_its_bounce_slot(rig) -> None:
    eng, _primary, faulty = rig
    faulty.fail(OP_WRITE, errno.EIO)
    failed = run(eng, [Op(i, OP_WRITE, 0, i * SLOT, i * ROW, ROW, i) for i in range(8)])
    assert all(c.result == -errno.EIO for c in failed.values())
    faulty.clear()
    ok = run(eng, [Op(50 + i, OP_WRITE, 0, i * SLOT, i * ROW, ROW, i) for i in range(8)])
    assert all(c.result == ROW for c in ok.values())


def test_checksum_is_the_tags_head() -> None:
    tag = bytes(range(16))
    assert checksum_of_tag(tag) == int.from_bytes(tag[:8], "little")
