"""Production features through the orchestrator: events, metrics, plugin,
data-parallel replicas, ephemeral stores, several drives."""

from __future__ import annotations

import os

import pytest
from vllm.v1.kv_offload.base import LookupResult, Medium

from nvmetier.vllm import METRIC_PREFIX, NvmeTierManager
from nvmetier.vllm.harness import key_of
from tests.vllm.conftest import nvme_tier

pytestmark = pytest.mark.timeout(180)


def _tier_events(eng):
    return [e for e in eng.manager.take_events() if e.medium is Medium.STORAGE]


def test_events_report_stored_keys(tmp_path, make_engine) -> None:
    eng = make_engine(
        [nvme_tier(str(tmp_path / "kv"), enable_kv_events=True)], enable_kv_cache_events=True
    )
    keys = [key_of(i) for i in range(5)]
    eng.store_all(keys)
    events = _tier_events(eng)
    stored = [k for e in events if not e.removed for k in e.keys]
    assert sorted(stored) == sorted(keys)


def test_events_report_evicted_keys(tmp_path, make_engine) -> None:
    eng = make_engine(
        [nvme_tier(str(tmp_path / "kv"), capacity_bytes="2MiB", ways=2, enable_kv_events=True)],
        enable_kv_cache_events=True,
    )
    n_slots = eng.tiers[0].store.sb.n_slots
    keys = [key_of(i) for i in range(3 * n_slots)]
    eng.store_all(keys)
    events = _tier_events(eng)
    stored = [k for e in events if not e.removed for k in e.keys]
    removed = [k for e in events if e.removed for k in e.keys]
    assert len(stored) == eng.tiers[0].store.stats()["ops_written"] > n_slots
    assert len(removed) == eng.tiers[0].store.stats()["evictions"] > 0
    # Exactly what the disk holds: stored minus removed.
    holds = {k for k in keys if eng.tiers[0].store.contains(k)}
    assert holds == set(stored) - set(removed)


def test_events_stay_off_when_kv_events_are_disabled_globally(tmp_path, make_engine) -> None:
    eng = make_engine([nvme_tier(str(tmp_path / "kv"), enable_kv_events=True)])
    eng.store_all([key_of(1)])
    assert _tier_events(eng) == []


def test_metrics_count_a_known_workload(make_engine) -> None:
    eng = make_engine()
    defs = NvmeTierManager.build_metric_definitions({})
    assert METRIC_PREFIX + "checksum_failures" in defs
    keys = [key_of(i) for i in range(10)]
    eng.store_all(keys)
    eng.reset_primary()
    # No key positions: the guard's budget path asks the disk about every key,
    # so the absent one counts as a disk miss (with positions the plan knows it
    # is nowhere and withholds it without asking).
    eng.promote([*keys[:4], key_of(999)], positions=False)
    eng.wait_idle()
    tier = eng.tiers[0]
    stats = tier.get_stats()
    values = stats.reduce()

    def series(name: str) -> str:
        return f"{METRIC_PREFIX}{name}:{(tier.tier_label,)}"

    assert values[series("ops_written")] == 10
    assert values[series("bytes_written")] == 10 * 65536
    assert values[series("ops_read")] == 4
    assert values[series("hits")] == 4
    assert values[series("misses")] >= 1
    assert values[series("slots_used")] == 10
    assert values[series("bytes_in_flight")] == 0
    # Counters are deltas: a second report without work adds nothing.
    again = tier.get_stats().reduce()
    assert again.get(series("ops_written"), 0) == 0


def test_plugin_registers_the_short_type_name(tmp_path, make_engine) -> None:
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "nvmetier"]
    ep.load()()
    ep.load()()  # idempotent
    tier = {"type": "nvme", "root_dir": str(tmp_path / "kv"), "capacity_bytes": "16MiB"}
    eng = make_engine([tier])
    assert isinstance(eng.tiers[0], NvmeTierManager)
    eng.store_all([key_of(1)])
    eng.reset_primary()
    assert eng.promote([key_of(1)]) == {key_of(1): LookupResult.HIT}


