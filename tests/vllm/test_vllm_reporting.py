"""What the tier reports to vLLM, and what vLLM's orchestrator does with it
(issue 17): exact store results, backpressure with default settings, labelled
metrics, and errors in vLLM's shape. Everything goes through vLLM's real
TieringOffloadingSpec -> TieringOffloadingManager."""

from __future__ import annotations

import logging
import time
import types

import pytest
import xxhash
from vllm.v1.kv_offload.base import Locality, LookupResult, ReqContext, TierFilter, TierMatcher
from vllm.v1.kv_offload.tiering import backpressure as vllm_backpressure
from vllm.v1.kv_offload.tiering.backpressure import EMABackpressureDetector
from vllm.v1.kv_offload.tiering.base import JobResult, TieringOffloadingMetrics

from nvmetier.errors import ConfigError
from nvmetier.vllm import METRIC_PREFIX, NvmeTierManager, StorageBackpressureDetector, compat
from nvmetier.vllm.harness import key_of
from tests.vllm.conftest import nvme_tier

pytestmark = pytest.mark.timeout(180)
CHUNK = 64 << 10


def record_results(tier: NvmeTierManager) -> list[JobResult]:
    """Spy on the tier's public get_finished_jobs: every JobResult vLLM gets."""
    seen: list[JobResult] = []
    inner = tier.get_finished_jobs

    def spy():  # type: ignore[no-untyped-def]
        out = list(inner())
        seen.extend(out)
        return out

    tier.get_finished_jobs = spy  # type: ignore[method-assign]
    return seen


def store_results(seen: list[JobResult]) -> list[JobResult]:
    return [r for r in seen if r.transfer_bytes is None or r.transfer_bytes % CHUNK == 0]


# ------------------------------------------------------------ store results
def test_a_store_dropped_for_a_full_queue_is_not_reported_as_success(tmp_path, make_engine) -> None:
    tier_cfg = nvme_tier(
        str(tmp_path / "kv"), max_queued_bytes="256KiB", max_inflight_bytes="128KiB"
    )
    eng = make_engine([tier_cfg], cpu_chunks=80)
    tier = eng.tiers[0]
    seen = record_results(tier)
    keys = [key_of(i) for i in range(64)]
    assert eng.store(keys) == 64  # one cascade job of 64 chunks
    eng.wait_idle()
    (result,) = seen
    stored = [k for k in keys if tier.store.contains(k)]
    assert 0 < len(stored) < 64
    assert result.success is False
    assert list(result.successful_keys or ()) == stored
    assert result.transfer_bytes == len(stored) * CHUNK
    assert tier.store.stats()["stores_dropped_queue_full"] == 64 - len(stored)
    # vLLM counted the failed cascade in its own metric, under this tier's label.
    values = eng.manager.get_stats().reduce()
    failures = f"{TieringOffloadingMetrics.CASCADE_JOB_FAILURES}:{(tier.tier_label,)}"
    assert values[failures] == 1


def _same_set_keys(n_sets: int, count: int) -> list[bytes]:
    by_set: dict[int, list[bytes]] = {}
    for i in range(100_000):
        k = key_of(i)
        group = by_set.setdefault(xxhash.xxh3_64_intdigest(k, 0) % n_sets, [])
        group.append(k)
        if len(group) == count:
            return group
    raise AssertionError("no set collision found")


def test_a_store_dropped_for_a_busy_set_names_exactly_the_stored_keys(
    tmp_path, make_engine
) -> None:
    # One way per set: a second key of a set whose way is being written has
    # no way to go to, so it is dropped (set busy) and must be reported failed.
    eng = make_engine([nvme_tier(str(tmp_path / "kv"), ways=1)])
    tier = eng.tiers[0]
    n_sets = tier.store.sb.n_slots // tier.store.sb.ways
    a, b = _same_set_keys(n_sets, 2)
    seen = record_results(tier)
    assert eng.store([a, b]) == 2
    eng.wait_idle()
    (result,) = seen
    assert result.success is False
    assert list(result.successful_keys or ()) == [a]
    assert tier.store.contains(a) and not tier.store.contains(b)
    assert tier.store.stats()["stores_dropped_set_busy"] == 1


