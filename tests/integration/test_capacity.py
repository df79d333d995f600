"""The capacity bound holds under churn; eviction keeps recent chunks."""

from __future__ import annotations

import pytest

from nvmetier.config import parse_size
from tests.integration.helpers import (
    ROW,
    disk_usage_bytes,
    fill_rows,
    key,
    load_keys,
    make_store,
    run,
)

pytestmark = pytest.mark.timeout(120)


def test_disk_usage_stays_within_capacity_under_2x_churn(tmp_path, buffer) -> None:
    capacity = parse_size("8MiB")
    store = make_store(str(tmp_path), buffer, capacity_bytes=capacity, ways=4)
    n_slots = store.sb.n_slots
    assert disk_usage_bytes(str(tmp_path)) <= capacity
    total = 2 * n_slots
    for start in range(0, total, 32):
        keys = [key(i) for i in range(start, min(start + 32, total))]
        rows = list(range(len(keys)))
        fill_rows(buffer, keys, rows)
        store.submit_store(start, keys, rows)
        assert all(o.success for o in run(store))
        assert store.stats()["slots_used"] <= n_slots
        assert disk_usage_bytes(str(tmp_path)) <= capacity
    stats = store.stats()
    assert stats["evictions"] >= total - n_slots
    assert stats["bytes_used"] <= stats["capacity_bytes"] <= capacity
    # The newest chunks of each set survive; whatever is present loads correctly.
    present = [key(i) for i in range(total) if store.contains(key(i))]
    assert len(present) == stats["slots_ready"]
    recent = [key(i) for i in range(total - 32, total)]
    assert sum(store.contains(k) for k in recent) >= 24
    outcome, good = load_keys(store, buffer, present[:60])
    assert outcome.success and len(good) == len(present[:60])
    store.close()


def test_recently_touched_chunk_survives_eviction(tmp_path, buffer) -> None:
    store = make_store(str(tmp_path), buffer, capacity_bytes="4MiB", ways=4)
    hot = key(0)
    fill_rows(buffer, [hot], [0])
    store.submit_store(0, [hot], [0])
    run(store)
    for start in range(1, 4 * store.sb.n_slots, 16):
        keys = [key(i) for i in range(start, start + 16)]
        fill_rows(buffer, keys, list(range(16)))
        store.submit_store(start, keys, list(range(16)))
        run(store)
        store.touch([hot])
    assert store.contains(hot)
    store.close()


def test_capacity_too_small_is_a_config_error(tmp_path, buffer) -> None:
    from nvmetier.errors import ConfigError

    with pytest.raises(ConfigError, match="capacity_bytes"):
        make_store(str(tmp_path), buffer, capacity_bytes=ROW * 2, ways=16)


def test_changed_capacity_is_refused_not_wiped(tmp_path, buffer) -> None:
    from nvmetier.errors import ConfigError

    store = make_store(str(tmp_path), buffer, capacity_bytes="8MiB")
    fill_rows(buffer, [key(1)], [0])
    store.submit_store(1, [key(1)], [0])
    run(store)
    store.close()
    with pytest.raises(ConfigError, match="capacity_bytes"):
        make_store(str(tmp_path), buffer, capacity_bytes="16MiB")
    store = make_store(str(tmp_path), buffer, capacity_bytes="8MiB")
    assert store.contains(key(1))
    store.close()


def test_lookup_hit_is_not_evicted_before_its_load(tmp_path, buffer) -> None:
    store = make_store(str(tmp_path), buffer, capacity_bytes="4MiB", ways=4)
    hot = key(0)
    fill_rows(buffer, [hot], [0])
    store.submit_store(0, [hot], [0])
    run(store)
    assert store.lookup(hot)  # HIT: held until the load is submitted
    for start in range(1, 3 * store.sb.n_slots, 16):
        keys = [key(i) for i in range(start, start + 16)]
        fill_rows(buffer, keys, list(range(1, 17)))
        store.submit_store(start, keys, list(range(1, 17)))
        run(store)
    assert store.contains(hot)
    outcome, good = load_keys(store, buffer, [hot])
    assert outcome.success and good == [hot]
    store.release_holds()
    for start in range(10_000, 10_000 + 3 * store.sb.n_slots, 16):
        keys = [key(i) for i in range(start, start + 16)]
        store.submit_store(start, keys, list(range(16)))
        run(store)
    assert not store.contains(hot)  # no hold left behind
    store.close()


def test_default_ways_shrink_to_fit_a_small_capacity(tmp_path, buffer) -> None:
    from nvmetier.config import TierConfig
    from nvmetier.store import BlockStore
    from tests.integration.helpers import IDENTITY

    cfg = TierConfig.from_dict({"root_dir": str(tmp_path), "capacity_bytes": 6 * ROW})
    store = BlockStore(cfg, store_name="s", identity=IDENTITY, buffer=buffer, row_bytes=ROW)
    assert 1 <= store.sb.ways < 16
    assert store.sb.n_slots == store.sb.ways
    keys = [key(i) for i in range(3)]
    fill_rows(buffer, keys, [0, 1, 2])
    store.submit_store(1, keys, [0, 1, 2])
    assert all(o.success for o in run(store))
    ready = store.stats()["slots_ready"]
    assert ready >= 1
    geometry = (store.sb.ways, store.sb.n_slots)
    store.close()
    # The same configuration reopens the same geometry, warm.
    store = BlockStore(cfg, store_name="s", identity=IDENTITY, buffer=buffer, row_bytes=ROW)
    assert (store.sb.ways, store.sb.n_slots) == geometry
    assert store.stats()["slots_ready"] == ready
    store.close()


def test_explicit_ways_that_do_not_fit_are_refused(tmp_path, buffer) -> None:
    from nvmetier.errors import ConfigError

    with pytest.raises(ConfigError, match="capacity_bytes"):
        make_store(str(tmp_path), buffer, capacity_bytes=6 * ROW, ways=16)
