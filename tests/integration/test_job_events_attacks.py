"""Attacks on the KV events of the job path (one stored event per store job,
placed at its submit, handed out once its ops are done; purge removals queued
into the table): programs that try to make a replay of the events differ from
what the store holds, or lose, duplicate or hold back an event."""

from __future__ import annotations

import mmap
import os
import random
import struct
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from nvmetier import _table  # type: ignore[attr-defined]  # a C extension
from nvmetier.purge import purge
from nvmetier.store import BlockStore

from .helpers import fill_rows, key, run
from .test_job_path import _replay, _store


@pytest.fixture(params=["threads", "uring"])
def engine(request) -> str:
    if request.param == "uring":
        from nvmetier.engine import uring

        ok, why = uring.probe()
        if not ok:
            pytest.skip(f"io_uring unavailable: {why}")
    return str(request.param)


def _sealed(tmp_path: Any) -> dict[str, Any]:
    pytest.importorskip("nvmetier._crypto")
    key_path = tmp_path / "key"
    key_path.write_bytes(os.urandom(32))
    key_path.chmod(0o600)
    return {"encryption": {"key_file": str(key_path)}}


def _held(store: BlockStore, keys: list[bytes]) -> set[bytes]:
    return {k for k in keys if store.contains(k)}


@pytest.mark.parametrize("sealed", [False, True], ids=["plaintext", "sealed"])
def test_a_key_removed_and_stored_again_before_a_take_is_announced_again(
    tmp_path, buffer, engine, sealed
) -> None:
    # stored, removed, stored again, all before one take_events: the replay
    # must end with the key held (a sealed store forgot the key's MAC at the
    # removal, though the second submit had just remembered it).
    overrides = _sealed(tmp_path) if sealed else {}
    store = _store(str(tmp_path / "kv"), buffer, engine, enable_kv_events=True, **overrides)
    try:
        k = key(7)
        fill_rows(buffer, [k], [0])
        store.submit_store(1, [k], [0])
        run(store)
        assert store.invalidate(k)
        store.submit_store(2, [k], [0])
        run(store)
        events = store.take_events()
        assert events == [(False, [k]), (True, [k]), (False, [k])]
        assert _replay(events) == _held(store, [k]) == {k}
    finally:
        store.close()


@pytest.mark.parametrize("sealed", [False, True], ids=["plaintext", "sealed"])
def test_a_key_purged_then_stored_again_before_a_take_is_held_in_the_replay(
    tmp_path, buffer, engine, sealed
) -> None:
    # The purge happened before the second store's submit, but its removal is
    # read from the purge log at the next take_events, after that job's event:
    # the key is announced stored again after its removal.
    overrides = _sealed(tmp_path) if sealed else {}
    root = tmp_path / "kv"
    store = _store(str(root), buffer, engine, enable_kv_events=True, **overrides)
    try:
        k = key(3)
        fill_rows(buffer, [k], [0])
        store.submit_store(1, [k], [0])
        run(store)
        (r,) = purge(str(root), older_than_s=None)
        assert r.removed == 1
        assert not store.contains(k)
        store.submit_store(2, [k], [0])
        run(store)
        events = store.take_events()
        assert _replay(events) == _held(store, [k]) == {k}
    finally:
        store.close()


def _held_writes_store(root: Any, buffer: Any, engine: str, sealed: dict[str, Any]):
    """A store whose writes can be held in flight (``HeldOps``), events on."""
    from nvmetier.engine.base import OP_WRITE

    from .helpers import HeldOps, make_store

    held: list[HeldOps] = []

    def wrap(inner: Any) -> Any:
        held.append(HeldOps(inner, OP_WRITE))
        return held[0]

    store = make_store(
        str(root), buffer, engine=engine, engine_wrapper=wrap, enable_kv_events=True, **sealed
    )
    return store, held[0]


