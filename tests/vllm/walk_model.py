"""A model of vLLM's offloading scheduler over KV groups, driving the real
orchestrator, CPU tier and LRU policy, with a disk tier held in memory.

An independent statement of how vLLM 0.32/0.33 call the offloading manager,
written from ``OffloadingConnectorScheduler`` (``_lookup_complete_chunks``,
``_maximal_prefix_lookup``, ``_sliding_window_lookup``,
``update_state_after_alloc``, ``build_connector_meta``) and the core
scheduler's waiting-queue loop; it knows nothing of the promotion guard.
Covered: full-attention and sliding-window groups (a Mamba group walks as a
window of 1), several requests per step in arrival order, a GPU prefix-cache
head (the walk's start), requests the scheduler cannot place for lack of
GPU memory (it stops at the first such request), preemption, chunks pinned by
other loads, reads landing 0 to 2 steps late. Not covered: EAGLE groups,
partial tails, Mamba alignment, sync loads.

Per step:

1. each waiting request in order is walked (``walk``); a deferred one (None)
   stays waiting; a request the GPU cannot take stops the queue for this
   step (vLLM's FCFS ``break``); otherwise it is scheduled: with a hit it pins
   what it loads (``prepare_load``), per group the chunks from its start to
   the hit's end, or only the window's for a sliding-window group;
2. ``build_connector_meta``: requests that computed last step offer their
   chunks to the CPU tier (``prepare_store``), then the step ends
   (``on_schedule_end`` with the requests scheduled for the first time and the
   ones preempted);
3. the workers finish: loads complete (``complete_load``), stores complete and
   cascade (``complete_store``), requests that stored finish.

``MemoryTier`` is a secondary tier over a dict with the real
``PromotionGuard`` wired exactly as ``NvmeTierManager`` wires it (lookup ->
``lookup_call``: ``admits`` -> disk -> ``note_hit``, with its per-request fast
answer; ``submit_load`` -> ``note_loaded``;
``on_schedule_end`` -> ``end_step_call()``; ``on_request_finished`` ->
``finish_call()``; ``drain_jobs`` -> ``release_all``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingGroupConfig,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from nvmetier.vllm import compat
from nvmetier.vllm.cpu_view import PrimaryView, connector_groups, find_primary
from nvmetier.vllm.harness import make_config
from nvmetier.vllm.promotion import PromotionGuard, kv_groups

HIT, HIT_PENDING, MISS, RETRY = (
    LookupResult.HIT,
    LookupResult.HIT_PENDING,
    LookupResult.MISS,
    LookupResult.RETRY,
)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class GroupConfig(NamedTuple):
    """What the model's connector knows of a KV group (vLLM's
    ``GroupOffloadConfig`` names)."""

    group_idx: int
    tokens_per_chunk: int
    sliding_window_size_in_chunks: int | None


# ---------------------------------------------------------------- the disk tier
class MemoryTier(SecondaryTierManager):
    """A disk tier held in a dict: stores land at the next poll, loads after
    ``read_delay`` steps (0: the next poll)."""

    medium: ClassVar[Medium] = Medium.STORAGE
    tolerates_off_thread_polling: ClassVar[bool] = False
    # The guard's class (a test may run a variant of it).
    guard_class: ClassVar[type[PromotionGuard]] = PromotionGuard

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        *,
        answers: bool = True,
        promotion_guard: bool = True,
        promotion_fraction: float = 1.0,
        read_delay: int = 0,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.answers = answers
        self.disk: set[bytes] = set()
        self.read_delay = read_delay
        self._spec = offloading_spec
        self._step = 0
        self._jobs: list[tuple[int, TransferJob, bool]] = []  # (due step, job, is load)
        cpu_chunks = primary_kv_view.shape[0]
        self.guard = self.guard_class(
            cpu_chunks,
            promotion_fraction,
            enabled=promotion_guard,
            groups=kv_groups(offloading_spec, connector_groups()),
        )
        # As NvmeTierManager: the guard's end of step and finish in C while it
        # has no round open (its own methods otherwise).
        self._end_step = self.guard.end_step_call()
        self._finish = self.guard.finish_call()
        self._wired = False
        self.hits_leased = 0  # HITs answered from the plans' leases (count_hits)
        self._hot: Any = None
        self._answer: Callable[[bytes, ReqContext], bool] = lambda key, ctx: False
        self.reads: list[tuple[int, bytes]] = []  # (step, key) of every chunk read
        # HITs of this step: the orchestrator reserves their CPU slots at once
        # and submits the loads at the step's end.
        self._answered_hit: set[bytes] = set()

    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        if not self._wired:
            self._wired = True
            primary = find_primary(self._spec, self)
            if primary is not None:
                # As NvmeTierManager attaches its store: a promotion's plan
                # reads the disk and leases its HITs in one call.
                self.guard.attach(
                    PrimaryView(primary),
                    self.disk.__contains__,
                    self._on_disk_many,
                    self._on_disk_many,
                    self._count_hits,
                )
            # The tier's production path: admits, the disk, note_hit, with the
            # guard's per-request fast answer (as NvmeTierManager.lookup).
            self._answer = self.guard.lookup_call(self.disk.__contains__)
            self._hot = self.guard.hot
        if not self.answers:
            return MISS
        # NvmeTierManager.lookup's inline answer of a hot request's leased key.
        hot = self._hot
        if req_context is hot.ctx:
            leased = hot.leased
            if key in leased:
                leased.discard(key)
                hot.hits.append(key)
                self._answered_hit.add(key)
                return HIT
        if not self._answer(key, req_context):
            return MISS
        self._answered_hit.add(key)
        return HIT

    def _on_disk_many(self, keys: list[bytes]) -> bytes:
        disk = self.disk
        return bytes(k in disk for k in keys)

    def _count_hits(self, n: int) -> None:
        self.hits_leased += n

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._jobs.append((self._step + 1, job_metadata, False))

    def submit_load(self, job_metadata: TransferJob) -> None:
        self.guard.note_load_job(job_metadata.job_id, job_metadata.keys, job_metadata.req_context)
        self.reads.extend((self._step, k) for k in job_metadata.keys)
        self._jobs.append((self._step + 1 + self.read_delay, job_metadata, True))

    def loading(self) -> set[bytes]:
        """Keys of the promotions in flight (or reserved this step)."""
        keys = {k for _due, job, is_load in self._jobs if is_load for k in job.keys}
        return keys | self._answered_hit

    def get_finished_jobs(self) -> Iterable[JobResult]:
        done = [(j, is_load) for due, j, is_load in self._jobs if due <= self._step]
        self._jobs = [(due, j, is_load) for due, j, is_load in self._jobs if due > self._step]
        out = []
        for job, is_load in done:
            if is_load:
                ok = [k for k in job.keys if k in self.disk]
                success = len(ok) == len(job.keys)
                self.guard.load_finished(job.job_id, success, None if success else ok)
                out.append(JobResult(job.job_id, success, None if success else ok or None))
            else:
                if self.answers:
                    self.disk.update(job.keys)
                out.append(JobResult(job.job_id, True))
        return out

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self.guard.track(req_context)
        return RequestOffloadingContext()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._end_step(context.new_req_ids, context.preempted_req_ids)
        self._answered_hit.clear()
        self._step += 1

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._finish(req_context.req_id)

    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    def drain_jobs(self) -> None:
        self.guard.release_all()
        self._step += 10

    def take_events(self) -> Iterable[OffloadingEvent]:
        return ()

    def shutdown(self) -> None:
        self.guard.release_all()


# ---------------------------------------------------------------- requests
@dataclass
class Request:
    req_id: str
    ctx: ReqContext
    num_tokens: int
    keys: dict[int, list[bytes]]  # group index -> chunk keys
    computed: int  # tokens in the GPU prefix cache (the walk's start)
    arrival: int
    scheduled_step: int | None = None
    loaded_tokens: int | None = None  # tokens its (first) load brought
    loads: list[list[bytes]] = field(default_factory=list)
    baseline: int | None = None  # what the CPU tier alone gave its first walk
    first_walk_step: int | None = None
    # What the CPU tier alone gave the walk that scheduled it (the answer with
    # no disk tier, had vLLM's own stores evicted part of ``baseline`` while
    # it waited for GPU memory: those evictions happen without a disk tier too).
    baseline_at_schedule: int | None = None
    stored: bool = False
    finished: bool = False
    preempted: bool = False
    loading: list[bytes] = field(default_factory=list)


class WalkModel:
    """Steps the real orchestrator the way vLLM's scheduler does, over
    ``groups`` (see the module docstring)."""

    def __init__(
        self,
        groups: Sequence[GroupConfig],
        *,
        cpu_chunks: int,
        tier: dict[str, Any] | None,
        rng: random.Random,
        p_unschedulable: float = 0.0,
        p_preempt: float = 0.0,
        p_pin: float = 0.0,
        chunk_bytes: int = 4096,
        reads_land_in_step: bool = False,
        store_whole_windows: bool = False,
    ) -> None:
        self.groups = tuple(groups)
        self.reads_land_in_step = reads_land_in_step
        # vLLM stores a sliding-window group's chunks near the prompt's end
        # only (or every --prefix-cache-retention-interval tokens); True
        # stores them all, as a retention interval of one chunk would.
        self.store_whole_windows = store_whole_windows
        self.rng = rng
        self.p_unschedulable = p_unschedulable
        self.p_preempt = p_preempt
        self.p_pin = p_pin
        self.full = [g for g in self.groups if g.sliding_window_size_in_chunks is None]
        windows = [g for g in self.groups if g.sliding_window_size_in_chunks is not None]
        windows.sort(key=lambda g: -(g.sliding_window_size_in_chunks or 0))
        self.windows = windows
        self.config = _Config(self.groups)
        offload_config = make_config(
            [tier] if tier is not None else [],
            chunk_bytes=chunk_bytes,
            cpu_chunks=cpu_chunks,
            model="walk-model",
            engine_id=f"walk-{rng.getrandbits(40):x}",
            groups=[
                _group_config(g.tokens_per_chunk, (f"layers.{g.group_idx}",), g)
                for g in self.groups
            ],
        )
        # As vLLM's connector scheduler: its config first, then the manager
        # (whose tiers read the config's groups from this frame).
        self.spec = TieringOffloadingSpec(offload_config)
        self.manager = compat.ensure_manager_lock(self.spec.get_manager())
        self.primary = self.manager.primary_tier
        self.tier: Any = self.manager.secondary_tiers[0] if self.manager.secondary_tiers else None
        self.step_no = 0
        self.waiting: list[Request] = []
        self.requests: list[Request] = []
        self._computed_last_step: list[Request] = []
        self._being_loaded: set[bytes] = set()
        self._external_pins: list[tuple[int, ReqContext, list[bytes]]] = []
        self._preempted_now: list[str] = []
        self.store_evictions: list[tuple[int, bytes]] = []  # (step, key) by vLLM's stores

    # ------------------------------------------------------------ requests
    def add(
        self, req_id: str, chunk_hashes: Sequence[bytes], extra_tokens: int, computed: int
    ) -> Request:
        tpc = min(g.tokens_per_chunk for g in self.groups)
        ctx = ReqContext(req_id=req_id)
        num_tokens = len(chunk_hashes) * tpc + extra_tokens
        keys = {}
        for g in self.groups:
            per = g.tokens_per_chunk // tpc
            n = len(chunk_hashes) // per
            keys[g.group_idx] = [
                make_offload_key(chunk_hashes[(i + 1) * per - 1], g.group_idx) for i in range(n)
            ]
            # update_offload_keys: the end token of every key.
            for i, key in enumerate(keys[g.group_idx]):
                ctx.set_offload_key_position(key, (i + 1) * g.tokens_per_chunk)
        with self.manager.lock:
            self.manager.on_new_request(ctx)
        r = Request(req_id, ctx, num_tokens, keys, computed, self.step_no)
        self.waiting.append(r)
        self.requests.append(r)
        return r

    # ------------------------------------------------------------ the walk
    def walk(self, r: Request, lookup: Callable[[bytes], LookupResult]) -> int | None:
        """``_lookup_complete_chunks``: tokens past ``r.computed`` to load,
        0, or None (asked again next step)."""
        computed = r.computed
        max_hit = r.num_tokens
        if self.windows:
            max_hit -= 1  # the last token is recomputed for its logits
        num_hit = 0
        defer = False
        order = [*self.full, *self.windows]
        todo = order
        while todo:
            looked_up_window = False
            batch, todo = todo, []
            for g in batch:
                tpc = g.tokens_per_chunk
                keys = r.keys[g.group_idx]
                max_hit = min(max_hit, len(keys) * tpc)
                if max_hit - computed < tpc:
                    return 0
                n_chunks = min(cdiv(max_hit, tpc), len(keys))
                start = computed // tpc
                segment = keys[start:n_chunks]
                window = g.sliding_window_size_in_chunks
                hits = (
                    _prefix_lookup(segment, lookup)
                    if window is None
                    else _window_lookup(segment, window, lookup)
                )
                if hits == 0:
                    return 0
                if hits is None:
                    defer = True
                else:
                    max_hit = min(max_hit, tpc * (start + hits))
                new_hit = max_hit - computed
                if new_hit < tpc:
                    return 0
                if new_hit < num_hit:
                    if defer:
                        defer = False
                        todo = order
                    elif looked_up_window and not todo:
                        todo = list(self.windows)
                looked_up_window |= window is not None
                num_hit = new_hit
        if defer:
            return None
        if any(k in self._being_loaded for k in self.load_keys(r, num_hit)):
            return None
        return num_hit

    def required_tokens(self, r: Request) -> int:
        """What the request must load at least: what the CPU tier alone gave
        its first walk, unless vLLM's own stores evicted part of that before
        vLLM scheduled it (they would without a disk tier too); then what the
        CPU tier alone gave the walk that scheduled it, if less."""
        assert r.baseline is not None and r.first_walk_step is not None
        keys = set(self.load_keys(r, r.baseline)) if r.baseline else set()
        last = r.scheduled_step if r.scheduled_step is not None else self.step_no
        lost = any(
            r.first_walk_step <= step < last and key in keys for step, key in self.store_evictions
        )
        if lost and r.baseline_at_schedule is not None:
            return min(r.baseline, r.baseline_at_schedule)
        return r.baseline

    def load_keys(self, r: Request, hit: int) -> list[bytes]:
        """What ``update_state_after_alloc`` loads for a hit of ``hit`` tokens."""
        end = r.computed + hit
        out: list[bytes] = []
        for g in self.groups:
            tpc = g.tokens_per_chunk
            stop = cdiv(end, tpc)
            lo = r.computed // tpc
            window = g.sliding_window_size_in_chunks
            if window is not None:
                lo = max(lo, stop - window)
            out.extend(r.keys[g.group_idx][lo:stop])
        return out

    def cpu_only(self, key: bytes) -> LookupResult:
        """The CPU tier's answer with no disk tier: a GPU store in flight
        counts as a hit (what the request would load once it lands), a
        promotion in flight does not (no disk tier, no promotion)."""
        result = self.primary.lookup(key, _PROBE)
        loading = getattr(self.tier, "loading", None)
        if result is HIT_PENDING and loading is not None and key in loading():
            return MISS
        return HIT if result in (HIT, HIT_PENDING) else MISS

    # ------------------------------------------------------------ a step
    def step(self) -> None:
        self.step_no += 1
        m = self.manager
        new_ids: list[str] = []
        loads: list[Request] = []
        with m.lock:
            self._maybe_pin_external()
            still: list[Request] = []
            queue_open = True
            for r in self.waiting:
                if not queue_open:
                    still.append(r)
                    continue
                base = self.walk(r, self.cpu_only) or 0
                if r.baseline is None:
                    r.baseline = base
                    r.first_walk_step = self.step_no
                hit = self.walk(r, lambda k, r=r: m.lookup(k, r.ctx))
                if hit is None:
                    still.append(r)
                    continue
                if self.rng.random() < self.p_unschedulable:
                    still.append(r)  # no GPU memory: FCFS stops here this step
                    queue_open = False
                    continue
                if r.scheduled_step is None:
                    new_ids.append(r.req_id)
                    r.baseline_at_schedule = base
                r.scheduled_step = self.step_no
                if r.loaded_tokens is None:
                    r.loaded_tokens = hit
                if hit:
                    keys = self.load_keys(r, hit)
                    m.prepare_load(keys, r.ctx)
                    r.loading = keys
                    r.loads.append(keys)
                    self._being_loaded.update(keys)
                    loads.append(r)
            self.waiting = still
            # Requests that computed last step store, unless preempted now.
            stores: list[tuple[Request, list[bytes]]] = []
            preempted: list[str] = []
            for r in self._computed_last_step:
                if self.rng.random() < self.p_preempt:
                    r.preempted = True
                    r.computed = 0  # its GPU blocks are gone
                    self.waiting.insert(0, r)
                    preempted.append(r.req_id)
                    continue
                offer = [k for g in self.groups for k in self._store_keys(r, g)]
                out = m.prepare_store(offer, r.ctx)
                if out is not None:
                    self.store_evictions.extend((self.step_no, k) for k in out.evicted_keys)
                if out is not None and out.keys_to_store:
                    stores.append((r, list(out.keys_to_store)))
                r.stored = True
            done = [r for r in self._computed_last_step if not r.preempted]
            for r in self._computed_last_step:
                r.preempted = False
            self._computed_last_step = [
                r for r in self.requests if r.scheduled_step == self.step_no
            ]
            m.on_schedule_end(ScheduleEndContext(tuple(new_ids), tuple(preempted)))
        if self.reads_land_in_step and hasattr(self.tier, "store"):
            self.tier.store.wait_idle(timeout_s=10.0)  # a real tier's reads land
        with m.lock:
            for r in loads:
                m.complete_load(r.loading, r.ctx)
                self._being_loaded.difference_update(r.loading)
                r.loading = []
            for r, keys in stores:
                m.complete_store(keys, r.ctx)
            for r in done:
                r.finished = True
                m.on_request_finished(r.ctx)
            self._release_external_pins()

    def _store_keys(self, r: Request, g: GroupConfig) -> list[bytes]:
        keys = r.keys[g.group_idx]
        window = g.sliding_window_size_in_chunks
        if window is None or self.store_whole_windows:
            return keys
        return keys[max(0, len(keys) - window - 1) :]

    def _maybe_pin_external(self) -> None:
        """Another request's load pins a few ready chunks for 1-2 steps."""
        if self.rng.random() >= self.p_pin:
            return
        ready = [
            k
            for r in self.rng.sample(self.requests, min(3, len(self.requests)))
            for ks in r.keys.values()
            for k in ks
            if self.primary.lookup(k, _PROBE) is HIT
        ]
        if not ready:
            return
        pick = self.rng.sample(ready, min(len(ready), self.rng.randint(1, 3)))
        ctx = ReqContext(req_id=f"pin-{self.step_no}")
        self.manager.prepare_load(pick, ctx)
        self._external_pins.append((self.step_no + self.rng.randint(1, 2), ctx, pick))

    def _release_external_pins(self) -> None:
        keep = []
        for due, ctx, keys in self._external_pins:
            if due <= self.step_no:
                self.manager.complete_load(keys, ctx)
            else:
                keep.append((due, ctx, keys))
        self._external_pins = keep

    def run(self, max_steps: int) -> None:
        for _ in range(max_steps):
            if all(r.finished for r in self.requests) and not self._external_pins:
                break
            self.step()

    def settle(self, steps: int = 4) -> None:
        """Let cascades, late reads and other loads' pins finish."""
        self.p_pin = 0.0
        for _ in range(steps):
            self.step()

    def shutdown(self) -> None:
        self.manager.shutdown()


