"""The native job path: one call into the table per job (submit_store /
submit_load hand the ops to the engine) and one per poll (completions applied,
finished jobs out as tuples). Real files, real engines; the wrappers only
refuse or count calls."""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest

from nvmetier import purge
from nvmetier.engine import IoEngine
from nvmetier.engine.base import COMPLETION_DTYPE
from nvmetier.errors import EngineClosedError
from nvmetier.store import BlockStore

from .helpers import ROW, fill_rows, key, load_keys, make_store, payload, run, store_keys


class _Wrapper(IoEngine):
    """Passes everything to the real engine; can refuse submits, counts waits."""

    def __init__(self, inner: IoEngine) -> None:
        self.inner = inner
        self.name = inner.name
        self.refuse = False
        self.waits = 0
        # Hand out one completion per wait (as the thread engine's workers
        # may finish a job's ops across several polls).
        self.trickle = False
        self._held = b""

    def submit(self, ops: Any) -> None:
        self.inner.submit(ops)

    def wait_completions(self, timeout_s: float) -> Any:
        return self.inner.wait_completions(timeout_s)

    def submit_raw(self, ops: bytes) -> None:
        if self.refuse:
            raise EngineClosedError("the I/O engine is closed (test)")
        self.inner.submit_raw(ops)

    def wait_raw(self, timeout_s: float) -> bytes:
        self.waits += 1
        if not self.trickle:
            return self.inner.wait_raw(timeout_s)
        self._held += self.inner.wait_raw(0 if self._held else timeout_s)
        one, self._held = self._held[:COMPLETION_BYTES], self._held[COMPLETION_BYTES:]
        return one

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> dict[str, object]:
        return self.inner.describe()


COMPLETION_BYTES = COMPLETION_DTYPE.itemsize


def _store(root: str, buffer: memoryview, engine: str, **overrides: Any) -> BlockStore:
    return make_store(root, buffer, engine=engine, engine_wrapper=_Wrapper, **overrides)


@pytest.fixture(params=["threads", "uring"])
def engine(request) -> str:
    if request.param == "uring":
        from nvmetier.engine import uring

        ok, why = uring.probe()
        if not ok:
            pytest.skip(f"io_uring unavailable: {why}")
    return str(request.param)


def test_a_store_job_reports_time_bytes_and_its_keys_become_hits(tmp_path, buffer, engine) -> None:
    store = _store(str(tmp_path), buffer, engine)
    try:
        keys = [key(i) for i in range(8)]
        (outcome,) = store_keys(store, buffer, keys, job_id=41)
        assert (outcome.job_id, outcome.is_load, outcome.success) == (41, False, True)
        assert outcome.successful_keys is None
        assert outcome.transfer_bytes == 8 * ROW
        assert outcome.transfer_time_s > 0
        assert all(store.contains(k) for k in keys)
        assert store.stats()["ops_outstanding"] == 0
        assert not store.has_pending_work()
    finally:
        store.close()


def test_an_empty_poll_does_not_call_the_engine(tmp_path, buffer, engine) -> None:
    store = _store(str(tmp_path), buffer, engine)
    try:
        store_keys(store, buffer, [key(1)])
        wrapper = store.engine
        assert isinstance(wrapper, _Wrapper)
        before = wrapper.waits
        for _ in range(100):
            assert not store.poll_raw()()
        assert wrapper.waits == before
    finally:
        store.close()


def test_a_refused_submit_fails_the_job_and_frees_its_slots(
    tmp_path, buffer, engine, caplog
) -> None:
    store = _store(str(tmp_path), buffer, engine)
    try:
        wrapper = store.engine
        assert isinstance(wrapper, _Wrapper)
        keys = [key(i) for i in range(4)]
        fill_rows(buffer, keys, range(4))
        wrapper.refuse = True
        with caplog.at_level(logging.WARNING, logger="nvmetier.store"):
            store.submit_store(7, keys, list(range(4)))
            (outcome,) = store.poll()
        assert (outcome.job_id, outcome.success, outcome.successful_keys) == (7, False, [])
        messages = " ".join(r.getMessage() for r in caplog.records)
        assert "could not be submitted" in messages and "closed (test)" in messages
        assert "canceled" in messages.lower()
        # Nothing stays WRITING: the same keys store fine once the engine takes ops.
        stats = store.stats()
        assert (stats["slots_used"], stats["ops_outstanding"], stats["jobs_in_flight"]) == (0, 0, 0)
        assert stats["store_jobs_failed"] == 1
        wrapper.refuse = False
        (again,) = store_keys(store, buffer, keys, job_id=8)
        assert again.success
        outcome, good = load_keys(store, buffer, keys, job_id=9)
        assert outcome.success and good == keys
    finally:
        store.close()


