"""The tier's get_finished_jobs() and on_new_request() as vLLM calls them: the
instance's native ``FinishedJobs`` (``NvmeTierManager`` sets it over the
store's poll) and ``NewRequest``, under vLLM's real orchestrator.

- Stores and promotions through it report exactly the jobs the class's own
  method reports on an identical engine run side by side (ids, success,
  keys), and a step with nothing finished answers an empty result.
- A subclass of ``NvmeTierManager`` that overrides ``get_finished_jobs`` or
  ``on_new_request`` keeps it (the instance's native callable would shadow it).
"""

from __future__ import annotations

from typing import Any

import pytest
from nvmetier._table import FinishedJobs
from vllm.v1.kv_offload.base import LookupResult

from nvmetier.vllm import NvmeTierManager
from nvmetier.vllm.harness import key_of
from tests.vllm.conftest import nvme_tier


def _run(make_engine, root: str, native: bool) -> list[tuple[int, bool, list[bytes] | None]]:
    eng = make_engine([nvme_tier(root)])
    tier = eng.tiers[0]
    assert isinstance(vars(tier).get("get_finished_jobs"), FinishedJobs)
    if not native:  # the class's method, as before the native callable
        del tier.get_finished_jobs
    seen: list[tuple[int, bool, list[bytes] | None]] = []
    method = tier.get_finished_jobs

    def recording() -> Any:
        out = list(method())
        seen.extend((r.job_id, r.success, r.successful_keys) for r in out)
        return out

    tier.get_finished_jobs = recording
    keys = [key_of(i) for i in range(12)]
    eng.store_all(keys)
    eng.reset_primary()
    assert set(eng.promote(keys).values()) == {LookupResult.HIT}
    # Nothing in flight: an empty answer.
    assert list(method()) == []
    return seen


def test_native_get_finished_jobs_reports_what_the_method_reports(tmp_path, make_engine) -> None:
    native = _run(make_engine, str(tmp_path / "a"), native=True)
    python = _run(make_engine, str(tmp_path / "b"), native=False)
    assert native and sorted(native) == sorted(python)
    assert all(ok for _, ok, _ in native)


def test_a_subclass_that_overrides_get_finished_jobs_keeps_its_own(tmp_path, make_engine) -> None:
    eng = make_engine(
        [{**nvme_tier(str(tmp_path / "kv")), "type": "PollCountingTier", "module_path": __name__}]
    )
    tier = eng.tiers[0]
    assert "get_finished_jobs" not in vars(tier)
    keys = [key_of(i) for i in range(8)]
    eng.store_all(keys)
    assert tier.polls > 0 and tier.jobs_seen > 0


class PollCountingTier(NvmeTierManager):
    """A subclass with its own get_finished_jobs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.polls = 0
        self.jobs_seen = 0

    def get_finished_jobs(self) -> Any:
        self.polls += 1
        out = list(super().get_finished_jobs())
        self.jobs_seen += len(out)
        return out


def test_on_new_request_is_native_and_a_subclass_keeps_its_own(tmp_path, make_engine) -> None:
    from nvmetier._table import NewRequest

    eng = make_engine([nvme_tier(str(tmp_path / "a"))])
    assert isinstance(vars(eng.tiers[0]).get("on_new_request"), NewRequest)
    eng2 = make_engine(
        [{**nvme_tier(str(tmp_path / "b")), "type": "NewRequestTier", "module_path": __name__}]
    )
    tier = eng2.tiers[0]
    assert "on_new_request" not in vars(tier)
    keys = [key_of(i) for i in range(8)]
    eng2.store_all(keys)
    eng2.reset_primary()
    assert set(eng2.promote(keys).values()) == {LookupResult.HIT}
    assert tier.new_requests >= 1


class NewRequestTier(NvmeTierManager):
    """A subclass with its own on_new_request."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.new_requests = 0

    def on_new_request(self, req_context: Any) -> Any:
        self.new_requests += 1
        return super().on_new_request(req_context)


def test_schedule_end_and_submit_store_are_native_and_subclasses_keep_theirs(
    tmp_path, make_engine
) -> None:
    from nvmetier._table import ScheduleEnd, SubmitStore

    eng = make_engine([nvme_tier(str(tmp_path / "a"))])
    tier = eng.tiers[0]
    assert isinstance(vars(tier).get("on_schedule_end"), ScheduleEnd)
    assert isinstance(vars(tier).get("submit_store"), SubmitStore)
    keys = [key_of(i) for i in range(12)]
    eng.store_all(keys)
    eng.reset_primary()
    assert set(eng.promote(keys).values()) == {LookupResult.HIT}
    eng2 = make_engine(
        [{**nvme_tier(str(tmp_path / "b")), "type": "StepCountingTier", "module_path": __name__}]
    )
    tier2 = eng2.tiers[0]
    assert "on_schedule_end" not in vars(tier2) and "submit_store" not in vars(tier2)
    eng2.store_all(keys)
    eng2.reset_primary()
    assert set(eng2.promote(keys).values()) == {LookupResult.HIT}
    assert tier2.steps > 0 and tier2.stores > 0


