"""NvmeTierManager under vLLM 0.33's real TieringOffloadingSpec ->
CPUPrimaryTierOffloadingManager -> TieringOffloadingManager."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
import threading

import pytest
from vllm.v1.kv_offload.base import LookupResult, ScheduleEndContext

from nvmetier.errors import ConfigError
from nvmetier.vllm import NvmeTierManager
from nvmetier.vllm.harness import key_of
from tests.vllm.conftest import nvme_tier

pytestmark = pytest.mark.timeout(180)
REPO = str(pathlib.Path(__file__).resolve().parents[2])


def test_tier_is_built_from_the_offloading_config(make_engine) -> None:
    eng = make_engine()
    (tier,) = eng.tiers
    assert isinstance(tier, NvmeTierManager)
    assert tier.medium.name == "STORAGE"
    if hasattr(eng.manager, "config_info"):  # vLLM 0.33's info metric
        info = eng.manager.config_info()
        assert info[1]["nvmetier_engine"] in ("threads", "uring")


def test_cascade_then_promotion_returns_the_same_bytes(make_engine) -> None:
    eng = make_engine()
    keys = [key_of(i) for i in range(80)]  # more than the 32-chunk primary
    eng.store_all(keys)
    stats = eng.tiers[0].store.stats()
    assert stats["ops_written"] == 80
    eng.reset_primary()
    for start in range(0, 80, 16):
        part = keys[start : start + 16]
        results = eng.promote(part)
        assert set(results.values()) == {LookupResult.HIT}
        assert eng.verify(part) == len(part)
        eng.reset_primary()


def test_a_promotion_takes_over_the_leases_its_plan_took(make_engine) -> None:
    """vLLM's orchestrator hands the request's own key objects from its lookups
    to its load jobs: every promoted chunk's load takes over the lease its
    plan granted (no second search of the index), and no pin outlives the
    loads and the step (each slot is evictable again: a flood of stores
    replaces every chunk)."""
    eng = make_engine()
    tier = eng.tiers[0]
    keys = [key_of(i) for i in range(16)]
    eng.store_all(keys)
    eng.reset_primary()
    before = tier.store.stats()["load_leases_taken"]
    results = eng.promote(keys)
    assert set(results.values()) == {LookupResult.HIT}
    eng.wait_idle()
    assert eng.verify(keys) == len(keys)
    assert tier.store.stats()["load_leases_taken"] - before == len(keys)
    eng.store_all([key_of(10_000 + i) for i in range(2 * tier.store.sb.n_slots)])
    eng.wait_idle()
    assert not any(tier.store.contains(k) for k in keys)


def test_lookup_of_an_unknown_key_is_a_miss(make_engine) -> None:
    eng = make_engine()
    assert eng.promote([key_of(12345)]) == {key_of(12345): LookupResult.MISS}


def test_store_survives_a_process_restart(tmp_path, make_engine) -> None:
    root = str(tmp_path / "kv")
    writer = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {REPO!r})
        from nvmetier.vllm.harness import SimulatedEngine, make_config, key_of
        from tests.vllm.conftest import nvme_tier
        eng = SimulatedEngine(make_config([nvme_tier({root!r})], chunk_bytes=65536, cpu_chunks=32))
        eng.store_all([key_of(i) for i in range(40)])
        eng.shutdown()
        """
    )
    subprocess.run([sys.executable, "-c", writer], check=True, timeout=120)
    eng = make_engine([nvme_tier(root)])
    keys = [key_of(i) for i in range(40)]
    for start in range(0, 40, 20):
        part = keys[start : start + 20]
        assert set(eng.promote(part).values()) == {LookupResult.HIT}
        assert eng.verify(part) == 20
        eng.reset_primary()


def test_another_model_never_reads_this_models_chunks(tmp_path, make_engine) -> None:
    root = str(tmp_path / "kv")
    eng = make_engine([nvme_tier(root)], model="org/model-a")
    eng.store_all([key_of(i) for i in range(8)])
    eng.shutdown()
    for other in ({"model": "org/model-b"}, {"dtype": "bfloat16"}, {"tp_size": 2}):
        eng = make_engine([nvme_tier(root)], **{"model": "org/model-a", **other})
        assert eng.promote([key_of(1)]) == {key_of(1): LookupResult.MISS}
        eng.shutdown()
    assert len(os.listdir(root)) == 4