class _Config:
    def __init__(self, groups: tuple[GroupConfig, ...]) -> None:
        self.kv_group_configs = groups


def _group_config(tpc: int, layers: tuple[str, ...], g: GroupConfig) -> OffloadingGroupConfig:
    """vLLM 0.33's group config carries the window; 0.32's has no such field."""
    fields = getattr(OffloadingGroupConfig, "__dataclass_fields__", {})
    if "sliding_window_size_in_chunks" in fields:
        return OffloadingGroupConfig(tpc, layers, g.group_idx, g.sliding_window_size_in_chunks)  # type: ignore[call-arg,unused-ignore]
    return OffloadingGroupConfig(tpc, layers, g.group_idx)


_PROBE = ReqContext(req_id="walk-model-probe")


def _prefix_lookup(keys: Sequence[bytes], lookup: Callable[[bytes], LookupResult]) -> int | None:
    """``_maximal_prefix_lookup``."""
    hits = 0
    defer = False
    for key in keys:
        result = lookup(key)
        if result in (HIT, HIT_PENDING):
            hits += 1
            defer |= result is HIT_PENDING
        elif result is RETRY:
            defer = True
        else:
            break
    return None if defer else hits


def _window_lookup(
    keys: Sequence[bytes], window: int, lookup: Callable[[bytes], LookupResult]
) -> int | None:
    """``_sliding_window_lookup``: the end of the last run of ``window``
    hits, scanning from the end; 0 on a miss, None when deferred."""
    defer = False
    pending = False
    run = 0
    for idx in range(len(keys) - 1, -1, -1):
        result = lookup(keys[idx])
        if result is HIT:
            run += 1
        elif result is HIT_PENDING:
            pending = True
            run += 1
        elif result is RETRY:
            defer = True
            run = 0
            pending = False
        else:
            run = 0
            pending = False
        if run == window:
            return None if defer or pending else idx + window
    return None if defer or pending else run