def test_a_refused_load_fails_the_job_and_leaves_its_keys_ready(
    tmp_path, buffer, engine, caplog
) -> None:
    """An op the engine refused (-ECANCELED) was never read: its slot stays
    READY for every sharer. Was a bug: it was marked BAD like a read error."""
    store = _store(str(tmp_path), buffer, engine)
    try:
        wrapper = store.engine
        assert isinstance(wrapper, _Wrapper)
        keys = [key(i) for i in range(4)]
        store_keys(store, buffer, keys)
        wrapper.refuse = True
        with caplog.at_level(logging.WARNING, logger="nvmetier.store"):
            store.submit_load(7, keys, list(range(4)))
            (outcome,) = store.poll()
        assert (outcome.job_id, outcome.success, outcome.successful_keys) == (7, False, [])
        stats = store.stats()
        assert stats["read_errors"] == 0 and stats["loads_cancelled"] == 4
        assert stats["slots_ready"] == 4
        assert all(store.contains(k) for k in keys)
        wrapper.refuse = False
        outcome, good = load_keys(store, buffer, keys, job_id=8)
        assert outcome.success and good == keys
    finally:
        store.close()


def test_missing_keys_fail_a_load_quietly_with_exact_successful_keys(
    tmp_path, buffer, engine, caplog
) -> None:
    store = _store(str(tmp_path), buffer, engine)
    try:
        present = [key(i) for i in range(0, 8, 2)]
        store_keys(store, buffer, present)
        asked = [key(i) for i in range(8)]
        with caplog.at_level(logging.WARNING, logger="nvmetier.store"):
            store.submit_load(3, asked, list(range(8)))
            (outcome,) = run(store)
        assert outcome.is_load and not outcome.success
        assert outcome.successful_keys == present  # in the job's order
        assert outcome.transfer_bytes == len(present) * ROW
        for i, k in enumerate(asked):
            if k in present:
                assert bytes(buffer[i * ROW : (i + 1) * ROW]) == payload(k)
        assert not caplog.records  # a miss is not a fault
        assert store.stats()["load_jobs_failed"] == 1
    finally:
        store.close()


def test_a_bad_row_fails_only_its_key_and_is_logged(tmp_path, buffer, engine, caplog) -> None:
    store = _store(str(tmp_path), buffer, engine)
    try:
        keys = [key(i) for i in range(3)]
        fill_rows(buffer, keys[:2], [0, 1])
        with caplog.at_level(logging.WARNING, logger="nvmetier.store"):
            store.submit_store(5, keys, [0, 1, 1 << 30])
            (outcome,) = run(store)
        assert not outcome.success and outcome.successful_keys == keys[:2]
        assert "bad key length or row" in " ".join(r.getMessage() for r in caplog.records)
        assert store.contains(keys[0]) and store.contains(keys[1]) and not store.contains(keys[2])
    finally:
        store.close()


def test_kv_events_of_the_job_path(tmp_path, buffer, engine) -> None:
    store = _store(str(tmp_path), buffer, engine, enable_kv_events=True)
    try:
        keys = [key(i) for i in range(5)]
        store_keys(store, buffer, keys)
        events = store.take_events()  # one entry per store job
        assert {removed for removed, _ in events} == {False}
        assert sorted(k for _, ks in events for k in ks) == sorted(keys)
        assert store.take_events() == []
        assert store.invalidate(keys[0])
        assert store.take_events() == [(True, [keys[0]])]
    finally:
        store.close()


def test_a_store_job_whose_ops_complete_across_polls_emits_one_stored_event(
    tmp_path, buffer, engine
) -> None:
    # vLLM's tiers emit one stored event per job; a router counts each one.
    store = _store(str(tmp_path), buffer, engine, enable_kv_events=True)
    try:
        store.engine.trickle = True  # type: ignore[attr-defined]
        keys = [key(i) for i in range(4)]
        fill_rows(buffer, keys, range(4))
        store.submit_store(1, keys, list(range(4)))
        (outcome,) = run(store)
        assert outcome.success
        events = store.take_events()
        assert len(events) == 1
        ((removed, got),) = events
        assert not removed and sorted(got) == sorted(keys)
    finally:
        store.close()


def test_two_store_jobs_emit_one_stored_event_each(tmp_path, buffer, engine) -> None:
    store = _store(str(tmp_path), buffer, engine, enable_kv_events=True)
    try:
        first, second = [key(i) for i in range(3)], [key(i) for i in range(3, 5)]
        fill_rows(buffer, first + second, range(5))
        store.submit_store(1, first, [0, 1, 2])
        store.submit_store(2, second, [3, 4])
        run(store)
        events = store.take_events()
        assert sorted(sorted(ks) for _, ks in events) == sorted([sorted(first), sorted(second)])
        assert not any(removed for removed, _ in events)
    finally:
        store.close()


def _replay(events: list[tuple[bool, list[bytes]]]) -> set[bytes]:
    """What a router that applies the events in order believes is stored."""
    held: set[bytes] = set()
    for removed, keys in events:
        if removed:
            held.difference_update(keys)
        else:
            held.update(keys)
    return held