def test_failed_load_reports_successful_keys_and_then_misses(make_engine, monkeypatch) -> None:
    from nvmetier.engine import OP_READ
    from tests.vllm.faults import FailingEngine

    failing: list[FailingEngine] = []

    def wrap(engine):
        failing.append(FailingEngine(engine))
        return failing[0]

    monkeypatch.setattr("nvmetier.vllm.ENGINE_WRAPPER", wrap)
    eng = make_engine()
    keys = [key_of(i) for i in range(6)]
    eng.store_all(keys)
    eng.reset_primary()
    bad = keys[2]
    tier = eng.tiers[0]
    failing[0].fail_kind = OP_READ
    failing[0].fail_offsets = {tier.store.sb.slot_location(tier.store.slot_of(bad))}
    results = eng.promote(keys)
    assert results[bad] is LookupResult.MISS
    assert all(results[k] is LookupResult.HIT for k in keys if k != bad)
    assert eng.verify([k for k in keys if k != bad]) == 5
    # The failed key is a miss from now on: no re-promotion loop.
    eng.reset_primary()
    assert eng.promote([bad]) == {bad: LookupResult.MISS}
    assert tier.store.stats()["read_errors"] == 1


def test_reset_cache_drains_stores_in_flight(make_engine) -> None:
    eng = make_engine()
    keys = [key_of(i) for i in range(24)]
    eng.store(keys)  # cascade submitted, not waited for
    eng.reset_primary()  # drain_jobs + primary reset
    eng.wait_idle()
    assert eng.tiers[0].store.stats()["slots_ready"] == 24
    assert set(eng.promote(keys).values()) == {LookupResult.HIT}
    assert eng.verify(keys) == 24


def test_unknown_tier_key_is_a_clear_config_error(tmp_path, make_engine) -> None:
    with pytest.raises(ConfigError, match="did you mean 'capacity_bytes'"):
        make_engine([nvme_tier(str(tmp_path / "kv"), capacity_byts="1GiB")])


def test_two_tiers_on_one_exclusive_store_are_refused(tmp_path, make_engine) -> None:
    from nvmetier.errors import StoreLockedError

    root = str(tmp_path / "kv")
    make_engine([nvme_tier(root, sharing="process")])
    with pytest.raises(StoreLockedError, match="in use by another process"):
        make_engine([nvme_tier(root, sharing="process")])


def test_an_exclusive_opener_is_refused_while_sharers_are_attached(tmp_path, make_engine) -> None:
    from nvmetier.errors import StoreLockedError

    root = str(tmp_path / "kv")
    make_engine([nvme_tier(root)])
    with pytest.raises(StoreLockedError, match="sharing is 'process'"):
        make_engine([nvme_tier(root, sharing="process")])


def test_lookup_hit_is_protected_until_its_load_is_submitted(tmp_path, make_engine) -> None:
    eng = make_engine(
        [nvme_tier(str(tmp_path / "kv"), capacity_bytes="4MiB", ways=4)], cpu_chunks=64
    )
    tier = eng.tiers[0]
    assert tier.store.sb.n_slots <= 64
    keys = [key_of(i) for i in range(tier.store.sb.n_slots)]
    eng.store_all(keys)
    eng.reset_primary()
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(req_id="r")
    with eng.manager.lock:
        eng.manager.on_new_request(ctx)
        hit = keys[0]
        assert eng.manager.lookup(hit, ctx) is LookupResult.HIT_PENDING
    # Before the step ends, a flood of stores wants every way of every set.
    eng.store_all([key_of(10_000 + i) for i in range(2 * tier.store.sb.n_slots)])
    eng.wait_idle()
    # The promotion read the right bytes (the primary may since have evicted it).
    stats = tier.store.stats()
    assert stats["ops_read"] == 1
    assert stats["load_keys_missing"] == 0 and stats["load_jobs_failed"] == 0
    assert stats["checksum_failures"] == 0


