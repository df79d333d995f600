"""``nvmetier purge`` on real files, with this process attached (online) or
not (offline): what is removed, what attached processes see, and the KV
removal events. Multi-process faults are in tests/fault/test_fault_purge.py."""

from __future__ import annotations

import time
from collections.abc import Iterator

import nvmetier._table as _table
import pytest

from nvmetier import purge
from nvmetier.engine.base import OP_WRITE, IoEngine
from tests.integration.helpers import (
    ROW,
    HeldOps,
    fill_rows,
    key,
    load_keys,
    make_store,
    payload,
    run,
    store_keys,
)

pytestmark = pytest.mark.timeout(120)

S = 1_000_000_000


@pytest.fixture(autouse=True)
def wall_clock() -> Iterator[None]:
    yield
    _table._set_wall_clock_offset_ns(0)


def store_dir(tmp_path) -> str:
    return str(tmp_path / "store")


def test_purge_all_of_a_live_store_makes_every_chunk_a_miss(tmp_path, buffer) -> None:
    store = make_store(str(tmp_path), buffer)
    keys = [key(i) for i in range(30)]
    store_keys(store, buffer, keys)
    (r,) = purge.purge(str(tmp_path), older_than_s=None)
    assert r.online and r.error is None and r.busy_sets == 0
    assert r.removed == 30 and r.removed_bytes == 30 * store.sb.slot_bytes
    assert r.exit_code == 0
    assert not any(store.contains(k) for k in keys)
    assert store.stats()["slots_used"] == 0
    outcome, good = load_keys(store, buffer, keys)
    assert not outcome.success and good == []
    # The store works on: new chunks are stored and served.
    (again,) = store_keys(store, buffer, keys, job_id=9)
    assert again.success and all(store.contains(k) for k in keys)
    store.close()


def test_purge_older_than_keeps_newer_chunks(tmp_path, buffer) -> None:
    store = make_store(str(tmp_path), buffer)
    old = [key(i) for i in range(10)]
    new = [key(100 + i) for i in range(10)]
    _table._set_wall_clock_offset_ns(-7200 * S)  # stored two hours ago
    store_keys(store, buffer, old)
    _table._set_wall_clock_offset_ns(0)
    store_keys(store, buffer, new, job_id=3)
    (r,) = purge.purge(str(tmp_path), older_than_s=3600)
    assert r.removed == 10 and r.exit_code == 0
    assert not any(store.contains(k) for k in old)
    assert all(store.contains(k) for k in new)
    store.close()


def test_purge_removals_become_kv_events_of_one_attached_process(tmp_path, buffer) -> None:
    first = make_store(str(tmp_path), buffer, enable_kv_events=True)
    second = make_store(str(tmp_path), buffer, enable_kv_events=True)
    keys = [key(i) for i in range(12)]
    store_keys(first, buffer, keys)
    first.take_events()
    (r,) = purge.purge(str(tmp_path), older_than_s=None)
    assert r.events_logged == 12
    ((removed, got),) = first.take_events()
    assert removed and sorted(got) == sorted(keys)
    assert second.take_events() == []  # taken once, by the first to see it
    assert first.take_events() == []
    assert first.stats()["purge_removals_emitted"] == 12
    second.close()
    first.close()


def test_purge_events_of_two_purges_not_yet_taken_are_kept(tmp_path, buffer) -> None:
    store = make_store(str(tmp_path), buffer, enable_kv_events=True)
    a = [key(i) for i in range(5)]
    b = [key(100 + i) for i in range(5)]
    store_keys(store, buffer, a)
    purge.purge(str(tmp_path), older_than_s=None)
    store_keys(store, buffer, b, job_id=3)
    store.take_events()  # takes the first purge's removals (a)
    purge.purge(str(tmp_path), older_than_s=None)
    store_keys(store, buffer, a, job_id=4)
    purge.purge(str(tmp_path), older_than_s=None)
    removed = [k for is_removed, ks in store.take_events() if is_removed for k in ks]
    assert sorted(removed) == sorted(b + a)
    store.close()


def test_write_in_flight_during_purge_all_is_never_published(tmp_path, buffer) -> None:
    held: list[HeldOps] = []

    def wrap(engine: IoEngine) -> IoEngine:
        held.append(HeldOps(engine, OP_WRITE))
        return held[0]

    store = make_store(str(tmp_path), buffer, engine_wrapper=wrap)
    keys = [key(i) for i in range(4)]
    held[0].hold = True
    fill_rows(buffer, keys, range(4))
    store.submit_store(1, keys, list(range(4)))
    assert held[0].held() == 4
    (r,) = purge.purge(str(tmp_path), older_than_s=None)
    assert r.writing_marked == 4 and r.removed == 0
    held[0].release()
    (outcome,) = run(store)
    assert not outcome.success and outcome.successful_keys == []
    assert not any(store.contains(k) for k in keys)
    assert store.stats()["stores_purged"] == 4
    assert store.stats()["slots_used"] == 0
    (again,) = store_keys(store, buffer, keys, job_id=2)
    assert again.success and all(store.contains(k) for k in keys)
    store.close()