@pytest.mark.parametrize("sealed", [False, True], ids=["plaintext", "sealed"])
def test_a_key_evicted_before_its_job_finishes_is_announced_stored_then_removed(
    tmp_path, buffer, engine, sealed
) -> None:
    # One set of 2 ways. Job 1 writes a0 and a1; one write completes and
    # job 2's submit evicts that key while job 1 still waits for the other.
    # Job 1's one stored event must come before that removal (a removal first
    # left routers a stale entry, and a sealed store, which forgets a key's
    # MAC at its removal, could no longer name it: a key missing from events).
    overrides: dict[str, Any] = {"capacity_bytes": "256KiB", "ways": 2}  # one set
    if sealed:
        pytest.importorskip("nvmetier._crypto")
        key_path = tmp_path / "key"
        key_path.write_bytes(os.urandom(32))
        key_path.chmod(0o600)
        overrides["encryption"] = {"key_file": str(key_path)}
    store = _store(str(tmp_path / "kv"), buffer, engine, enable_kv_events=True, **overrides)
    try:
        assert store.sb.n_slots == 2
        store.engine.trickle = True  # type: ignore[attr-defined]
        first, second = [key(0), key(1)], [key(2)]
        fill_rows(buffer, first + second, range(3))
        store.submit_store(1, first, [0, 1])
        store.wait_completions(30.0)  # one of job 1's writes applied, the other held
        (written,) = [k for k in first if store.contains(k)]
        store.submit_store(2, second, [2])  # evicts `written`: the only READY way
        assert not store.contains(written)
        outcomes = run(store)
        assert sorted((o.job_id, o.success) for o in outcomes) == [(1, True), (2, True)]
        events = store.take_events()
        stored = [ks for removed, ks in events if not removed]
        assert sorted(map(sorted, stored)) == [sorted(first), second]  # one per job
        assert [k for removed, ks in events if removed for k in ks] == [written]
        assert sum(map(len, stored)) == store.stats()["ops_written"] == 3
        held = {k for k in first + second if store.contains(k)}
        assert held == set(first + second) - {written}
        assert _replay(events) == held
    finally:
        store.close()


def test_a_purge_during_a_store_job_is_announced_after_its_stored_event(
    tmp_path, buffer, engine
) -> None:
    # The purge log's removals are queued behind the job's still-open event
    # (a removal handed out before the stored event left routers a stale key).
    store = _store(str(tmp_path), buffer, engine, enable_kv_events=True)
    try:
        store.engine.trickle = True  # type: ignore[attr-defined]
        keys = [key(0), key(1)]
        fill_rows(buffer, keys, range(2))
        store.submit_store(1, keys, [0, 1])
        store.wait_completions(30.0)  # one write applied, the other held
        (written,) = [k for k in keys if store.contains(k)]
        (r,) = purge.purge(str(tmp_path), older_than_s=None)
        assert r.removed == 1
        assert store.take_events() == []  # job 1's event is still open
        run(store)  # the held write lands in a purged slot: dropped
        events = store.take_events()
        assert events == [(False, [written]), (True, [written])]
        assert _replay(events) == {k for k in keys if store.contains(k)} == set()
    finally:
        store.close()


def test_admission_skips_keys_not_looked_up_enough_and_they_still_succeed(
    tmp_path, buffer, engine
) -> None:
    store = _store(str(tmp_path), buffer, engine, admit_after_lookups=2)
    try:
        keys = [key(i) for i in range(4)]
        for k in keys[:2]:
            assert not store.lookup(k)
            assert not store.lookup(k)
        (outcome,) = store_keys(store, buffer, keys)
        assert outcome.success and outcome.successful_keys is None
        assert [store.contains(k) for k in keys] == [True, True, False, False]
        assert store.stats()["stores_not_admitted"] == 2
    finally:
        store.close()


@pytest.mark.parametrize("kind", ["store", "load"])
def test_the_io_uring_engines_native_submit_refusal_fails_the_job(
    tmp_path, buffer, kind, caplog
) -> None:
    # The table submits through the io_uring engine's native submit_raw (no
    # Python frame), which answers False once the engine's close began: the
    # job fails with the reason, no slot stays WRITING or leased, and a
    # stored key stays READY on disk.
    from nvmetier.engine import uring

    ok, why = uring.probe()
    if not ok:
        pytest.skip(f"io_uring unavailable: {why}")
    store = make_store(str(tmp_path), buffer, engine="uring")
    try:
        keys = [key(i) for i in range(4)]
        if kind == "load":
            store_keys(store, buffer, keys)
        fill_rows(buffer, keys, range(4))
        store.engine.close()  # what a shutdown's close does first
        with caplog.at_level(logging.WARNING, logger="nvmetier.store"):
            if kind == "store":
                store.submit_store(7, keys, list(range(4)))
            else:
                store.submit_load(7, keys, list(range(4)))
            (outcome,) = store.poll()
        assert (outcome.job_id, outcome.success, outcome.successful_keys) == (7, False, [])
        messages = " ".join(r.getMessage() for r in caplog.records)
        assert "could not be submitted" in messages and "engine is closed" in messages
        stats = store.stats()
        assert (stats["ops_outstanding"], stats["jobs_in_flight"]) == (0, 0)
        assert stats["slots_used"] == (4 if kind == "load" else 0)
        assert all(store.contains(k) for k in keys) is (kind == "load")
    finally:
        store.close()