def test_keys_already_stored_or_not_admitted_are_not_failures(tmp_path, make_engine) -> None:
    eng = make_engine([nvme_tier(str(tmp_path / "kv"), admit_after_lookups=1)])
    tier = eng.tiers[0]
    seen = record_results(tier)
    keys = [key_of(i) for i in range(4)]
    eng.store(keys)  # nobody looked these up: the admission policy skips them
    eng.wait_idle()
    assert [r.success for r in seen] == [True]
    assert tier.store.stats()["stores_not_admitted"] == 4
    assert not tier.bp_detector.is_under_pressure()  # type: ignore[union-attr]


# ------------------------------------------------------------ backpressure
def test_the_tier_has_backpressure_without_a_backpressure_section(make_engine) -> None:
    eng = make_engine()
    detector = eng.tiers[0].bp_detector
    assert isinstance(detector, EMABackpressureDetector)
    assert detector.stats["consecutive_store_failures"] == 0
    for _ in range(compat.DEFAULT_FAILURE_THRESHOLD):
        detector.on_store_failed()
    assert detector.is_under_pressure()


def test_default_backpressure_does_not_read_step_latency_as_overload(make_engine) -> None:
    # vLLM sees a store finish only at its next step: one 64 KiB chunk per
    # 30 ms step would be 0.47 s/MiB, far over the local high watermark.
    detector = make_engine().tiers[0].bp_detector
    assert detector is not None
    for _ in range(50):
        detector.on_store_completed(0.030, CHUNK)
    assert not detector.is_under_pressure()


def test_default_backpressure_can_be_turned_off(tmp_path, make_engine) -> None:
    eng = make_engine([nvme_tier(str(tmp_path / "kv"), default_backpressure=False)])
    assert eng.tiers[0].bp_detector is None


ONLY_033 = pytest.mark.skipif(
    not compat.REPORTS_STORE_FAILURES,
    reason="vLLM 0.32's own EMABackpressureDetector has no failure threshold",
)


@ONLY_033
def test_a_backpressure_section_without_failure_threshold_gets_the_storage_default(
    tmp_path, make_engine
) -> None:
    section = {"backpressure_cls": "EMABackpressureDetector"}
    eng = make_engine([nvme_tier(str(tmp_path / "kv"), backpressure=section)])
    detector = eng.tiers[0].bp_detector
    assert isinstance(detector, EMABackpressureDetector)
    for _ in range(compat.DEFAULT_FAILURE_THRESHOLD):
        detector.on_store_failed()
    assert detector.is_under_pressure()


@ONLY_033
def test_an_explicit_failure_threshold_wins(tmp_path, make_engine) -> None:
    section = {"backpressure_cls": "EMABackpressureDetector", "failure_threshold": 10}
    eng = make_engine([nvme_tier(str(tmp_path / "kv"), backpressure=section)])
    detector = eng.tiers[0].bp_detector
    assert isinstance(detector, EMABackpressureDetector)
    for _ in range(9):
        detector.on_store_failed()
    assert not detector.is_under_pressure()
    detector.on_store_failed()
    assert detector.is_under_pressure()


@pytest.mark.skipif(
    compat.DETECTOR_TAKES_FAILURE_THRESHOLD,
    reason="this vLLM's EMABackpressureDetector honours failure_threshold",
)
def test_failure_threshold_without_vllm_support_is_an_error_naming_the_version_and_the_fix(
    tmp_path, make_engine
) -> None:
    section = {"backpressure_cls": "EMABackpressureDetector", "failure_threshold": 5}
    with pytest.raises(ConfigError) as err:
        make_engine([nvme_tier(str(tmp_path / "kv"), backpressure=section)])
    message = str(err.value)
    assert compat.vllm_version() in message and "failure_threshold" in message
    assert "nvmetier.vllm.StorageBackpressureDetector" in message