@pytest.mark.parametrize("sealed", [False, True], ids=["plaintext", "sealed"])
def test_a_purged_key_being_written_again_when_the_purge_is_taken_ends_held(
    tmp_path, buffer, engine, sealed
) -> None:
    # The purge's removal is taken while the key's new write is in flight:
    # the removal waits for the write to end, then goes out with the key
    # announced stored again; a replay at each take never ends with a key
    # the store does not hold once its writes are done.
    overrides = _sealed(tmp_path) if sealed else {}
    root = tmp_path / "kv"
    store, ops = _held_writes_store(root, buffer, engine, overrides)
    try:
        k, other = key(5), key(6)
        fill_rows(buffer, [k, other], [0, 1])
        store.submit_store(1, [k, other], [0, 1])
        run(store)
        (r,) = purge(str(root), older_than_s=None)
        assert r.removed == 2
        ops.hold = True
        store.submit_store(2, [k], [0])
        assert ops.held() == 1
        first = store.take_events()
        # `other`'s removal is queued now, behind job 2's open event (nothing
        # is handed out past an open one); k's waits for its write to end.
        assert not any(removed for removed, _keys in first)
        assert store.stats()["purge_removals_emitted"] == 1
        ops.release()
        run(store)
        events = first + store.take_events()
        assert _replay(events) == _held(store, [k, other]) == {k}
        assert store.stats()["purge_removals_emitted"] == 2
        assert store.take_events() == []  # nothing held back, nothing twice
    finally:
        store.close()


@pytest.mark.parametrize("sealed", [False, True], ids=["plaintext", "sealed"])
def test_a_purged_key_whose_new_write_fails_ends_removed(tmp_path, buffer, engine, sealed) -> None:
    # As above, but a second purge fails the new write while it is in
    # flight: the first purge's removal goes out alone, and the replay ends
    # without the key, as the store.
    overrides = _sealed(tmp_path) if sealed else {}
    root = tmp_path / "kv"
    store, ops = _held_writes_store(root, buffer, engine, overrides)
    try:
        k = key(8)
        fill_rows(buffer, [k], [0])
        store.submit_store(1, [k], [0])
        run(store)
        purge(str(root), older_than_s=None)
        ops.hold = True
        store.submit_store(2, [k], [0])
        first = store.take_events()
        (r,) = purge(str(root), older_than_s=None)  # marks the write in flight
        assert r.writing_marked == 1
        ops.release()
        (outcome,) = run(store)
        assert not outcome.success
        events = first + store.take_events()
        assert _replay(events) == _held(store, [k]) == set()
        assert sum(k in ks for removed, ks in events if removed) == 1
    finally:
        store.close()


def test_a_refused_submit_holds_back_no_later_event(tmp_path, buffer, engine) -> None:
    # The refused job's event was placed at its submit: it must be closed
    # (empty, left out) or the events of every later job wait for good.
    store = _store(str(tmp_path), buffer, engine, enable_kv_events=True)
    try:
        keys = [key(0), key(1), key(2)]
        fill_rows(buffer, keys, range(3))
        store.engine.refuse = True  # type: ignore[attr-defined]
        store.submit_store(1, keys[:2], [0, 1])
        store.engine.refuse = False  # type: ignore[attr-defined]
        store.submit_store(2, keys[2:], [2])
        outcomes = run(store)
        assert sorted((o.job_id, o.success) for o in outcomes) == [(1, False), (2, True)]
        assert store.take_events() == [(False, [keys[2]])]
        assert _held(store, keys) == {keys[2]}
    finally:
        store.close()


# ----------------------------------------------------------- the native table
# A table of one process (and a second sharer that only holds sets), bound to
# a manual engine: no disk, no threads.
ROW_BYTES = 4096