class StepCountingTier(NvmeTierManager):
    """A subclass with its own on_schedule_end and submit_store."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps = 0
        self.stores = 0

    def on_schedule_end(self, context: Any) -> None:
        self.steps += 1
        super().on_schedule_end(context)

    def submit_store(self, job_metadata: Any) -> None:
        self.stores += 1
        super().submit_store(job_metadata)


def _crafted_outcomes() -> list[tuple[Any, ...]]:
    """Raw outcomes of every kind, as the table's poll returns them."""
    k = [key_of(i) for i in range(4)]
    return [
        (1, True, None, 0.01, 64, None, False),  # plain store
        (2, True, [k[0]], 0.02, 64, None, False),  # plain store, its keys named
        (3, True, [], 0.02, 64, None, False),  # plain store, empty ok_keys
        (4, False, [k[1]], 0.03, 32, "write failed: EIO", False),  # failed store
        (5, False, None, 0.0, 0, None, False),  # dropped store (no error text)
        (6, True, None, 0.04, 128, None, True),  # load
        (7, False, [k[2]], 0.05, 64, "read failed: checksum", True),  # partial load
        (8, True, None, 0.06, 64, "late warning", False),  # success with an error
    ]


@pytest.mark.parametrize("reports_failures", [True, False], ids=["0.33", "0.32"])
def test_native_finished_jobs_equals_the_python_report_entry_by_entry(
    tmp_path, make_engine, monkeypatch, caplog, reports_failures: bool
) -> None:
    """Every kind of outcome through the native FinishedJobs (make path) and
    through the class's get_finished_jobs on the same tier: the same
    JobResults in the same order, and the same side effects (failures
    logged, the guard told of each load, the detector told of each failed
    store on a vLLM that does not, a failed load's refresh bookkeeping
    dropped)."""
    from nvmetier.vllm import compat

    eng = make_engine([nvme_tier(str(tmp_path / "kv"))])
    # (After the tier's detector is built: it reads the flag too.)
    monkeypatch.setattr(compat, "REPORTS_STORE_FAILURES", reports_failures)
    tier: Any = eng.tiers[0]
    native = vars(tier)["get_finished_jobs"]
    runs = []
    for use_native in (True, False):
        effects: list[Any] = []
        tier._guard.load_finished = lambda *a, fx=effects: fx.append(("load_finished", a))
        tier.bp_detector.on_store_failed = lambda fx=effects: fx.append("failed")
        tier._loads_of = {"r": [[key_of(9)]]}
        outcomes = _crafted_outcomes()
        caplog.clear()
        if use_native:
            native.poll = lambda o=outcomes: o
            got = list(native())
        else:
            tier._poll = lambda o=outcomes: o
            got = list(NvmeTierManager.get_finished_jobs(tier))
        logged = [r.getMessage() for r in caplog.records if r.levelno >= 30]
        runs.append((got, effects, dict(tier._loads_of), logged))
    assert runs[0] == runs[1]
    got, effects, loads_of, logged = runs[0]
    assert [r.job_id for r in got] == list(range(1, 9))
    assert got[2].successful_keys is None
    assert ("failed" in effects) is (not reports_failures)
    assert loads_of == {} and len(logged) >= 3


def test_the_native_calls_take_vllms_parameter_names_as_keywords(tmp_path, make_engine) -> None:
    """vLLM calls these positionally today; a keyword call by the names of
    its interface (``SecondaryTierManager``'s, checked here) works too."""
    import inspect
    import time

    import numpy as np
    from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob

    names = {"submit_store": "job_metadata", "on_schedule_end": "context"}
    names["on_new_request"] = "req_context"
    for method, param in names.items():
        assert list(inspect.signature(getattr(SecondaryTierManager, method)).parameters) == [
            "self",
            param,
        ]
    eng = make_engine([nvme_tier(str(tmp_path / "kv"))])
    tier: Any = eng.tiers[0]
    ctx = ReqContext(req_id="kw")
    assert tier.on_new_request(req_context=ctx) is NvmeTierManager.on_new_request(tier, ctx)
    job = TransferJob(
        job_id=10**6,
        keys=[key_of(1)],
        chunk_ids=np.array([0], dtype=np.int32),
        is_promotion=False,
        req_context=ctx,
    )
    assert tier.submit_store(job_metadata=job) is None
    done: list[Any] = []
    deadline = time.monotonic() + 30
    while not done and time.monotonic() < deadline:
        assert tier.on_schedule_end(context=ScheduleEndContext((), ())) is None
        done.extend(tier.get_finished_jobs())
        time.sleep(0.001)
    assert [(r.job_id, r.success) for r in done] == [(10**6, True)]


def test_a_subclass_that_overrides_report_finished_sees_every_job(tmp_path, make_engine) -> None:
    """The native FinishedJobs makes a plain store's JobResult itself, past
    ``_report_finished``: a subclass that overrides that method (to count,
    log or filter the jobs) still gets every job, stores included."""
    eng = make_engine(
        [{**nvme_tier(str(tmp_path / "kv")), "type": "ReportCountingTier", "module_path": __name__}]
    )
    tier = eng.tiers[0]
    assert isinstance(vars(tier).get("get_finished_jobs"), FinishedJobs)
    keys = [key_of(i) for i in range(12)]
    eng.store_all(keys)
    eng.reset_primary()
    assert set(eng.promote(keys).values()) == {LookupResult.HIT}
    assert tier.stores_seen > 0 and tier.loads_seen > 0


class ReportCountingTier(NvmeTierManager):
    """A subclass with its own _report_finished."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stores_seen = 0
        self.loads_seen = 0

    def _report_finished(self, done: Any) -> Any:
        for raw in done:
            if raw[6]:
                self.loads_seen += 1
            else:
                self.stores_seen += 1
        return super()._report_finished(done)