def test_the_storage_detector_honours_an_explicit_failure_threshold(tmp_path, make_engine) -> None:
    section = {
        "backpressure_cls": "nvmetier.vllm.StorageBackpressureDetector",
        "failure_threshold": 5,
    }
    eng = make_engine([nvme_tier(str(tmp_path / "kv"), backpressure=section)])
    detector = eng.tiers[0].bp_detector
    assert isinstance(detector, StorageBackpressureDetector)
    for _ in range(4):
        detector.on_store_failed()
    assert not detector.is_under_pressure()
    detector.on_store_failed()
    assert detector.is_under_pressure()


def test_the_storage_detector_defaults_to_three_failed_stores(tmp_path, make_engine) -> None:
    section = {"backpressure_cls": "nvmetier.vllm.StorageBackpressureDetector"}
    eng = make_engine([nvme_tier(str(tmp_path / "kv"), backpressure=section)])
    detector = eng.tiers[0].bp_detector
    assert detector is not None
    for _ in range(compat.DEFAULT_FAILURE_THRESHOLD):
        detector.on_store_failed()
    assert detector.is_under_pressure()


def test_a_top_level_backpressure_section_is_warned_about_once_naming_the_fix(
    tmp_path, make_engine, caplog
) -> None:
    top = {"backpressure_cls": "EMABackpressureDetector"}
    with caplog.at_level(logging.WARNING, logger="nvmetier.vllm"):
        make_engine(
            [nvme_tier(str(tmp_path / "a")), nvme_tier(str(tmp_path / "b"))],
            extra={"backpressure": top},
        )
    warned = [
        r.getMessage() for r in caplog.records if "top-level 'backpressure'" in r.getMessage()
    ]
    assert len(warned) == 1
    assert "secondary_tiers[i].backpressure" in warned[0]


def test_no_top_level_backpressure_section_no_warning(make_engine, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="nvmetier.vllm"):
        make_engine()
    assert not any("top-level 'backpressure'" in r.getMessage() for r in caplog.records)


def test_failed_stores_put_the_tier_under_backpressure_then_stores_recover(
    make_engine, monkeypatch
) -> None:
    import errno

    from tests.vllm.faults import FailingEngine

    failing: list[FailingEngine] = []

    def wrap(engine):  # type: ignore[no-untyped-def]
        failing.append(FailingEngine(engine))
        return failing[0]

    monkeypatch.setattr("nvmetier.vllm.ENGINE_WRAPPER", wrap)
    # The detector's clock, advanced by hand so its idle decay needs no waiting.
    offset = [0.0]
    fake_time = types.SimpleNamespace(monotonic=lambda: time.monotonic() + offset[0])
    monkeypatch.setattr(vllm_backpressure, "time", fake_time)

    eng = make_engine()  # no backpressure section anywhere
    tier = eng.tiers[0]
    failing[0].fail_files = {0}  # every write fails: a dead drive
    failing[0].fail_errno = errno.EIO
    n = compat.DEFAULT_FAILURE_THRESHOLD
    for j in range(n):
        eng.store([key_of(100 * j + i) for i in range(4)])
        eng.wait_idle()
    assert tier.store.stats()["write_errors"] == 4 * n
    assert tier.bp_detector is not None and tier.bp_detector.is_under_pressure()

    # Under pressure, vLLM stops cascading to the tier: no write is attempted.
    # (No reset_primary() here: vLLM's reset_cache also resets the detectors.)
    eng.store([key_of(900 + i) for i in range(4)])
    eng.wait_idle()
    assert tier.store.stats()["write_errors"] == 4 * n
    assert not any(tier.store.contains(key_of(900 + i)) for i in range(4))

    # The drive is back; once the pressure decayed (and the cooldown passed),
    # stores reach the tier again.
    failing[0].fail_files = set()
    offset[0] += 60.0
    assert not tier.bp_detector.is_under_pressure()
    offset[0] += 5.0
    fresh = [key_of(1000 + i) for i in range(4)]
    eng.store(fresh)
    eng.wait_idle()
    assert all(tier.store.contains(k) for k in fresh)