def test_the_tier_is_served_at_steps_without_a_tier_poll_thread(make_engine) -> None:
    """No remote counterpart, so no vLLM tier-poll thread: finished jobs are
    collected by the steps themselves, and completions reach vLLM there."""
    eng = make_engine()
    assert getattr(eng.manager, "_tier_poll_thread", None) is None  # 0.32 has none at all
    assert not any(t.name == "vllm_offload_tier_poll" for t in threading.enumerate())
    keys = [key_of(i) for i in range(24)]
    eng.store_all(keys)  # steps until the cascade to the tier finished
    tier = eng.tiers[0]
    assert all(tier.store.contains(k) for k in keys)
    eng.reset_primary()
    assert set(eng.promote(keys).values()) == {LookupResult.HIT}
    assert eng.verify(keys) == len(keys)


def test_a_waiting_requests_cpu_chunks_are_kept_from_other_promotions(make_engine) -> None:
    """A request vLLM announced (``on_new_request``) and has not walked to the
    tier keeps its CPU-tier chunks: another request's plan promotes only
    into the free room, never evicting them (the guard protects the waiting
    requests' chunks before the step's first promotion)."""
    from vllm.v1.kv_offload.base import ReqContext

    from nvmetier.vllm.harness import record_positions

    eng = make_engine(cpu_chunks=8)
    a = [key_of(i) for i in range(4)]
    b = [key_of(100 + i) for i in range(8)]
    eng.store_all(b)  # B on disk
    eng.reset_primary()
    eng.store_all(a)  # A in the CPU tier (and on disk)
    assert all(eng.primary_has(k) for k in a)
    ctx_a, ctx_b = ReqContext(req_id="a"), ReqContext(req_id="b")
    record_positions(ctx_a, a, eng.tokens_per_chunk)
    record_positions(ctx_b, b, eng.tokens_per_chunk)
    m = eng.manager
    with m.lock:
        m.on_new_request(ctx_a)  # waiting: vLLM has not walked it yet
        m.on_new_request(ctx_b)
        answers = [m.lookup(k, ctx_b) for k in b]
        m.on_schedule_end(ScheduleEndContext(("b",), ()))
    promoted = sum(r is not LookupResult.MISS for r in answers)
    assert promoted == 4  # the 4 free rows; A's 4 are kept
    eng.wait_idle()
    assert all(eng.primary_has(k) for k in a)
    with m.lock:
        m.on_request_finished(ctx_b)
        m.on_request_finished(ctx_a)


def test_a_scheduled_request_stops_waiting_even_in_a_step_with_no_round(make_engine) -> None:
    """A request vLLM scheduled (``new_req_ids``) is no longer waiting, also
    in a step where no request had a round: its CPU-tier chunks are then
    evictable room for another request's promotions (vLLM's own load holds
    what it needs)."""
    from vllm.v1.kv_offload.base import ReqContext

    from nvmetier.vllm.harness import record_positions

    eng = make_engine(cpu_chunks=8)
    a = [key_of(i) for i in range(4)]
    b = [key_of(100 + i) for i in range(8)]
    eng.store_all(b)
    eng.reset_primary()
    m = eng.manager
    ctx_a, ctx_b = ReqContext(req_id="a"), ReqContext(req_id="b")
    with m.lock:
        m.on_new_request(ctx_a)
        m.on_schedule_end(ScheduleEndContext(("a",), ()))  # scheduled: runs now
    record_positions(ctx_a, a, eng.tokens_per_chunk)
    eng.store_all(a)  # what A computed, in the CPU tier
    record_positions(ctx_b, b, eng.tokens_per_chunk)
    with m.lock:
        m.on_new_request(ctx_b)
        answers = [m.lookup(k, ctx_b) for k in b]
        m.on_schedule_end(ScheduleEndContext(("b",), ()))
    assert sum(r is not LookupResult.MISS for r in answers) == 8
    eng.wait_idle()
    with m.lock:
        m.on_request_finished(ctx_b)
        m.on_request_finished(ctx_a)
