"""Round trips on real files, parametrized over O_DIRECT on and off."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from nvmetier.engine.base import OP_DTYPE, OP_READ, OP_WRITE, Op
from nvmetier.errors import ConfigError
from tests.integration.helpers import ROW, key, load_keys, make_store, run, store_keys

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=[True, False], ids=["odirect", "buffered"])
def o_direct(request: pytest.FixtureRequest) -> bool:
    return request.param


def test_stored_chunks_load_back_byte_for_byte(tmp_path, buffer, o_direct) -> None:
    store = make_store(str(tmp_path), buffer, o_direct=o_direct)
    keys = [key(i) for i in range(40)]
    (outcome,) = store_keys(store, buffer, keys)
    assert outcome.success and outcome.transfer_bytes == 40 * ROW
    assert all(store.contains(k) for k in keys)
    loaded, good = load_keys(store, buffer, keys)
    assert loaded.success and loaded.successful_keys is None
    assert good == keys
    assert store.describe()["o_direct"] is o_direct
    store.close()


def test_store_of_a_present_key_skips_the_write(tmp_path, buffer) -> None:
    store = make_store(str(tmp_path), buffer)
    keys = [key(i) for i in range(4)]
    store_keys(store, buffer, keys)
    written = store.stats()["ops_written"]
    (again,) = store_keys(store, buffer, keys, job_id=5)
    assert again.success and again.job_id == 5
    assert store.stats()["ops_written"] == written
    assert store.stats()["stores_skipped_present"] == 4
    store.close()


def test_missing_key_fails_only_that_key(tmp_path, buffer) -> None:
    store = make_store(str(tmp_path), buffer)
    keys = [key(i) for i in range(4)]
    store_keys(store, buffer, keys)
    outcome, good = load_keys(store, buffer, [*keys[:2], key(99), keys[3]])
    assert not outcome.success
    assert outcome.successful_keys == [keys[0], keys[1], keys[3]]
    assert good == [keys[0], keys[1], keys[3]]
    store.close()


def test_reopen_is_warm(tmp_path, buffer) -> None:
    keys = [key(i) for i in range(30)]
    store = make_store(str(tmp_path), buffer)
    store_keys(store, buffer, keys)
    store.close()
    store = make_store(str(tmp_path), buffer)
    assert store.stats()["slots_ready"] == 30
    outcome, good = load_keys(store, buffer, keys)
    assert outcome.success and good == keys
    store.close()


def test_files_are_private(tmp_path, buffer) -> None:
    store = make_store(str(tmp_path), buffer)
    store.close()
    store_dir = tmp_path / "store"
    assert (store_dir.stat().st_mode & 0o777) == 0o700
    for f in store_dir.iterdir():
        assert (f.stat().st_mode & 0o777) == 0o600, f


def test_o_direct_refused_falls_back_with_one_warning(tmp_path, buffer, monkeypatch, caplog):
    monkeypatch.setattr(
        "nvmetier.files.probe_o_direct", lambda d: (False, "Invalid argument (errno 22)")
    )
    with caplog.at_level(logging.WARNING):
        store = make_store(str(tmp_path), buffer)
    warnings = [r for r in caplog.records if "O_DIRECT" in r.getMessage()]
    assert len(warnings) == 1
    assert store.describe()["o_direct"] is False
    keys = [key(i) for i in range(3)]
    store_keys(store, buffer, keys)
    assert load_keys(store, buffer, keys)[1] == keys
    store.close()


def test_o_direct_true_fails_fast_when_refused(tmp_path, buffer, monkeypatch) -> None:
    monkeypatch.setattr("nvmetier.files.probe_o_direct", lambda d: (False, "Invalid argument"))
    with pytest.raises(ConfigError, match="o_direct"):
        make_store(str(tmp_path), buffer, o_direct=True)


def test_checksum_mismatch_is_a_miss_and_invalidates(tmp_path, buffer) -> None:
    store = make_store(str(tmp_path), buffer, o_direct=False)
    keys = [key(i) for i in range(3)]
    store_keys(store, buffer, keys)
    slot = store.slot_of(keys[1])
    file_idx, offset = store.sb.slot_location(slot)
    fd = store.files.data_fds[file_idx]
    os.pwrite(fd, b"\xff" * 16, offset + 100)
    outcome, good = load_keys(store, buffer, keys)
    assert not outcome.success
    assert outcome.successful_keys == [keys[0], keys[2]]
    assert good == [keys[0], keys[2]]
    assert store.stats()["checksum_failures"] == 1
    assert not store.contains(keys[1])
    assert not store.lookup(keys[1])
    store.close()


def test_close_waits_for_ops_in_flight(tmp_path, buffer) -> None:
    store = make_store(str(tmp_path), buffer)
    keys = [key(i) for i in range(64)]
    store.submit_store(1, keys, list(range(64)))
    store.close()  # must not abort mid-flight writes
    store = make_store(str(tmp_path), buffer)
    assert store.stats()["slots_ready"] >= 1
    store.close()


def test_drain_leaves_results_for_the_next_poll(tmp_path, buffer) -> None:
    store = make_store(str(tmp_path), buffer)
    keys = [key(i) for i in range(32)]
    store.submit_store(1, keys, list(range(32)))
    store.submit_store(2, [key(100)], [40])
    assert store.wait_idle(30)
    assert store.stats()["ops_outstanding"] == 0
    assert sorted(o.job_id for o in run(store)) == [1, 2]
    store.close()


def test_queue_bound_drops_stores_instead_of_stalling(tmp_path, buffer) -> None:
    store = make_store(str(tmp_path), buffer, max_queued_bytes=4 * ROW)
    keys = [key(i) for i in range(32)]
    (outcome,) = store_keys(store, buffer, keys)
    # The dropped keys are not stored, so the job is not a success: it names
    # exactly the four that were written (vLLM's backpressure sees the drops).
    assert not outcome.success
    assert outcome.successful_keys == keys[:4]
    assert outcome.transfer_bytes == 4 * ROW
    assert all(store.contains(k) for k in keys[:4])
    assert not any(store.contains(k) for k in keys[4:])
    stats = store.stats()
    assert stats["store_jobs_failed"] == 1
    assert stats["stores_dropped_queue_full"] == 28
    assert stats["ops_written"] == 4
    store.close()


def test_admission_after_lookups(tmp_path, buffer) -> None:
    store = make_store(str(tmp_path), buffer, admit_after_lookups=2)
    k = key(1)
    store_keys(store, buffer, [k])
    assert not store.contains(k)
    assert not store.lookup(k)
    assert not store.lookup(k)
    store_keys(store, buffer, [k], job_id=2)
    assert store.contains(k)
    assert store.stats()["stores_not_admitted"] == 1
    store.close()


def test_ephemeral_store_is_removed_at_close(tmp_path, buffer) -> None:
    store = make_store(str(tmp_path), buffer, persist=False)
    store_keys(store, buffer, [key(1)])
    store.close()
    assert not (tmp_path / "store").exists()


def test_ephemeral_store_left_by_a_crash_serves_nothing(tmp_path, buffer) -> None:
    store = make_store(str(tmp_path), buffer, persist=False)
    store_keys(store, buffer, [key(1)])
    store.files.close(clean=False)  # the process "dies": nothing removed
    store.engine.close()
    store = make_store(str(tmp_path), buffer, persist=False)
    assert not store.contains(key(1))
    assert store.stats()["slots_used"] == 0
    store.close()
    assert not (tmp_path / "store").exists()


def test_checksums_can_be_switched_off(tmp_path, buffer) -> None:
    store = make_store(str(tmp_path), buffer, o_direct=False, verify_checksums=False)
    keys = [key(i) for i in range(2)]
    store_keys(store, buffer, keys)
    file_idx, offset = store.sb.slot_location(store.slot_of(keys[0]))
    os.pwrite(store.files.data_fds[file_idx], b"\xff" * 16, offset + 100)
    outcome, good = load_keys(store, buffer, keys)
    assert outcome.success  # not verified: served as stored on disk
    assert good == [keys[1]]
    assert store.stats()["checksum_failures"] == 0
    store.close()


def test_unverified_loads_ask_the_engine_for_no_checksum(tmp_path, buffer) -> None:
    from nvmetier.config import TierConfig
    from nvmetier.store import BlockStore
    from tests.integration.helpers import IDENTITY

    submitted: list = []

    def recording(engine):
        real_submit = engine.submit_raw

        def submit_raw(ops):
            submitted.extend(
                Op(
                    o["op_id"],
                    o["kind"],
                    o["file_idx"],
                    o["file_offset"],
                    o["buf_offset"],
                    o["length"],
                    o["seed"],
                    bool(o["checksum"]),
                )
                for o in np.frombuffer(ops, dtype=OP_DTYPE)
            )
            real_submit(ops)

        engine.submit_raw = submit_raw
        return engine

    raw = {"root_dir": str(tmp_path), "capacity_bytes": "16MiB", "ways": 8}
    for verify in (True, False):
        cfg = TierConfig.from_dict({**raw, "verify_checksums": verify})
        store = BlockStore(
            cfg,
            store_name="store",
            identity=IDENTITY,
            buffer=buffer,
            row_bytes=ROW,
            engine_wrapper=recording,
        )
        submitted.clear()
        keys = [key(i) for i in range(3)]
        store_keys(store, buffer, keys)
        outcome, good = load_keys(store, buffer, keys)
        assert outcome.success and good == keys
        writes = [op for op in submitted if op.kind == OP_WRITE]
        reads = [op for op in submitted if op.kind == OP_READ]
        assert all(op.checksum for op in writes)  # records always carry one
        assert len(reads) == 3 and all(op.checksum is verify for op in reads)
        store.close()


def test_failed_construction_leaves_no_thread_or_lock_behind(tmp_path, buffer) -> None:
    import threading

    from nvmetier.config import TierConfig
    from nvmetier.store import BlockStore
    from tests.integration.helpers import IDENTITY

    before = threading.active_count()

    def explode(engine):
        raise RuntimeError("wrapper failed")

    cfg = TierConfig.from_dict({"root_dir": str(tmp_path), "capacity_bytes": "8MiB"})
    with pytest.raises(RuntimeError, match="wrapper failed"):
        BlockStore(
            cfg,
            store_name="store",
            identity=IDENTITY,
            buffer=buffer,
            row_bytes=ROW,
            engine="threads",
            engine_wrapper=explode,
        )
    assert threading.active_count() == before
    # Not locked, and the primary region is not exported any more.
    store = BlockStore(cfg, store_name="store", identity=IDENTITY, buffer=buffer, row_bytes=ROW)
    store.close()
