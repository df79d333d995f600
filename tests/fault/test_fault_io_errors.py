"""Injected EIO and ENOSPC on reads and writes (``engine_wrapper``).

The job fails with the right ``successful_keys``, the tier keeps serving the
other keys, and nothing already stored is lost. A read error is not proof of
corruption: the key is a miss until rewritten, but its record stays on disk.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator

import pytest

from nvmetier.engine import OP_READ, OP_WRITE
from nvmetier.store import BlockStore
from tests.fault.faultkit import (
    FaultyEngine,
    key,
    load_keys,
    open_store,
    store_keys,
)

pytestmark = pytest.mark.timeout(60)

ERRNOS = pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC], ids=["EIO", "ENOSPC"])
KEYS = [key(i) for i in range(8)]
BAD = KEYS[3]


class Tier:
    """A store with a FaultyEngine, closed at teardown."""

    def __init__(self, root: str, buf: memoryview) -> None:
        self.engines: list[FaultyEngine] = []
        self.store: BlockStore = open_store(root, buf, engine_wrapper=self._wrap)
        self.faults = self.engines[0]

    def _wrap(self, inner):
        engine = FaultyEngine(inner)
        self.engines.append(engine)
        return engine


@pytest.fixture
def tier(tmp_path, buf) -> Iterator[Tier]:
    t = Tier(str(tmp_path / "kv"), buf)
    yield t
    t.store.close()


# -------------------------------------------------------------------- writes
@ERRNOS
def test_write_error_fails_only_that_key(tier, buf, err) -> None:
    tier.faults.fail(OP_WRITE, err, [BAD])
    outcome = store_keys(tier.store, buf, KEYS)
    assert not outcome.success
    assert outcome.successful_keys == [k for k in KEYS if k != BAD]
    assert tier.store.stats()["write_errors"] == 1


@ERRNOS
def test_write_error_leaves_that_key_a_miss_and_the_others_hits(tier, buf, err) -> None:
    tier.faults.fail(OP_WRITE, err, [BAD])
    store_keys(tier.store, buf, KEYS)
    assert not tier.store.contains(BAD)
    assert all(tier.store.contains(k) for k in KEYS if k != BAD)


@ERRNOS
def test_write_error_loses_nothing_already_stored(tmp_path, buf, err) -> None:
    root = str(tmp_path / "kv")
    tier = Tier(root, buf)
    old = [key(i, trial=1) for i in range(8)]
    assert store_keys(tier.store, buf, old).success
    tier.faults.fail(OP_WRITE, err)  # every write fails from now on
    assert not store_keys(tier.store, buf, KEYS, job_id=2).success
    tier.faults.clear()
    tier.store.close()
    store = open_store(root, buf)
    outcome, _ok, wrong = load_keys(store, buf, old)
    store.close()
    assert outcome.success and wrong == []


@ERRNOS
def test_key_whose_write_failed_can_be_stored_again(tier, buf, err) -> None:
    tier.faults.fail(OP_WRITE, err, [BAD])
    store_keys(tier.store, buf, KEYS)
    tier.faults.clear()
    assert store_keys(tier.store, buf, [BAD], job_id=2).success
    outcome, _, wrong = load_keys(tier.store, buf, [BAD], job_id=3)
    assert outcome.success and wrong == []


# --------------------------------------------------------------------- reads
@ERRNOS
def test_read_error_fails_only_that_key(tier, buf, err) -> None:
    store_keys(tier.store, buf, KEYS)
    tier.faults.fail(OP_READ, err, [BAD])
    outcome, _ok, wrong = load_keys(tier.store, buf, KEYS)
    assert not outcome.success
    assert outcome.successful_keys == [k for k in KEYS if k != BAD]
    assert wrong == []
    assert tier.store.stats()["read_errors"] == 1


@ERRNOS
def test_failed_read_makes_later_lookups_miss(tier, buf, err) -> None:
    store_keys(tier.store, buf, KEYS)
    tier.faults.fail(OP_READ, err, [BAD])
    load_keys(tier.store, buf, [BAD])
    tier.faults.clear()
    # A miss from now on, even with the disk healthy again: no re-promotion loop.
    assert not tier.store.lookup(BAD)
    tier.store.release_holds()


@ERRNOS
def test_tier_keeps_serving_other_keys_after_a_read_error(tier, buf, err) -> None:
    store_keys(tier.store, buf, KEYS)
    tier.faults.fail(OP_READ, err, [BAD])
    load_keys(tier.store, buf, KEYS)
    others = [k for k in KEYS if k != BAD]
    outcome, _, wrong = load_keys(tier.store, buf, others, job_id=3)
    assert outcome.success and wrong == []
    fresh = [key(i, trial=2) for i in range(4)]
    assert store_keys(tier.store, buf, fresh, job_id=4).success
    outcome, _, wrong = load_keys(tier.store, buf, fresh, job_id=5)
    assert outcome.success and wrong == []


@ERRNOS
def test_read_error_is_not_treated_as_corruption(tmp_path, buf, err) -> None:
    root = str(tmp_path / "kv")
    tier = Tier(root, buf)
    store_keys(tier.store, buf, KEYS)
    tier.faults.fail(OP_READ, err, [BAD])
    load_keys(tier.store, buf, KEYS)
    stats = tier.store.stats()
    tier.store.close()
    assert stats["checksum_failures"] == 0
    # The record stayed on disk: a new process serves the key again.
    store = open_store(root, buf)
    outcome, _, wrong = load_keys(store, buf, KEYS)
    store.close()
    assert outcome.success and wrong == []


@ERRNOS
def test_every_read_failing_fails_the_whole_job_and_loses_nothing(tier, buf, err) -> None:
    store_keys(tier.store, buf, KEYS)
    tier.faults.fail(OP_READ, err)
    outcome, ok, _ = load_keys(tier.store, buf, KEYS)
    assert not outcome.success and ok == []
    assert tier.store.stats()["slots_used"] == len(KEYS)


# ------------------------------------------------------- one drive failing
@pytest.mark.parametrize("io_workers", [2, 4])
def test_a_failed_ring_of_one_drive_fails_only_that_drives_keys(
    tmp_path, buf, io_workers, monkeypatch
) -> None:
    """io_uring with several workers over two drives: the ring of drive 1's
    worker fails (EIO on every op it is given); keys striped to drive 0 are
    stored and load back, keys on drive 1 fail and stay misses. With 4
    workers drive 1 has a second worker, so nothing fails."""
    from nvmetier.engine.uring import UringEngine

    monkeypatch.delenv("NVMETIER_IO_WORKERS", raising=False)  # the counts matter here
    roots = [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")]
    store = open_store(roots, buf, io_workers=io_workers)
    try:
        engine = store.engine
        if not isinstance(engine, UringEngine):
            pytest.skip("several io_uring workers need the io_uring engine")
        engine.inject_ring_failure(1, errno.EIO)
        outcome = store_keys(store, buf, KEYS)
        stored = list(KEYS) if outcome.success else list(outcome.successful_keys or [])
        failed = [k for k in KEYS if k not in stored]
        if io_workers == 4:
            assert outcome.success
        else:
            assert failed, "no key was striped to drive 1"
            assert all(store.sb.slot_location(store.slot_of(k))[0] == 0 for k in stored)
            assert not any(store.contains(k) for k in failed)
            assert store.stats()["write_errors"] == len(failed)
        loaded, ok, wrong = load_keys(store, buf, stored, job_id=2)
        assert loaded.success and ok == stored and wrong == []
    finally:
        store.close()
