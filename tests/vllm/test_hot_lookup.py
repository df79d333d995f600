"""The tier's native lookup (``nvmetier._table.HotRequest`` set as the
instance's ``lookup``, as ``NvmeTierManager`` wires it) answers as the
Python path it replaced, under vLLM's real orchestrator.

- Random schedules (the property test's, ``tests/vllm/walk_model.py``) run
  twice: on a disk tier whose lookup is the guard's HotRequest, and on one
  whose lookup is the Python inline path with a guard that notes the hot
  request's HITs as not loaded when it cools them (the bookkeeping before the
  guard set them aside as a pending list). Load jobs are also noted with key
  lists other than the HITs (a part of them, more, reordered, a tuple, an
  iterator; the disk reads the real job): every lookup's answer, the guard's
  counters (``hits_not_loaded``) and its not-yet-loaded HITs after every job,
  the tokens each request loaded and every disk read must be the same.
  ``NvmeTierManager``'s own instance is checked by
  ``tests/vllm/test_plan_leases.py`` and the bench smoke test.
- vLLM's interface names the parameters ``(key, req_context)``: a call by
  keyword answers as a positional one (it reached the guard's function,
  whose second parameter was named ``ctx``: a TypeError on the scheduler
  thread).
- A subclass of ``NvmeTierManager`` that overrides ``lookup`` keeps it (the
  instance's HotRequest shadowed it: the override never ran).

About 3 s (``NVMETIER_SLOW=1``: 10x the schedules).
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext

from nvmetier.vllm import NvmeTierManager
from nvmetier.vllm.cpu_view import PENDING
from nvmetier.vllm.harness import key_of, record_positions
from nvmetier.vllm.promotion import PromotionGuard
from tests.vllm import test_promotion_property as prop
from tests.vllm.conftest import nvme_tier
from tests.vllm.walk_model import HIT, MISS, MemoryTier

pytestmark = pytest.mark.timeout(300)

SCHEDULES = 1500 if os.environ.get("NVMETIER_SLOW") else 150


class EagerGuard(PromotionGuard):
    """The guard with the bookkeeping it had before its pending list: a
    cooled request's HITs are noted as not loaded at once."""

    def _cool(self) -> None:
        super()._cool()
        if self._pending:
            self._note_pending()


def _mangled(rng: random.Random, keys: list[bytes]) -> Any:
    """``keys`` as a load job vLLM did not submit might list them."""
    keys = list(keys)
    choice = rng.randrange(8)
    if choice == 0:
        return keys[: rng.randrange(len(keys) + 1)]
    if choice == 1:
        return keys[rng.randrange(len(keys) + 1) :]
    if choice == 2:
        return [*keys, os.urandom(8)]
    if choice == 3:
        rng.shuffle(keys)
        return keys
    if choice == 4:
        return tuple(keys)
    if choice == 5:
        return iter(keys)
    if choice == 6:
        return [os.urandom(8), *keys]
    return []


