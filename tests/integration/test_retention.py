"""Retention on real files: a chunk stored longer ago than ``retention`` is
never served, counted, reported removed, and its slot is reused first.

The wall clock of record stamps is moved with the table's test hook
(``_set_wall_clock_offset_ns``) instead of sleeping."""

from __future__ import annotations

from collections.abc import Iterator

import nvmetier._table as _table
import pytest

from tests.integration.helpers import key, load_keys, make_store, store_keys

pytestmark = pytest.mark.timeout(120)

S = 1_000_000_000


@pytest.fixture(autouse=True)
def wall_clock() -> Iterator[None]:
    yield
    _table._set_wall_clock_offset_ns(0)


def age(seconds: float) -> None:
    _table._set_wall_clock_offset_ns(int(seconds * S))


def test_chunk_within_retention_is_served(tmp_path, buffer) -> None:
    store = make_store(str(tmp_path), buffer, retention="100s")
    keys = [key(i) for i in range(8)]
    store_keys(store, buffer, keys)
    age(90)
    outcome, good = load_keys(store, buffer, keys)
    assert outcome.success and good == keys
    assert store.stats()["retention_expired"] == 0
    store.close()


def test_chunk_past_retention_is_a_counted_miss_and_freed(tmp_path, buffer) -> None:
    store = make_store(str(tmp_path), buffer, retention="100s", enable_kv_events=True)
    keys = [key(i) for i in range(8)]
    store_keys(store, buffer, keys)
    store.take_events()
    used = store.stats()["slots_used"]
    age(101)
    assert not any(store.lookup(k) for k in keys)
    stats = store.stats()
    assert stats["retention_expired"] == 8
    assert stats["slots_used"] == used - 8
    assert store.take_events() == [(True, keys)]
    outcome, good = load_keys(store, buffer, keys)
    assert not outcome.success and good == []
    store.close()


def test_load_of_an_expired_chunk_fails_even_after_a_hit(tmp_path, buffer) -> None:
    store = make_store(str(tmp_path), buffer, retention="100s")
    keys = [key(i) for i in range(4)]
    store_keys(store, buffer, keys)
    assert all(store.lookup(k) for k in keys)  # leased by the hit
    age(200)
    outcome, good = load_keys(store, buffer, keys)
    assert not outcome.success and outcome.successful_keys == [] and good == []
    assert store.stats()["retention_expired"] >= 4
    store.close()


def test_expired_key_is_stored_again(tmp_path, buffer) -> None:
    store = make_store(str(tmp_path), buffer, retention="100s")
    keys = [key(i) for i in range(8)]
    store_keys(store, buffer, keys)
    age(150)
    (outcome,) = store_keys(store, buffer, keys, job_id=7)
    assert outcome.success
    assert store.stats()["stores_skipped_present"] == 0
    outcome, good = load_keys(store, buffer, keys)
    assert outcome.success and good == keys
    store.close()


def test_expired_slots_are_evicted_before_older_unexpired_ones(tmp_path, buffer) -> None:
    # One set of 16 ways. A stored at t0, B at t0+30 s, A touched at t0+40 s:
    # B is the least recently used. At t0+120 s A is past its 100 s, B not:
    # new stores take A's slots.
    store = make_store(str(tmp_path), buffer, retention="100s", ways=16, capacity_bytes="1200KiB")
    assert store.sb.n_slots == 16
    a = [key(i) for i in range(8)]
    b = [key(100 + i) for i in range(8)]
    c = [key(200 + i) for i in range(8)]
    store_keys(store, buffer, a)
    age(30)
    store_keys(store, buffer, b, job_id=3)
    age(40)
    store.touch(a)
    age(120)
    (outcome,) = store_keys(store, buffer, c, job_id=4)
    assert outcome.success
    assert all(store.contains(k) for k in b + c)
    assert not any(store.contains(k) for k in a)
    store.close()


def test_without_retention_lru_evicts_instead(tmp_path, buffer) -> None:
    # The same sequence with no retention: B (least recently used) goes.
    store = make_store(str(tmp_path), buffer, ways=16, capacity_bytes="1200KiB")
    a = [key(i) for i in range(8)]
    b = [key(100 + i) for i in range(8)]
    c = [key(200 + i) for i in range(8)]
    store_keys(store, buffer, a)
    store_keys(store, buffer, b, job_id=3)
    store.touch(a)
    age(10**6)
    store_keys(store, buffer, c, job_id=4)
    assert all(store.contains(k) for k in a + c)
    assert not any(store.contains(k) for k in b)
    store.close()


def test_retention_applies_to_chunks_of_a_previous_run(tmp_path, buffer) -> None:
    keys = [key(i) for i in range(8)]
    store = make_store(str(tmp_path), buffer)
    store_keys(store, buffer, keys)
    store.close()
    age(3600)
    store = make_store(str(tmp_path), buffer, retention="1h")  # one hour and a bit: expired
    assert store.stats()["slots_ready"] == 8  # rebuilt from the records, never served
    assert not any(store.contains(k) for k in keys)
    assert store.stats()["retention_expired"] == 8
    store.close()


def test_stamp_far_in_the_future_is_not_trusted(tmp_path, buffer) -> None:
    # A record stamped 2 h ahead of the clock (the clock stepped back, or
    # another machine's clock): its age is unknown, so it is not served.
    store = make_store(str(tmp_path), buffer, retention="1h")
    keys = [key(i) for i in range(4)]
    age(2 * 3600)
    store_keys(store, buffer, keys)
    age(0)
    assert not any(store.contains(k) for k in keys)
    store.close()


def test_stamp_slightly_in_the_future_is_served(tmp_path, buffer) -> None:
    store = make_store(str(tmp_path), buffer, retention="1h")
    keys = [key(i) for i in range(4)]
    age(60)
    store_keys(store, buffer, keys)
    age(0)  # the clock stepped back a minute: within the retention
    assert all(store.contains(k) for k in keys)
    store.close()