def test_write_in_flight_during_purge_older_than_is_kept(tmp_path, buffer) -> None:
    held: list[HeldOps] = []

    def wrap(engine: IoEngine) -> IoEngine:
        held.append(HeldOps(engine, OP_WRITE))
        return held[0]

    store = make_store(str(tmp_path), buffer, engine_wrapper=wrap)
    keys = [key(i) for i in range(4)]
    held[0].hold = True
    fill_rows(buffer, keys, range(4))
    store.submit_store(1, keys, list(range(4)))
    (r,) = purge.purge(str(tmp_path), older_than_s=60)
    assert r.writing_kept == 4 and r.writing_marked == 0
    held[0].release()
    (outcome,) = run(store)
    assert outcome.success and all(store.contains(k) for k in keys)
    store.close()


def test_load_in_flight_of_a_purged_chunk_fails_never_served(tmp_path, buffer) -> None:
    store = make_store(str(tmp_path), buffer)
    keys = [key(i) for i in range(8)]
    store_keys(store, buffer, keys)
    assert all(store.lookup(k) for k in keys)  # leased hits: purged anyway
    buffer[: 8 * ROW] = bytes(8 * ROW)
    store.submit_load(5, keys, list(range(8)))
    purge.purge(str(tmp_path), older_than_s=None)
    (outcome,) = run(store)
    # Each key either completed before the purge (its bytes are right, read
    # before its slot was cleared) or fails: none is reported from a purged slot.
    ok = keys if outcome.success else list(outcome.successful_keys or [])
    for k in ok:
        i = keys.index(k)
        assert bytes(buffer[i * ROW : (i + 1) * ROW]) == payload(k)
    assert not any(store.contains(k) for k in keys)
    store.close()


def test_offline_purge_removes_records_before_the_next_open(tmp_path, buffer) -> None:
    keys = [key(i) for i in range(20)]
    store = make_store(str(tmp_path), buffer)
    store_keys(store, buffer, keys)
    store.close()
    (r,) = purge.purge(str(tmp_path), older_than_s=None)
    assert not r.online and r.removed == 20 and r.exit_code == 0
    store = make_store(str(tmp_path), buffer)
    assert store.stats()["slots_ready"] == 0
    assert not any(store.contains(k) for k in keys)
    store.close()


def test_offline_purge_older_than(tmp_path, buffer) -> None:
    old = [key(i) for i in range(6)]
    new = [key(50 + i) for i in range(6)]
    store = make_store(str(tmp_path), buffer)
    _table._set_wall_clock_offset_ns(-3 * 86400 * S)
    store_keys(store, buffer, old)
    _table._set_wall_clock_offset_ns(0)
    store_keys(store, buffer, new, job_id=3)
    store.close()
    (r,) = purge.purge(str(tmp_path), older_than_s=86400)
    assert r.removed == 6
    store = make_store(str(tmp_path), buffer)
    assert not any(store.contains(k) for k in old)
    assert all(store.contains(k) for k in new)
    store.close()


def test_purge_of_a_private_store_held_exclusively_is_refused(tmp_path, buffer) -> None:
    store = make_store(str(tmp_path), buffer, sharing="process")
    store_keys(store, buffer, [key(1)])
    (r,) = purge.purge(str(tmp_path), older_than_s=None)
    assert r.exit_code == 4 and r.error is not None and "exclusively" in r.error
    assert store.contains(key(1))
    store.close()


def test_purge_by_model_skips_other_models(tmp_path, buffer) -> None:
    # Two models' stores under one root_dir, named as vLLM's identity names them.
    a = make_store(str(tmp_path), buffer, identity={"model_name": "org/a", "chunk_bytes": ROW})
    store_keys(a, buffer, [key(1)])
    a.close()
    b = make_store(
        str(tmp_path / "other"), buffer, identity={"model_name": "org/b", "chunk_bytes": ROW}
    )
    store_keys(b, buffer, [key(2)])
    b.close()
    with pytest.raises(purge.PurgeOperationalError, match="no store of model 'org/c'"):
        purge.purge(str(tmp_path), older_than_s=None, model="org/c")
    (r,) = purge.purge(str(tmp_path), older_than_s=None, model="org/a")
    assert r.model == "org/a" and r.removed == 1
    (r,) = purge.purge(str(tmp_path / "other"), older_than_s=None, model="org/b")
    assert r.removed == 1


def test_purge_takes_bounded_time_on_an_idle_store(tmp_path, buffer) -> None:
    store = make_store(str(tmp_path), buffer)
    store_keys(store, buffer, [key(i) for i in range(40)])
    t0 = time.monotonic()
    purge.purge(str(tmp_path), older_than_s=None)
    assert time.monotonic() - t0 < purge.BUSY_RETRY_S
    store.close()


def test_purge_removes_the_temporary_log_of_a_killed_purge(tmp_path, buffer) -> None:
    store = make_store(str(tmp_path), buffer)
    stale = tmp_path / "store" / f"{purge.LOG_NAME}.tmp-12345"
    stale.write_bytes(b"x")
    purge.purge(str(tmp_path), older_than_s=None)
    assert not stale.exists()
    store.close()