class _Logged(MemoryTier):
    """Logs every answer and the guard's state after every load job; notes
    some jobs to the guard with other key lists (the disk reads the job)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[Any] = []
        self._rng = random.Random(1)

    def submit_load(self, job_metadata: Any) -> None:
        rng, guard = self._rng, self.guard
        if rng.random() < 0.2:  # a further note_loaded, of any iterable
            guard.note_loaded(_mangled(rng, job_metadata.keys))
        keys = job_metadata.keys
        if rng.random() < 0.3:
            keys = _mangled(rng, keys)
            if not isinstance(keys, (list, tuple)):
                keys = list(keys)
        guard.note_load_job(job_metadata.job_id, keys, job_metadata.req_context)
        self.reads.extend((self._step, k) for k in job_metadata.keys)
        self._jobs.append((self._step + 1 + self.read_delay, job_metadata, True))
        # The HITs not loaded (what the step's end counts), as noted and as
        # still set aside: the same, and nothing set aside, once a job is noted.
        pending = [(list(hits), req_id) for hits, req_id in guard._pending]
        self.log.append(("job", guard.stats(), dict(guard._unloaded), pending))


class PythonLookupTier(_Logged):
    """The Python inline path (``MemoryTier.lookup``) and the eager guard."""

    guard_class = EagerGuard

    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        result = super().lookup(key, req_context)
        self.log.append((self._step, req_context.req_id, key, result))
        return result


class NativeLookupTier(_Logged):
    """The guard's HotRequest answers, its fallback the guard's function."""

    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        if not self._wired or not self.answers:
            result = super().lookup(key, req_context)  # wires the guard
            hot = self._hot
            if hot is not None:
                hot.hit, hot.miss, hot.fallback = HIT, MISS, self._answer
        else:
            result = self._hot(key, req_context)
            if result is HIT:
                self._answered_hit.add(key)
        self.log.append((self._step, req_context.req_id, key, result))
        return result


def _outcome(seed: int, tier_type: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ...]:
    monkeypatch.setattr(prop, "TIER", {"type": tier_type, "module_path": __name__})
    model = prop._run(seed, prop._scenario(seed), disk=True)
    try:
        tier = model.tier
        assert isinstance(tier, _Logged)
        guard = tier.guard
        tokens = [(r.req_id, r.loaded_tokens) for r in model.requests]
        return tier.log, tokens, guard.stats(), guard.hits_not_loaded, tier.reads, tier.hits_leased
    finally:
        model.shutdown()


def test_the_native_lookup_answers_and_counts_as_the_python_path(monkeypatch) -> None:
    leased = not_loaded = 0
    for seed in range(SCHEDULES):
        python = _outcome(seed, "PythonLookupTier", monkeypatch)
        native = _outcome(seed, "NativeLookupTier", monkeypatch)
        names = ("lookups and jobs", "tokens", "stats", "hits_not_loaded", "reads", "leased HITs")
        for name, want, got in zip(names, python, native, strict=True):
            assert got == want, f"seed {seed}: {name} differ"
        leased += native[5]
        not_loaded += native[3]
    # The schedules took both paths under test.
    assert leased > 0 and not_loaded > 0


def test_a_lookup_by_keyword_answers_as_a_positional_one(make_engine) -> None:
    eng = make_engine(cpu_chunks=32)
    tier = eng.tiers[0]
    keys = [key_of(i) for i in range(8)]
    eng.store_all(keys)
    results = {}
    for how in ("positional", "keyword", "mixed"):
        eng.reset_primary()
        ctx = ReqContext(req_id=how)
        record_positions(ctx, keys, eng.tokens_per_chunk)
        with eng.manager.lock:
            eng.manager.on_new_request(ctx)
            lookup = tier.lookup
            got = []
            for key in keys:
                if how == "positional":
                    got.append(lookup(key, ctx))
                elif how == "keyword":
                    got.append(lookup(key=key, req_context=ctx))
                else:
                    got.append(lookup(key, req_context=ctx))
            # A second lookup of a key answered HIT is a MISS, however asked.
            got.append(lookup(key=keys[1], req_context=ctx))
            eng.manager.on_request_finished(ctx)
        results[how] = got
    assert results["positional"] == [LookupResult.HIT] * 8 + [LookupResult.MISS]
    assert results["keyword"] == results["positional"]
    assert results["mixed"] == results["positional"]


def test_the_tier_instance_lookup_is_the_guards_hot_request(tmp_path, make_engine) -> None:
    # What the tests above stand for: NvmeTierManager's instance lookup is the
    # guard's HotRequest, wired to map its fallback to vLLM's HIT or MISS.
    eng = make_engine([nvme_tier(str(tmp_path / "kv"))])
    tier = eng.tiers[0]
    hot = tier._guard.hot
    assert tier.lookup is hot
    assert hot.hit is LookupResult.HIT and hot.miss is LookupResult.MISS
    assert hot.fallback == tier._answer


def _guard_steps(guard_class: type[PromotionGuard], seed: int) -> list[Any]:
    """Random steps of several requests on a guard over ``FakeView``, looked
    up through its HotRequest (wired as NvmeTierManager wires it), each step's
    jobs of any shape: everything the guard answered and counted."""
    from tests.vllm.test_plan_leases import FakeView

    rng = random.Random(seed)
    pool = [key_of(i) for i in range(24)]
    on_disk = {k for k in pool if rng.random() < 0.9}
    view = FakeView()
    guard = guard_class(1000, groups=((0, 16, None),))
    many = lambda batch: bytes(k in on_disk for k in batch)  # noqa: E731
    guard.attach(view, on_disk.__contains__, many, many)  # type: ignore[arg-type]
    hot = guard.hot
    hot.hit, hot.miss = True, False
    guard_answer = guard.lookup_call(on_disk.__contains__)
    slow_hits = [0]

    def fallback(key: bytes, req_context: ReqContext) -> bool:
        hit = guard_answer(key, req_context)
        slow_hits[0] += hit
        return hit

    hot.fallback = fallback
    requests: list[tuple[ReqContext, list[bytes]]] = []
    log: list[Any] = []
    job_id = 0
    for step in range(rng.randint(1, 6)):
        for _ in range(rng.randint(0, 3)):  # arrivals: prompts that may share chunks
            start = rng.randrange(0, 12)
            keys = pool[start : start + rng.randint(1, 12)]
            ctx = ReqContext(req_id=f"s{seed}-{len(requests)}")
            record_positions(ctx, keys)
            guard.track(ctx)
            requests.append((ctx, keys))
        walked = rng.sample(requests, rng.randint(0, len(requests)))
        hits: dict[str, list[bytes]] = {}
        for ctx, keys in walked:
            got = hits[ctx.req_id] = []
            for key in keys[: rng.randint(1, len(keys))]:
                answer = hot(key, ctx)
                log.append((step, ctx.req_id, key, answer))
                if answer:
                    got.append(key)
                    if rng.random() < 0.8:  # else the CPU tier had no room for it
                        view.states[key] = PENDING  # the orchestrator's prepare_write
        for ctx, _keys in walked:  # vLLM's promotions, each of any shape
            job: Any = hits[ctx.req_id]
            shape = rng.randrange(7)
            if shape == 1:
                job = job[: rng.randrange(len(job) + 1)]
            elif shape == 2:
                job = job[rng.randrange(len(job) + 1) :]
            elif shape == 3:
                job = [*job, key_of(999)]
            elif shape == 4:
                job = rng.sample(job, len(job))
            elif shape == 5:
                job = tuple(job)
            elif shape == 6:
                continue  # not loaded (the request is not scheduled)
            if job:
                job_id += 1
                guard.note_load_job(job_id, job, ctx)
                log.append(("job", job_id, dict(guard._unloaded), guard.stats()))
        guard.end_step(tuple(c.req_id for c, _ in walked), ())
        log.append(("end", step, guard.hits_not_loaded, guard.stats(), dict(guard._unloaded)))
        for ctx, _keys in requests[:]:
            if rng.random() < 0.2:
                guard.finish(ctx.req_id)
                requests.remove((ctx, _keys))
    fast = sum(1 for e in log if len(e) == 4 and e[3] is True) - slow_hits[0]
    log.append(("HITs answered natively", fast))
    return log


def test_hits_set_aside_count_as_hits_noted_at_once() -> None:
    # Several hot requests a step, jobs that take all of a request's HITs,
    # part, more, reordered, a tuple, or none: the same answers and counts
    # as the guard that notes a cooled request's HITs at once.
    not_loaded = fast = 0
    for seed in range(SCHEDULES * 4):
        eager = _guard_steps(EagerGuard, seed)
        assert _guard_steps(PromotionGuard, seed) == eager, f"seed {seed}"
        not_loaded += eager[-2][2]
        fast += eager[-1][1]
    assert not_loaded > 0 and fast > 0


def test_a_subclass_that_overrides_lookup_keeps_its_own(tmp_path, make_engine) -> None:
    # The instance's HotRequest shadows the class's lookup: a subclass's
    # override (metrics, a filter) would never run.
    eng = make_engine(
        [{**nvme_tier(str(tmp_path / "kv")), "type": "CountingTier", "module_path": __name__}]
    )
    tier = eng.tiers[0]
    keys = [key_of(i) for i in range(4)]
    eng.store_all(keys)
    eng.reset_primary()
    assert set(eng.promote(keys).values()) == {LookupResult.HIT}
    assert tier.asked == keys


class CountingTier(NvmeTierManager):
    """A subclass with its own lookup (test_a_subclass_that_overrides_lookup_keeps_its_own)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asked: list[bytes] = []

    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        self.asked.append(key)
        return super().lookup(key, req_context)
