"""The promotion guard's plan leases its HITs in one native call
(``BlockStore.lease_many_call``), under vLLM's real orchestrator: the walk's
lookups of those keys ask the disk nothing, the HITs are still counted, the
leases not loaded end with the step, a key the read could not lease is not a
HIT, and a sealed store and write admission take the same path; and rounds
waiting only on promotions in flight are not asked about every step. About
3 s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

from nvmetier.vllm import METRIC_PREFIX
from nvmetier.vllm.cpu_view import ABSENT, PENDING, READY
from nvmetier.vllm.harness import key_of, record_positions
from tests.vllm.conftest import new_key, nvme_tier

pytestmark = pytest.mark.timeout(120)


class Calls:
    """Counts the disk's per-key lookups and the plan's leasing reads."""

    def __init__(self) -> None:
        self.lookups = 0
        self.leased: list[list[bytes]] = []

    def wrap_tier(self, tier: Any, before_lease: Callable[[list[bytes]], None] | None = None):
        """Wrap ``tier``'s disk calls (before its first lookup wires them)."""
        lookup = tier._lookup

        def counted_lookup(key: bytes) -> bool:
            self.lookups += 1
            return bool(lookup(key))

        tier._lookup = counted_lookup
        store = tier.store
        lease_many_call = store.lease_many_call

        def wrapped_call():
            real = lease_many_call()

            def lease_many(keys: list[bytes]) -> bytes:
                self.leased.append(list(keys))
                if before_lease is not None:
                    before_lease(keys)
                return real(keys)

            return lease_many

        store.lease_many_call = wrapped_call


def hits_counted(tier: Any) -> float:
    values = tier.get_stats().reduce()
    return float(values.get(f"{METRIC_PREFIX}hits:{(tier.tier_label,)}", 0))


@pytest.mark.parametrize("kind", ["plain", "sealed", "admission"])
def test_a_planned_request_is_read_and_leased_in_one_call_and_loads_every_chunk(
    tmp_path, make_engine, kind
) -> None:
    if kind == "sealed":
        pytest.importorskip("nvmetier._crypto")
    extra: dict[str, Any] = {
        "plain": {},
        "sealed": {"encryption": {"key_file": new_key(tmp_path)}},
        "admission": {"admit_after_lookups": 1},
    }[kind]
    eng = make_engine([nvme_tier(str(tmp_path / "kv"), **extra)], cpu_chunks=32)
    tier = eng.tiers[0]
    keys = [key_of(i) for i in range(24)]
    calls = Calls()
    eng.store_all([key_of(999)])  # the tier's first data call: its store is final
    eng.reset_primary()
    calls.wrap_tier(tier)
    if kind == "admission":  # asked for once (a MISS), then stored
        assert set(eng.promote(keys).values()) == {LookupResult.MISS}
        eng.reset_primary()
        calls.leased.clear()
        calls.lookups = 0
    eng.store_all(keys)
    assert all(tier.store.slot_of(k) is not None for k in keys)
    eng.reset_primary()
    before = hits_counted(tier)
    results = eng.promote(keys)
    eng.wait_idle()
    assert [results[k] for k in keys] == [LookupResult.HIT] * 24
    assert eng.verify(keys) == 24
    # One read of the disk, which leased them; no per-key lookup.
    assert calls.leased == [keys]
    assert calls.lookups == 0
    # Every HIT is counted as the per-key lookup counted it.
    assert hits_counted(tier) - before == 24


def test_leases_vllm_did_not_load_end_with_the_step(tmp_path, make_engine) -> None:
    """The plan leases all of a request's chunks; vLLM's walk takes only the
    first this step: the others cannot be invalidated until the step ends,
    and can after (their leases released as an unloaded HIT's are)."""
    eng = make_engine(cpu_chunks=32)
    tier = eng.tiers[0]
    keys = [key_of(i) for i in range(8)]
    eng.store_all(keys)
    eng.reset_primary()
    table = tier.store._table
    ctx = ReqContext(req_id="walk")
    record_positions(ctx, keys, eng.tokens_per_chunk)
    m = eng.manager
    with m.lock:
        m.on_new_request(ctx)
        assert m.lookup(keys[0], ctx) is not LookupResult.MISS  # planned, promoted
        assert not table.invalidate(keys[5])  # leased by the plan
        m.on_schedule_end(ScheduleEndContext((), ()))
    assert table.invalidate(keys[5])  # the step's leases are gone
    eng.wait_idle()
    assert eng.verify(keys[:1]) == 1
    with m.lock:
        m.on_request_finished(ctx)