def test_data_parallel_replicas_share_one_store_by_default(tmp_path, make_engine) -> None:
    root = str(tmp_path / "kv")
    a = make_engine([nvme_tier(root)], dp_index=0, dp_size=2)
    b = make_engine([nvme_tier(root)], dp_index=1, dp_size=2)
    assert a.tiers[0].store_name == b.tiers[0].store_name
    a.store_all([key_of(1)])
    b.reset_primary()
    assert b.promote([key_of(1)])[key_of(1)] is LookupResult.HIT
    assert os.listdir(root) == [a.tiers[0].store_name]
    assert a.tiers[0].store.stats()["sharers"] == 2


def test_data_parallel_replicas_get_their_own_store_with_process_sharing(
    tmp_path, make_engine
) -> None:
    root = str(tmp_path / "kv")
    a = make_engine([nvme_tier(root, sharing="process")], dp_index=0, dp_size=2)
    b = make_engine([nvme_tier(root, sharing="process")], dp_index=1, dp_size=2)
    assert a.tiers[0].store_name.endswith("_dp0")
    assert b.tiers[0].store_name.endswith("_dp1")
    a.store_all([key_of(1)])
    b.store_all([key_of(2)])
    assert sorted(os.listdir(root)) == sorted([a.tiers[0].store_name, b.tiers[0].store_name])


def test_independent_dp_ranks_get_their_own_store_with_process_sharing(
    tmp_path, make_engine
) -> None:
    # vLLM runs the DP ranks of a non-MoE model as independent engines whose
    # data_parallel_size reads 1; only data_parallel_index tells them apart.
    root = str(tmp_path / "kv")
    a = make_engine([nvme_tier(root, sharing="process")], dp_index=0, dp_size=1)
    b = make_engine([nvme_tier(root, sharing="process")], dp_index=1, dp_size=1)
    assert a.tiers[0].store_name != b.tiers[0].store_name
    b.store_all([key_of(2)])


@pytest.mark.parametrize("dp_size", [1, 2])
def test_store_gauges_are_reported_by_dp_rank_0_only(tmp_path, make_engine, dp_size) -> None:
    root = str(tmp_path / "kv")
    a = make_engine([nvme_tier(root)], dp_index=0, dp_size=dp_size)
    b = make_engine([nvme_tier(root)], dp_index=1, dp_size=dp_size)
    a.store_all([key_of(1)])

    def gauges(eng):
        values = eng.tiers[0].get_stats().data["data"]
        return {
            name.removeprefix("vllm:nvmetier_"): sum(v.values())
            for name, v in values.items()
            if name.removeprefix("vllm:nvmetier_") in ("capacity_bytes", "sharers", "slots_used")
        }

    ga, gb = gauges(a), gauges(b)
    assert ga["capacity_bytes"] > 0 and ga["sharers"] == 2 and ga["slots_used"] == 1
    assert gb == {"capacity_bytes": 0, "sharers": 0, "slots_used": 0}


def test_ephemeral_store_is_removed_at_shutdown(tmp_path, make_engine) -> None:
    root = tmp_path / "kv"
    eng = make_engine([nvme_tier(str(root), persist=False)])
    eng.store_all([key_of(1)])
    assert os.listdir(root)
    eng.shutdown()
    assert os.listdir(root) == []


