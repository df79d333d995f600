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