def test_a_chunk_gone_before_the_plan_could_lease_it_is_not_a_hit(tmp_path, make_engine) -> None:
    """Another sharer removes a chunk just before the plan's read: the plan
    ends before it, and the walk loads the chunks before it only."""
    eng = make_engine(cpu_chunks=32)
    tier = eng.tiers[0]
    keys = [key_of(i) for i in range(12)]
    eng.store_all(keys)
    eng.reset_primary()
    table = tier.store._table
    calls = Calls()
    calls.wrap_tier(tier, before_lease=lambda batch: table.invalidate(keys[4]))
    results = eng.promote(keys)
    eng.wait_idle()
    assert [results[k] for k in keys[:4]] == [LookupResult.HIT] * 4
    assert results[keys[4]] is LookupResult.MISS
    assert eng.verify(keys[:4]) == 4
    assert calls.lookups == 0


class FakeView:
    """A CPU tier for the guard alone: what it holds, and what it is asked."""

    def __init__(self) -> None:
        self.states: dict[bytes, int] = {}
        self.asked: list[bytes] = []
        self.pinned: list[bytes] = []

    def state(self, key: bytes) -> int:
        self.asked.append(key)
        return self.states.get(key, ABSENT)

    def state_call(self) -> Callable[[bytes], int]:
        return self.state

    def residencies_call(self) -> Callable[[list[bytes]], list[int]]:
        return lambda keys: [self.states.get(k, ABSENT) for k in keys]

    def generation(self) -> int:
        return 0

    def room(self) -> int:
        return 1000

    def evictable(self, key: bytes) -> bool:
        return True

    def pin(self, keys: list[bytes], ctx: Any) -> None:
        self.pinned.extend(keys)

    def unpin(self, keys: Any, ctx: Any) -> int:
        return 0

    def make_ready(self, keys: list[bytes], ctx: Any) -> None:
        for key in keys:
            self.states[key] = READY


def planned_guard(keys: list[bytes], leases: bool = True):
    """A guard over ``FakeView`` whose request ``r`` planned ``keys`` (all
    on disk), looked every one up and had them promoted as job 1."""
    from nvmetier.vllm.promotion import PromotionGuard

    view = FakeView()
    hits: list[int] = []
    on_disk = set(keys)
    guard = PromotionGuard(1000, groups=((0, 16, None),))
    guard.attach(
        view,  # type: ignore[arg-type]
        on_disk.__contains__,
        lambda batch: bytes(k in on_disk for k in batch),
        (lambda batch: bytes(k in on_disk for k in batch)) if leases else None,
        hits.append,
    )
    ctx = ReqContext(req_id="r")
    record_positions(ctx, keys)
    disk_lookups: list[bytes] = []

    def disk_lookup(key: bytes) -> bool:
        disk_lookups.append(key)
        return key in on_disk

    lookup = guard.lookup_call(disk_lookup)
    for key in keys:
        if lookup(key, ctx):
            view.states[key] = PENDING  # the orchestrator's prepare_write
    return guard, view, ctx, hits, disk_lookups


def test_the_walk_answers_a_leased_plan_without_asking_the_disk_and_counts_its_hits() -> None:
    keys = [key_of(i) for i in range(6)]
    guard, _view, _ctx, hits, disk_lookups = planned_guard(keys)
    guard.end_step()
    assert disk_lookups == [] and sum(hits) == 6
    guard, _view, _ctx, hits, disk_lookups = planned_guard(keys, leases=False)
    guard.end_step()
    assert disk_lookups == keys and hits == []  # the disk's lookup counted them


