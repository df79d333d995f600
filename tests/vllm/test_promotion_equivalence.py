"""The promotion guard's per-step shortcuts, checked against what they replace.

- ``_pin_landed`` takes the keys of promotions in flight as the union of the
  load jobs' key collections (``_load_jobs``), where it once kept them in a
  set of their own (``_in_flight``: updated at ``note_load_job``, emptied of
  a job's keys at its ``load_finished``, cleared by ``release_all``). A
  ``CheckedGuard`` keeps that set beside the guard and checks, every time
  ``_pin_landed`` would compute it, that both give each round the same keys
  to ask about.
- ``end_step`` skips ``_pin_landed`` and ``_expire_idle`` when
  ``_rounds_waiting`` says neither has anything to do: the checked guard runs
  them anyway then, and checks that they changed nothing (rounds, pins,
  landings, idle steps, the CPU tier's pins).

Both over random schedules of ``test_promotion_property`` (vLLM's real
orchestrator and CPU tier, the walk model), with the load jobs' keys as
vLLM gives them (lists) and as tuples; plus direct cases the walk never
makes: two jobs in flight sharing a key, and a CPU tier reset (generation
change) while rounds wait on their promotions. About 4 s (``NVMETIER_SLOW=1``:
10x the schedules).
"""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import Any

import pytest

from nvmetier.vllm.cpu_view import PENDING, READY
from nvmetier.vllm.harness import key_of
from nvmetier.vllm.promotion import PromotionGuard
from tests.vllm import walk_model
from tests.vllm.test_plan_leases import planned_guard
from tests.vllm.test_promotion_property import check_schedule

pytestmark = pytest.mark.timeout(300)

SCHEDULES = int(os.environ.get("WALK_SCHEDULES", "0")) or (
    2000 if os.environ.get("NVMETIER_SLOW") else 200
)


class CheckedGuard(PromotionGuard):
    """The guard, with the removed ``_in_flight`` set kept beside it and the
    skipped steps' work run anyway to check it was a no-op."""

    tuple_keys = False  # hand the guard each load job's keys as a tuple
    checks = [0, 0]  # [rests compared, skipped steps checked], over every guard

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shadow_in_flight: set[Any] = set()

    def note_load_job(self, job_id: int, keys: Collection[Any], ctx: Any) -> None:
        if self.tuple_keys:
            keys = tuple(keys)
        super().note_load_job(job_id, keys, ctx)
        if job_id in self._load_jobs:
            self.shadow_in_flight.update(keys)

    def load_finished(self, job_id: int, success: bool, ok_keys: Collection[Any] | None) -> None:
        keys = self._load_jobs.get(job_id)
        super().load_finished(job_id, success, ok_keys)
        if keys is not None and self._view is not None:
            self.shadow_in_flight.difference_update(keys)

    def release_all(self) -> None:
        super().release_all()
        self.shadow_in_flight.clear()

    def _pin_landed(self) -> None:
        view = self._view
        if view is not None:
            generation = view.generation()
            for rnd in self._rounds.values():
                landing = rnd.landing
                if not landing or rnd.generation != generation:
                    continue
                if rnd.in_flight_n == len(landing):
                    continue
                old = landing - self.shadow_in_flight
                new = landing.difference(*self._load_jobs.values())
                assert old == new, (old, new)
                CheckedGuard.checks[0] += 1
        super()._pin_landed()

    def _snapshot(self) -> Any:
        rounds = tuple(
            (
                req_id,
                frozenset(r.landing),
                frozenset(r.pinned),
                r.idle_steps,
                r.closed,
                r.in_flight_n,
                r.generation,
            )
            for req_id, r in self._rounds.items()
        )
        return rounds

    def _rounds_waiting(self, view: Any) -> bool:
        waiting = super()._rounds_waiting(view)
        if waiting:
            before = self._snapshot()
            PromotionGuard._pin_landed(self)
            PromotionGuard._expire_idle(self)
            assert self._snapshot() == before
            CheckedGuard.checks[1] += 1
        return waiting


@pytest.mark.parametrize("tuple_keys", [False, True], ids=["list-keys", "tuple-keys"])
def test_pin_landed_and_the_step_skip_match_the_set_they_replaced(
    monkeypatch, tuple_keys: bool
) -> None:
    monkeypatch.setattr(walk_model.MemoryTier, "guard_class", CheckedGuard)
    monkeypatch.setattr(CheckedGuard, "tuple_keys", tuple_keys)
    CheckedGuard.checks[:] = [0, 0]
    start = 7000 if tuple_keys else 0
    for seed in range(start, start + SCHEDULES):
        check_schedule(seed)
    # Both paths were taken, many times.
    assert CheckedGuard.checks[0] > 100 and CheckedGuard.checks[1] > 100, CheckedGuard.checks


def test_two_jobs_in_flight_sharing_a_key_keep_it_pending_until_both_finished() -> None:
    """A key in two promotion jobs (vLLM never submits one twice; a guard
    must not depend on it): it stays out of the keys asked about until the
    last job with it finished, and a key the first job landed is pinned by
    that job's load_finished, not left for a later step."""
    keys = [key_of(i) for i in range(6)]
    guard, view, ctx, _hits, _disk = planned_guard(keys)
    guard.note_load_job(1, keys[:4], ctx)
    guard.note_load_job(2, tuple(keys[3:]), ctx)  # keys[3] in both
    view.asked.clear()
    guard.end_step()
    assert view.asked == []
    guard.load_finished(1, True, None)
    assert sorted(view.pinned) == sorted(keys[:4])
    view.asked.clear()
    guard.end_step()
    assert view.asked == []  # keys[4:] still in job 2
    guard.load_finished(2, True, None)
    assert sorted(set(view.pinned)) == sorted(keys)
    assert guard.stats()["promotion_pins"] == 6


def test_a_cpu_tier_reset_while_rounds_wait_drops_their_landing_and_pins() -> None:
    """vLLM resets the CPU tier (a new generation) with no drain_jobs seen by
    this guard while a round waits on promotions in flight: the next step's
    _pin_landed is not skipped, the round's landing and pins of the old
    generation are dropped, and the old job's finish pins nothing."""
    keys = [key_of(i) for i in range(6)]
    guard, view, ctx, _hits, _disk = planned_guard(keys)
    view.states[keys[0]] = READY
    guard.note_load_job(1, keys[1:], ctx)
    for _ in range(2):
        guard.end_step()  # waiting: skipped
    rnd = guard._rounds["r"]
    assert rnd.landing and rnd.in_flight_n == len(rnd.landing)
    generation = [1]
    view.generation = lambda: generation[0]  # type: ignore[method-assign]
    view.states = {k: PENDING for k in keys[1:]}
    guard.end_step()
    assert rnd.landing == set() and rnd.pinned == set()
    pinned_before = list(view.pinned)
    guard.load_finished(1, True, None)
    assert view.pinned == pinned_before
    assert guard.stats()["promotion_pins"] == 0


def test_release_all_while_jobs_are_in_flight_forgets_them() -> None:
    """drain_jobs (release_all) while a promotion is in flight: its later
    load_finished pins nothing, and a new round's keys are asked about."""
    keys = [key_of(i) for i in range(6)]
    guard, view, ctx, _hits, _disk = planned_guard(keys)
    guard.note_load_job(1, keys, ctx)
    guard.release_all()
    assert guard._load_jobs == {}
    pinned_before = list(view.pinned)
    guard.load_finished(1, True, None)
    assert view.pinned == pinned_before and guard.stats()["promotion_pins"] == 0