# ------------------------------------------------------------ labelled metrics
def test_two_tiers_in_one_engine_report_separate_labelled_series(tmp_path, make_engine) -> None:
    eng = make_engine(
        [
            nvme_tier(str(tmp_path / "a"), capacity_bytes="8MiB"),
            nvme_tier(str(tmp_path / "b"), capacity_bytes="16MiB"),
        ]
    )
    t1, t2 = eng.tiers
    assert t1.tier_label != t2.tier_label
    keys = [key_of(i) for i in range(6)]
    eng.store_all(keys)
    values = eng.manager.get_stats().reduce()
    for tier, capacity in ((t1, 8 << 20), (t2, 16 << 20)):
        labels = (tier.tier_label,)
        assert values[f"{METRIC_PREFIX}ops_written:{labels}"] == 6
        assert values[f"{METRIC_PREFIX}capacity_bytes:{labels}"] <= capacity
        # The same label value as vLLM's own series of this tier.
        assert f"{TieringOffloadingMetrics.WRITE_BYTES}:{labels}" in values
    assert (
        values[f"{METRIC_PREFIX}capacity_bytes:{(t1.tier_label,)}"]
        != values[f"{METRIC_PREFIX}capacity_bytes:{(t2.tier_label,)}"]
    )
    assert not any(k == f"{METRIC_PREFIX}ops_written" for k in values)


def test_every_metric_declares_the_tier_label() -> None:
    defs = NvmeTierManager.build_metric_definitions({})
    assert defs and all(d.labelnames == ("tier",) for d in defs.values())


# ------------------------------------------------------------ errors
def test_an_invalid_locality_is_a_value_error_naming_the_accepted_values(
    tmp_path, make_engine
) -> None:
    with pytest.raises(ValueError, match=r"LOCAL.*REMOTE"):
        make_engine([nvme_tier(str(tmp_path / "kv"), locality="mars")])


@pytest.mark.parametrize("value", ["remote", "REMOTE", "Remote"])
def test_locality_is_accepted_in_any_case(tmp_path, make_engine, value: str) -> None:
    eng = make_engine([nvme_tier(str(tmp_path / "kv"), locality=value)])
    assert eng.tiers[0].locality is Locality.REMOTE


# ------------------------------------------------------------ locality
def test_a_tier_without_locality_is_local(make_engine) -> None:
    assert make_engine().tiers[0].locality is Locality.LOCAL


def test_a_request_asking_for_remote_tiers_does_not_read_the_local_disk(make_engine) -> None:
    eng = make_engine()
    tier = eng.tiers[0]
    keys = [key_of(i) for i in range(4)]
    eng.store_all(keys)
    eng.reset_primary()
    remote_only = ReqContext(
        req_id="remote-only",
        load_tier_filter=TierFilter(matchers=(TierMatcher(locality=Locality.REMOTE),)),
    )
    with eng.manager.lock:
        eng.manager.on_new_request(remote_only)
        results = [eng.manager.lookup(k, remote_only) for k in keys]
        eng.manager.on_request_finished(remote_only)
    eng.wait_idle()
    assert results == [LookupResult.MISS] * 4
    assert tier.store.stats()["ops_read"] == 0


def test_the_root_budget_and_usage_are_exported_through_vllm(tmp_path, make_engine) -> None:
    """Issue 30: vllm:nvmetier_root_budget_bytes is the recorded budget,
    vllm:nvmetier_root_used_bytes what the root holds on disk (under it), and
    the give-way counter is a series from the first payload."""
    from nvmetier import budget

    root = str(tmp_path / "kv")
    eng = make_engine([nvme_tier(root, root_budget_bytes="48MiB")], cpu_chunks=8)
    tier = eng.tiers[0]
    values = eng.manager.get_stats().reduce()
    label = (tier.tier_label,)
    assert values[f"{METRIC_PREFIX}root_budget_bytes:{label}"] == 48 << 20
    used = values[f"{METRIC_PREFIX}root_used_bytes:{label}"]
    assert 16 << 20 < used <= 32 << 20  # the one store, within its capacity_bytes
    assert used == budget.root_used_bytes(root)
    assert values[f"{METRIC_PREFIX}stores_removed_for_budget:{label}"] == 0