class _Engine:
    """Completes a random part of what it was given at each wait, in a random
    order; a write fails (EIO) with probability ``write_fail``."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.pending: list[bytes] = []
        self.write_fail = 0.0

    def submit_raw(self, ops: bytes) -> None:
        for i in range(len(ops) // _table.OP_BYTES):
            (op_id,) = struct.unpack_from("<Q", ops, i * _table.OP_BYTES)
            result = -5 if self.rng.random() < self.write_fail else ROW_BYTES
            self.pending.append(struct.pack("<QqQ", op_id, result, 7))

    def wait_raw(self, _timeout: float) -> bytes:
        self.rng.shuffle(self.pending)
        n = self.rng.randint(0, len(self.pending))
        out = b"".join(self.pending[:n])
        del self.pending[:n]
        return out


@pytest.fixture
def tables() -> Iterator[Any]:
    made: list[Any] = []

    def make(n_slots: int, ways: int, rng: random.Random) -> tuple[Any, Any, _Engine]:
        table_map = mmap.mmap(-1, _table.table_bytes(n_slots, ways))
        index_map = mmap.mmap(-1, n_slots * 128)
        _table.format(table_map, n_slots, ways)
        fd, path = tempfile.mkstemp(prefix="nvt-ev-", suffix=".lock")
        other_fd = os.open(path, os.O_RDWR)
        os.unlink(path)
        table, other = (
            _table.Table(
                table_map,
                index_map,
                lock_fd,
                n_paths=1,
                slot_bytes=ROW_BYTES,
                row_bytes=ROW_BYTES,
                n_rows=64,
                lease_ns=10**6,
                watch_timeout_ns=2 * 10**6,
            )
            for lock_fd in (fd, other_fd)
        )
        table.attach()
        other.attach()
        eng = _Engine(rng)
        table.bind(eng.submit_raw, eng.wait_raw, 1000, True, True)
        made.append((table, other, fd, other_fd))
        return table, other, eng

    _table._fail_allocs(-1, 0)
    yield make
    _table._fail_allocs(-1, 0)
    for table, other, fd, other_fd in made:
        del table, other
        os.close(fd)
        os.close(other_fd)


def _apply(events: list[tuple[bool, list[bytes]]], held: set[bytes]) -> set[bytes]:
    """Replay ``events`` onto ``held`` strictly: never an empty event, a
    removal of a key not announced, or a key announced twice in a row."""
    held = set(held)
    for removed, keys in events:
        assert keys, "an empty event"
        for k in keys:
            if removed:
                assert k in held, f"removal of {k!r} before its stored event"
                held.discard(k)
            else:
                assert k not in held, f"{k!r} announced stored twice"
                held.add(k)
    return held


def _drain(table: Any) -> None:
    for _ in range(2000):
        table.poll()
        if table.inflight() == (0, 0):
            break
    assert table.inflight() == (0, 0)
    for _ in range(20):  # an abandoned op's late write
        table.collect(0.0)


def test_an_allocation_failure_at_a_submit_that_evicts_still_announces_its_evictions(
    tables,
) -> None:
    # One set of 4 ways: job 2 evicts job 1's keys one by one; an allocation
    # failing after some evictions failed the submit, its unwinding freed the
    # evicted slots, and their removals were never pushed (nor counted lost):
    # routers kept keys the store no longer held.
    first, second = [b"a%d" % i for i in range(4)], [b"b%d" % i for i in range(4)]

    def scenario(table: Any) -> list[tuple[bool, list[bytes]]]:
        events = []
        for job_id, keys in ((1, first), (2, second)):
            try:
                table.submit_store(job_id, keys, list(range(4)))
            except MemoryError:
                pass
            try:
                table.poll()
                events += table.take_events()
            except MemoryError:
                pass
        return events

    table, _other, _eng = tables(4, 4, random.Random(0))
    scenario(table)
    points = _table._fail_allocs(-1, 0)
    assert points > 10
    for count in (1, 10**9):
        for after in range(points):
            table, _other, _eng = tables(4, 4, random.Random(0))
            _table._fail_allocs(after, count)
            events = scenario(table)
            _table._fail_allocs(-1, 0)
            _drain(table)
            events += table.take_events()
            held = {k for k in first + second if table.contains(k)}
            lost = table.counters()["kv_events_lost"]
            replay: set[bytes] = set()
            for removed, keys in events:
                (replay.difference_update if removed else replay.update)(keys)
            assert lost or replay == held, (count, after, events, held)


@pytest.mark.parametrize("seed", range(40))
def test_random_jobs_invalidations_and_held_sets_replay_to_the_table(tables, seed) -> None:
    # Stores (some writes failing), loads, invalidations, a sharer holding
    # sets (completions deferred, then abandoned past the watch timeout, their
    # late writes announced on their own), takes at random points; an engine
    # that completes a random part of its ops in a random order. Loads never
    # fail (a read error leaves its slot BAD: a miss with no removal event).
    rng = random.Random(seed)
    table, other, eng = tables(8, 2, rng)
    eng.write_fail = rng.choice([0.0, 0.0, 0.1])
    universe = [b"k%d" % i for i in range(24)]
    replay: set[bytes] = set()
    held_sets: list[int] = []
    job_id = 0
    for _ in range(rng.randint(5, 60)):
        a = rng.random()
        if a < 0.45:
            job_id += 1
            keys = rng.sample(universe, rng.randint(1, 5))
            if a < 0.35:
                table.submit_store(job_id, keys, list(range(len(keys))))
            else:
                write_fail, eng.write_fail = eng.write_fail, 0.0
                table.submit_load(job_id, keys, list(range(len(keys))))
                eng.write_fail = write_fail
        elif a < 0.7:
            table.poll()
        elif a < 0.8:
            table.invalidate(rng.choice(universe))
        elif a < 0.85:
            s = rng.randrange(4)
            if other._hold_set(s):
                held_sets.append(s)
        elif a < 0.9:
            for s in held_sets:
                other._release_set(s)
            held_sets.clear()
        else:
            replay = _apply(table.take_events(), replay)
    for s in held_sets:
        other._release_set(s)
    _drain(table)
    replay = _apply(table.take_events(), replay)
    assert table.counters()["kv_events_lost"] == 0
    assert replay == {k for k in universe if table.contains(k)}


# ------------------------------------------------- review attacks (purgerev)
@pytest.mark.parametrize("when", ["before_read", "after_read"])
def test_a_purge_racing_the_take_of_the_previous_one_loses_no_removal(
    tmp_path, buffer, engine, monkeypatch, when
) -> None:
    # A second purge lands while a take_events is taking the first one,
    # just before or just after it reads the log. Claimed before the read
    # (as it was), the second purge saw its predecessor taken and replaced
    # the log with its own keys only: the first purge's removals were never
    # emitted and a router kept a key the store no longer held.
    from nvmetier import purge_log

    root = tmp_path / "kv"
    store = _store(str(root), buffer, engine, enable_kv_events=True)
    try:
        a, b = key(11), key(12)
        fill_rows(buffer, [a], [0])
        store.submit_store(1, [a], [0])
        run(store)
        events = store.take_events()
        (r,) = purge(str(root), older_than_s=None)  # purge 1 removes a
        assert r.removed == 1
        fill_rows(buffer, [b], [1])
        store.submit_store(2, [b], [1])
        run(store)
        real = purge_log.read_log
        calls: list[Any] = []

        def racing(store_dir: str) -> tuple[int, int, list[bytes]]:
            if calls:
                return real(store_dir)
            if when == "before_read":
                calls.append(purge(str(root), older_than_s=None))
                return real(store_dir)
            got = real(store_dir)
            calls.append(purge(str(root), older_than_s=None))
            return got

        monkeypatch.setattr(purge_log, "read_log", racing)
        events += store.take_events()
        monkeypatch.setattr(purge_log, "read_log", real)
        events += store.take_events()
        assert calls and calls[0][0].removed == 1  # purge 2 removed b
        assert _held(store, [a, b]) == set()
        assert _replay(events) == set(), events
        assert store.stats()["kv_events_lost"] == 0
        assert store.take_events() == []
    finally:
        store.close()


def test_two_purges_of_a_key_stored_again_each_time_announce_it_once_per_event(
    tmp_path, buffer, engine
) -> None:
    # stored, purged, stored again, purged again, stored again, one take: the
    # second purge merged the first's untaken log (the key twice); the key,
    # held again, must not be named twice in one event (a router counting
    # each hash of a BlockStored would count it twice).
    root = tmp_path / "kv"
    store = _store(str(root), buffer, engine, enable_kv_events=True)
    try:
        k = key(21)
        fill_rows(buffer, [k], [0])
        store.submit_store(1, [k], [0])
        run(store)
        events = store.take_events()
        for job_id in (2, 3):
            (r,) = purge(str(root), older_than_s=None)
            assert r.removed == 1
            store.submit_store(job_id, [k], [0])
            run(store)
        events += store.take_events()
        assert _replay(events) == _held(store, [k]) == {k}
        for _removed, keys in events:
            assert len(keys) == len(set(keys)), events
        assert store.take_events() == []
    finally:
        store.close()