def test_a_round_waiting_only_on_promotions_in_flight_is_not_asked_about_each_step() -> None:
    keys = [key_of(i) for i in range(6)]
    guard, view, ctx, _hits, _disk = planned_guard(keys)
    guard.note_load_job(1, keys, ctx)
    view.asked.clear()
    for _ in range(3):
        guard.end_step()
    assert view.asked == []  # all PENDING until load_finished: nothing to ask
    # The job lands but for one chunk: those landed are pinned at once, and
    # the next step asks about the one that failed (gone: forgotten).
    guard.load_finished(1, False, keys[:5])
    del view.states[keys[5]]  # vLLM drops the failed promotion's slot
    assert sorted(view.pinned) == sorted(keys[:5])
    guard.end_step()
    assert view.asked == [keys[5]]
    view.asked.clear()
    guard.end_step()
    assert view.asked == []
    assert guard.stats()["promotion_pins"] == 5


def test_a_round_with_a_chunk_in_no_job_is_still_asked_about() -> None:
    keys = [key_of(i) for i in range(6)]
    guard, view, ctx, _hits, _disk = planned_guard(keys)
    guard.note_load_job(1, keys[:4], ctx)  # two promotions not submitted yet
    view.asked.clear()
    guard.end_step()
    assert sorted(view.asked) == sorted(keys[4:])
    view.states[keys[4]] = READY  # landed some other way: pinned
    view.asked.clear()
    guard.end_step()
    assert sorted(view.asked) == sorted(keys[4:]) and keys[4] in view.pinned
    assert keys[5] not in view.pinned  # still PENDING


