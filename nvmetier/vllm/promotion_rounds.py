"""What the end of a step does to the promotion guard's rounds.

Owns ``RoundKeeper``, the part of ``PromotionGuard``
(``nvmetier.vllm.promotion``) that keeps a request's round between steps:
pins the planned chunks whose promotions landed in the CPU tier, tells when
no round has anything to pin (the usual step while promotions are in
flight), counts the HITs no load took (and warns of them at most once a
minute), and closes or releases a round's pins. ``PromotionGuard.end_step``
decides which of these a step runs; ``RequestPlanner``
(``nvmetier.vllm.promotion_plan``) makes the rounds.

Threads: vLLM's scheduler thread under the orchestrator's lock, as every
method of the guard; nothing blocks, nothing does I/O.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from typing import Any

from nvmetier.vllm.cpu_view import ABSENT, READY, PrimaryView
from nvmetier.vllm.promotion_plan import NOT_LOADED_LOG_INTERVAL_S, RequestPlanner, _Round


class RoundKeeper(RequestPlanner):
    """The rounds' pins between steps (``PromotionGuard`` is the class to
    use; this one holds the end-of-step half of its methods). The state it
    reads is the guard's, set up by ``PromotionGuard.__init__``."""

    hits_not_loaded: int
    # HITs of this step no load took yet: key -> request id.
    _unloaded: dict[Any, str]
    # Load jobs in flight: job id -> its keys.
    _load_jobs: dict[int, Collection[Any]]
    _last_log: float

    def _rounds_waiting(self, view: PrimaryView) -> bool:
        """Whether no round has anything for ``_pin_landed`` or
        ``_expire_idle`` to do: each waits on keys all in promotions in
        flight (of the CPU tier's current generation), or holds no pin."""
        generation = None
        for rnd in self._rounds.values():
            landing = rnd.landing
            if landing:
                if rnd.in_flight_n != len(landing):
                    return False
                if generation is None:
                    generation = view.generation()
                if rnd.generation != generation:
                    return False
            elif rnd.pinned and not rnd.closed:
                return False
        return True

    def _count_unloaded(self) -> None:
        """End of a step: the HITs no load took are counted (and warned of,
        at most once a minute); a round without a CPU tier view closes."""
        rounds = self._rounds
        n = len(self._unloaded)
        reqs = set(self._unloaded.values())
        self._unloaded.clear()
        self.hits_not_loaded += n
        self._not_logged += n
        self._not_logged_reqs += len(reqs)
        if self._view is None:
            for req_id in reqs:
                rnd = rounds.get(req_id)
                if rnd is not None:
                    rnd.closed = True
        now = time.monotonic()
        if now - self._last_log >= NOT_LOADED_LOG_INTERVAL_S:
            self._last_log = now
            self._warn_not_loaded()

    def _pin_landed(self) -> None:
        """Pin the planned chunks that became ready since (landed promotions,
        finished writes); forget those that are gone (a failed read)."""
        view = self._view
        if view is None:
            return
        generation = None
        for rnd in self._rounds.values():
            if not rnd.landing:
                continue
            if generation is None:
                generation = view.generation()
            if rnd.generation != generation:
                rnd.pinned.clear()
                rnd.landing.clear()
                continue
            if rnd.in_flight_n == len(rnd.landing):
                continue  # all of it still in promotions in flight
            # A key of a promotion in flight stays PENDING until load_finished.
            if self._load_jobs:
                rest: Iterable[Any] = rnd.landing.difference(*self._load_jobs.values())
                if not rest:
                    # Nothing of it can be ready before a load_finished, which
                    # clears this (as a landing that grows does): until then
                    # a check per step, not this set difference.
                    rnd.in_flight_n = len(rnd.landing)
                    continue
            else:
                rest = list(rnd.landing)
            ready = []
            state = self._state
            for key in rest:
                where = state(key)
                if where == READY:
                    ready.append(key)
                    rnd.landing.discard(key)
                elif where == ABSENT:
                    rnd.landing.discard(key)
            if ready:
                view.pin(ready, rnd.ctx)
                rnd.pinned.update(ready)

    def _close(self, rnd: _Round) -> None:
        self._release(rnd)
        rnd.closed = True
        rnd.planned = set()

    def _release(self, rnd: _Round) -> None:
        view = self._view
        if rnd.pinned and view is not None and view.generation() == rnd.generation:
            view.unpin(rnd.pinned, rnd.ctx)
        rnd.pinned = set()
        rnd.landing = set()
        rnd.in_flight_n = -1