def test_two_drives_both_serve(tmp_path, make_engine) -> None:
    roots = [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")]
    eng = make_engine([nvme_tier(roots)])
    keys = [key_of(i) for i in range(20)]
    eng.store_all(keys)
    store = eng.tiers[0].store
    used = {store.sb.slot_location(store.slot_of(k))[0] for k in keys}
    assert used == {0, 1}
    eng.reset_primary()
    assert set(eng.promote(keys).values()) == {LookupResult.HIT}
    assert eng.verify(keys) == 20


def test_failed_drive_becomes_misses_while_the_other_serves(tmp_path, make_engine, monkeypatch):
    from tests.vllm.faults import FailingEngine

    engines: list[FailingEngine] = []

    def wrap(engine):
        engines.append(FailingEngine(engine))
        return engines[-1]

    monkeypatch.setattr("nvmetier.vllm.ENGINE_WRAPPER", wrap)
    roots = [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")]
    eng = make_engine([nvme_tier(roots)])
    keys = [key_of(i) for i in range(24)]
    eng.store_all(keys)
    store = eng.tiers[0].store
    on_drive = {k: store.sb.slot_location(store.slot_of(k))[0] for k in keys}
    engines[0].fail_files = {1}  # drive 1 dies
    eng.reset_primary()
    results = eng.promote(keys)
    alive = [k for k in keys if on_drive[k] == 0]
    dead = [k for k in keys if on_drive[k] == 1]
    assert alive and dead
    assert all(results[k] is LookupResult.HIT for k in alive)
    assert all(results[k] is LookupResult.MISS for k in dead)
    assert eng.verify(alive) == len(alive)
    eng.reset_primary()
    assert set(eng.promote(dead).values()) == {LookupResult.MISS}  # no retry loop
    assert set(eng.promote(alive).values()) == {LookupResult.HIT}


def test_backpressure_detector_is_honoured(tmp_path, make_engine) -> None:
    tier = nvme_tier(
        str(tmp_path / "kv"), backpressure={"backpressure_cls": "EMABackpressureDetector"}
    )
    eng = make_engine([tier])
    assert eng.tiers[0].bp_detector is not None
    keys = [key_of(i) for i in range(8)]
    eng.store_all(keys)
    eng.reset_primary()
    assert set(eng.promote(keys).values()) == {LookupResult.HIT}


def test_write_admission_stores_only_chunks_asked_for(tmp_path, make_engine) -> None:
    eng = make_engine([nvme_tier(str(tmp_path / "kv"), admit_after_lookups=1)], cpu_chunks=16)
    store = eng.tiers[0].store
    keys = [key_of(i) for i in range(8)]
    eng.store_all(keys)  # never looked up: not written (SSD wear)
    assert store.stats()["ops_written"] == 0
    assert store.stats()["stores_not_admitted"] == 8
    eng.reset_primary()
    assert set(eng.promote(keys[:4]).values()) == {LookupResult.MISS}  # asked for once
    eng.store_all(keys)
    assert store.stats()["ops_written"] == 4
    eng.reset_primary()
    results = eng.promote(keys)
    assert [results[k] for k in keys[:4]] == [LookupResult.HIT] * 4
    assert eng.verify(keys[:4]) == 4


@pytest.mark.timeout(120)
def test_bench_vllm_level_attributes_cpu_to_the_tier_and_verifies_loads(tmp_path, capsys) -> None:
    import json

    from nvmetier import bench

    rc = bench.main(
        [
            "--level",
            "vllm",
            "--bs",
            "64k",
            "--size",
            "4m",
            "--primary",
            "2m",
            "--no-fs-tier",
            "--engine",
            os.environ.get("NVMETIER_ENGINE", "threads"),
            "--lookups",
            "50",
            "--no-drop-caches",
            "--dir",
            str(tmp_path),
            "--output-format",
            "json",
        ]
    )
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    store, load = report["results"]
    for r in (store, load):
        cpu = r["cpu"]
        assert 0 < cpu["tier_s"] <= cpu["usr_s"] + cpu["sys_s"] + 0.02
        assert 0 <= r["extra"]["tier_cpu_on_scheduler_s"] <= cpu["tier_s"]
    # A chunk evicted at store time by a full set is counted as an error.
    assert load["bytes"] > 0 and load["bytes"] + load["errors"] * (64 << 10) == 4 << 20
    n, total = load["extra"]["verified_sample"].split("/")
    assert n == total and int(n) > 0


def test_a_store_of_an_older_format_is_reported_at_start(tmp_path, make_engine, caplog) -> None:
    import logging
    import struct

    from nvmetier import format as fmt

    root = tmp_path / "kv"
    old = root / "model_0123456789ab"
    old.mkdir(parents=True)
    (old / "superblock").write_bytes(fmt.MAGIC + struct.pack("<I", fmt.FORMAT_VERSION - 1))
    (old / "data").write_bytes(b"\0" * (1 << 20))
    with caplog.at_level(logging.WARNING, logger="nvmetier.vllm"):
        make_engine([nvme_tier(str(root))])
    assert f"{old} is a store of format version {fmt.FORMAT_VERSION - 1}" in caplog.text
    assert old.exists()  # reported, never deleted
