"""``_TierClock``: the CPU time a secondary tier costs, apart from vLLM's and the harness's.

Owns: ``_TierClock`` alone, the one home of the accounting the ``vllm`` and
``trace`` levels both use (each imports it from here; neither imports the
other). It wraps a tier instance's ``SecondaryTierManager`` methods; the
wrappers run on the thread that calls them (vLLM's scheduler thread, which
the bench plays) and add one clock read per call; nothing here blocks.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from nvmetier.bench.machine import _Cpu


class _TierClock:
    """CPU time a secondary tier costs, apart from vLLM's and the harness's.

    Every method of the ``SecondaryTierManager`` interface is wrapped on the
    instance (the orchestrator calls them through the instance) to add up the
    scheduler thread's CPU time spent inside them. The tier's own threads (our
    engine's I/O thread or pool, the ``fs`` tier's workers) are the process's
    other threads: in this benchmark every thread but the scheduler's belongs
    to the tier. So the tier's CPU = time inside its methods + (process CPU -
    scheduler-thread CPU). Scheduler thread only.
    """

    METHODS = (
        "lookup",
        "touch",
        "on_new_request",
        "on_request_finished",
        "on_schedule_end",
        "submit_store",
        "submit_load",
        "get_finished_jobs",
        "has_pending_work",
        "take_events",
        "drain_jobs",
        "serve_external_requests",
    )

    def __init__(self, tier: Any) -> None:
        self.inside_ns = 0
        self.calls = 0
        # Per method: [ns inside, calls] (the breakdown a phase reports).
        self.by_method: dict[str, list[int]] = {}
        self._tier = tier
        self.self_ns = self._calibrate()
        # Per wrapped name: what the instance itself held under it (a tier may
        # set a callable on the instance, as ours does for ``lookup``: it is
        # what vLLM calls, so it is what is timed), or None for a method of
        # the class.
        self._wrapped: dict[str, Any] = {}
        for name in self.METHODS:
            method = getattr(tier, name, None)
            if callable(method) and not getattr(method, "_tier_clock_wrapped", False):
                self._wrapped[name] = vars(tier).get(name)
                setattr(tier, name, self._wrap(method, name))

    def remove(self) -> None:
        """Unwrap the methods (before timing one of them directly)."""
        for name, own in self._wrapped.items():
            if own is None:
                delattr(self._tier, name)
            else:
                setattr(self._tier, name, own)
        self._wrapped = {}

    def _wrap(self, method: Callable, name: str = "") -> Callable:
        clock = time.thread_time_ns
        tally = self.by_method.setdefault(name, [0, 0]) if name else [0, 0]

        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return method(*args, **kwargs)
            finally:
                dt = clock() - t0
                self.inside_ns += dt
                self.calls += 1
                tally[0] += dt
                tally[1] += 1

        timed._tier_clock_wrapped = True  # type: ignore[attr-defined]
        return timed

    def _calibrate(self, n: int = 20000) -> float:
        """What one wrapped call adds to ``inside_ns`` by itself: the clock
        read (a syscall, ~0.3 us here) and the wrapper, timed around a no-op;
        the median of 5 rounds."""

        def noop() -> None:
            return None

        timed = self._wrap(noop)
        rounds = []
        for _ in range(5):
            before = self.inside_ns
            for _ in range(n):
                timed()
            rounds.append((self.inside_ns - before) / n)
        self.inside_ns = self.calls = 0
        return sorted(rounds)[2]

    def by_method_us(self, chunks: int) -> dict[str, dict[str, float]]:
        """Each method's share per chunk (timing cost subtracted) and its calls."""
        out = {}
        for name, (ns, calls) in sorted(self.by_method.items()):
            if calls:
                us = max(0.0, ns - calls * self.self_ns) / 1e3 / max(1, chunks)
                out[name] = {"us_per_chunk": round(us, 3), "calls": calls}
        return out

    def inside_corrected_s(self) -> float:
        """Time inside the tier's methods on vLLM's threads, less the
        timing's own cost per call (``self_ns``)."""
        return max(0.0, self.inside_ns - self.calls * self.self_ns) / 1e9

    def per_chunk_line(self, what: str, chunks: int) -> str:
        """The phase's vLLM-thread time inside the tier per chunk, timing cost
        subtracted (a line of the bench's output)."""
        us = self.inside_corrected_s() * 1e6 / max(1, chunks)
        parts = ", ".join(
            f"{name} {v['us_per_chunk']:.2f} ({v['calls']})"
            for name, v in self.by_method_us(chunks).items()
        )
        return (
            f"  vLLM's thread inside the tier: {us:.2f} us per chunk {what} "
            f"({self.calls} calls, {self.self_ns:.0f} ns of timing each subtracted)"
            f"\n    by method, us per chunk (calls): {parts}"
        )

    def report(self) -> dict[str, Any]:
        """The figures a phase reports (JSON ``extra``)."""
        return {
            "tier_cpu_on_scheduler_s": round(self.inside_ns / 1e9, 4),
            "tier_on_vllm_threads_corrected_s": round(self.inside_corrected_s(), 5),
            "tier_method_calls": self.calls,
            "timing_cost_per_call_ns": round(self.self_ns, 1),
        }

    def start(self) -> _Cpu:
        self.inside_ns = 0
        self.calls = 0
        for tally in self.by_method.values():
            tally[0] = tally[1] = 0
        return _Cpu()

    def tier_s(self, cpu: _Cpu, usr: float, sys_: float) -> float:
        """The tier's CPU seconds since ``start`` (call after ``cpu.stop``)."""
        other_threads = max(0.0, usr + sys_ - cpu.thread_s)
        return other_threads + self.inside_ns / 1e9