def test_a_dense_plan_of_whole_batches_on_disk_equals_the_per_chunk_pass() -> None:
    """The dense plan takes a batch all on disk (no chunk in the CPU tier,
    every one found) in one step: on random requests (CPU tier states, disk
    holes, budgets, room, CPU tier sizes, walk starts) it plans exactly what
    the per-chunk pass plans (the disk asked one key at a time)."""
    import random

    from nvmetier.vllm.promotion import PromotionGuard
    from nvmetier.vllm.promotion_plan import PLAN_BATCH, _Round

    rng = random.Random(29)
    for case in range(300):
        n = rng.choice([3, PLAN_BATCH - 1, PLAN_BATCH, PLAN_BATCH + 5, 2 * PLAN_BATCH + 7])
        keys = [key_of(case * 1000 + i) for i in range(n)]
        head = rng.randrange(0, 4)  # chunks the CPU tier holds first
        mixed = rng.random() < 0.3
        states = {}
        for i, key in enumerate(keys):
            if i < head or (mixed and rng.random() < 0.1):
                states[key] = rng.choice([READY, PENDING, READY + 1])
        on_disk = {k for k in keys if rng.random() > (0.02 if rng.random() < 0.5 else 0.0)}
        cpu_chunks = rng.choice([n // 2 + 1, n, 4 * n])
        fraction = rng.choice([0.1, 0.5, 1.0])
        room = rng.choice([0, 5, n // 2, 10 * n])
        promote = rng.random() < 0.9
        plans = []
        for fast in (True, False):
            view = FakeView()
            view.states = dict(states)
            view.room = lambda room=room: room  # type: ignore[method-assign]
            guard = PromotionGuard(cpu_chunks, fraction, groups=((0, 16, None),))
            many = (lambda batch, held=on_disk: bytes(k in held for k in batch)) if fast else None
            guard.attach(view, on_disk.__contains__, many, many)  # type: ignore[arg-type]
            ctx = ReqContext(req_id="r")
            record_positions(ctx, keys)
            rnd = _Round(ctx, 0)
            first = keys[min(head, n - 1)]
            guard._plan(rnd, first, promote=promote)
            plans.append(
                (
                    rnd.needed,
                    rnd.planned,
                    rnd.landing,
                    rnd.pinned,
                    view.pinned,
                    guard.requests_larger_than_cpu_tier,
                )
            )
        assert plans[0] == plans[1], case


def test_the_cpu_tier_is_read_from_vllms_lru_map_as_its_policy_reads_it(make_engine) -> None:
    """The guard reads vLLM's LRU policy's map directly (no frame per key):
    every answer is what the policy's own ``get`` says, for chunks absent,
    ready and ready but pinned, after a reset of the CPU tier too."""
    from nvmetier.vllm.cpu_view import PrimaryView, _policy_get

    eng = make_engine(cpu_chunks=16)
    primary = eng.manager.primary_tier
    policy = primary._policy
    view = PrimaryView(primary)
    keys = [key_of(i) for i in range(12)]
    assert _policy_get(policy) == policy.chunks.get  # vLLM's LRU: its map

    def by_policy(batch: list[bytes]) -> list[int]:
        chunks = [policy.get(k) for k in batch]
        return [
            ABSENT
            if c is None
            else PENDING
            if not c.is_ready
            else READY + 1
            if c.ref_cnt
            else READY
            for c in chunks
        ]

    eng.store_all(keys[:6])  # written, cascaded, ready in the CPU tier
    ctx = ReqContext(req_id="pins")
    with eng.manager.lock:
        primary.prepare_read(keys[:2], ctx)  # pinned
    want = by_policy(keys)
    assert want == [READY + 1] * 2 + [READY] * 4 + [ABSENT] * 6
    assert view.residencies_call()(keys) == want
    assert [view.residency_call()(k) for k in keys] == want
    assert [view.state_call()(k) for k in keys] == [READY] * 6 + [ABSENT] * 6
    assert view.residencies_call()(keys[6:]) == [ABSENT] * 6  # none held
    with eng.manager.lock:
        primary.complete_load(keys[:2], ctx)
    eng.reset_primary()
    assert view.residencies_call()(keys) == by_policy(keys) == [ABSENT] * 12
    eng.store_all(keys[6:8])
    assert view.residencies_call()(keys[6:9]) == by_policy(keys[6:9]) == [READY, READY, ABSENT]


def test_the_tier_answers_a_hot_requests_leased_keys_itself_each_once(make_engine) -> None:
    """After the plan (the request's first lookup), the tier's own ``lookup``
    answers the request's leased keys HIT without the guard's function; a
    key already answered HIT is a MISS if asked again in the step (as the
    guard answers it); the HITs are counted, and they leave the round's
    planned keys for its landing ones (a later plan does not count them
    again): at once, the dense plan's leased set being its planned set."""
    eng = make_engine(cpu_chunks=32)
    tier = eng.tiers[0]
    keys = [key_of(i) for i in range(8)]
    eng.store_all(keys)
    eng.reset_primary()
    ctx = ReqContext(req_id="walk")
    record_positions(ctx, keys, eng.tokens_per_chunk)
    m = eng.manager
    before = hits_counted(tier)
    with m.lock:
        m.on_new_request(ctx)
        assert tier.lookup(keys[0], ctx) is LookupResult.HIT  # the plan, through the guard
        answered: list[bytes] = []
        guard_answer = tier._answer

        def spy(key: bytes, req_ctx: Any) -> bool:
            answered.append(key)
            return guard_answer(key, req_ctx)

        tier._answer = spy
        assert [tier.lookup(k, ctx) for k in keys[1:6]] == [LookupResult.HIT] * 5
        assert answered == []  # the tier's own frame answered them
        assert tier.lookup(keys[3], ctx) is LookupResult.MISS  # once only
        assert answered == [keys[3]]
        rnd = tier._guard._rounds["walk"]
        assert not set(keys[1:6]) & rnd.planned
        assert set(keys[1:6]) <= rnd.landing
        tier.on_schedule_end(ScheduleEndContext((), ()))
        assert rnd.planned == set(keys[6:])
        assert rnd.hits == 6
        tier._answer = guard_answer
    assert hits_counted(tier) - before == 6
    with m.lock:
        tier.on_request_finished(ctx)
        tier.on_schedule_end(ScheduleEndContext((), ("walk",)))
