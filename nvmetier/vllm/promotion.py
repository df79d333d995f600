"""Which disk hits vLLM is told about: the promotion guard and the CPU tier check.

Owns ``PromotionGuard``: per request, which of its chunks the tier answers
HIT for, the CPU tier chunks it holds for the request while its promotions
land, and the count of HITs vLLM did not load. (The groups' layout and the
start-up size check live in ``nvmetier.vllm.sizing``, re-exported here.)

Threads: every method runs on vLLM's scheduler thread under the
orchestrator's lock (through ``NvmeTierManager``); nothing blocks, nothing
does I/O. The work is per request, not per key: the tier's lookup
(``lookup_call``) plans at a request's first lookup of a step, and answers
the request's further keys in that step from the plan's set.

Why a guard. vLLM loads a disk hit through the CPU tier: a HIT makes the
orchestrator reserve a CPU slot at once (``prepare_write``, evicting the least
recently used unpinned chunk) and answer the connector HIT_PENDING; the
connector then defers the request until a walk over its keys finds every one
in the CPU tier, and only that walk pins them (``prepare_load``). Everything a
request will load must therefore be in the CPU tier at once, and nothing pins
it while the request waits. Answering HIT for every chunk on disk (vLLM's own
tiers do) lets a request's promotions evict its own earlier chunks, another
waiting request's chunks, or the chunks it promoted the step before: a read
storm that loads nothing (issue 21), or fewer tokens than no disk tier.

The plan (per request, made at the first lookup of the request that reaches
the tier, from the CPU tier's state at that moment):

- The walk's start is where the request's CPU-resident run ends before that
  key (vLLM passes the start to no tier; a head in the GPU prefix cache that
  the CPU tier also holds is counted as the CPU's: a smaller plan, never a
  loss). The request's keys by KV group and chunk come from the positions
  vLLM's connector records (``cpu_view.request_keys``).
- For every end position T past the start, what a load at T needs, group by
  group exactly as vLLM's walk and ``update_state_after_alloc`` take it: a
  full-attention group every chunk from the start to T, a sliding-window
  group (Mamba counts as a window of 1) only its window before T. A T is
  possible when each of those chunks is in the CPU tier or on disk, and
  affordable when the disk-only ones (the promotions) fit in the request's
  budget (``promotion_fraction`` of the CPU tier) and in what the CPU tier can
  give without evicting anything the plan keeps: free plus evictable chunks,
  less the needed chunks it pins. The plan is the largest affordable T; if it
  loads no more than the CPU tier alone (no disk tier's answer), the request
  gets no HIT and loads that at once.
- The tier then answers HIT for exactly the plan's promotions (everything
  else of the request is a MISS), and pins the plan's chunks that are in the
  CPU tier (``prepare_read``, as a cascade does), and each promoted chunk as
  soon as it lands: nothing the request will load can be evicted by other
  requests' promotions or by stores, and its promotions evict only chunks no
  plan keeps. The request loads the whole plan at its first walk that finds
  it all in the CPU tier.
- The pins go when vLLM schedules the request (``ScheduleEndContext.
  new_req_ids``: its own ``prepare_load`` holds the chunks now), when it is
  preempted (``preempted_req_ids``: its next walk plans afresh) or finished,
  before vLLM resets the CPU tier (``drain_jobs``), or after ``HOLD_STEPS``
  steps with every promotion landed and the request still not scheduled (it
  waits for GPU memory, or was resumed after a preemption, which vLLM does
  not report as new): the round then ends and later lookups are MISS.
- A request whose walk in a later step reaches the tier with a key of its
  plan (a promotion failed, or the walk ended elsewhere than planned) plans
  again from what the CPU tier now holds, at most ``MAX_PLANS`` times; other
  keys are MISS. Over its life a request promotes at most its budget.

A HIT whose key is in no ``submit_load`` by the end of the step (``note_loaded``
never saw it) is a chunk vLLM found no CPU slot for: counted in
``hits_not_loaded`` and logged (at most once a minute) with what to do.

Without a view of the CPU tier (a tier built outside vLLM's tiering spec), the
guard keeps its earlier rule: one promotion round per request, in the step of
its first HIT, at most the budget less the request's chunks before the key.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from itertools import repeat
from operator import itemgetter
from typing import Any

from nvmetier.vllm.cpu_view import (
    ABSENT,
    READY,
    PrimaryView,
    key_positions,
    request_keys,
)
from nvmetier.vllm.sizing import (  # re-exported: the names this module always had
    check_cpu_tier_size,
    group_chunking,
    kv_groups,
    longest_request_chunks,
)

# A chunk neither in the CPU tier nor on disk (``_plan``'s classification).
NOWHERE = -1

logger = logging.getLogger("nvmetier.vllm")

# Seconds between two "hits not loaded" (or "request larger than the CPU
# tier") warnings; the count in between is summed.
NOT_LOADED_LOG_INTERVAL_S = 60.0
# Steps a request keeps its pins once all its promotions landed and it is
# still not scheduled.
HOLD_STEPS = 8
# Plans one request may make (the first and the re-plans after a lost key).
MAX_PLANS = 3


@dataclass
class _Round:
    """One request's promotion round."""

    ctx: Any
    step: int  # the step of its last plan (or, without a plan, of its first HIT)
    budget: int = 0  # without a plan: HITs it may get in that step
    hits: int = 0  # HITs answered (every round)
    closed: bool = False
    plans: int = 0
    planned: set[Any] = field(default_factory=set)  # keys to answer HIT
    needed: set[Any] = field(default_factory=set)  # keys the planned load takes
    pinned: set[Any] = field(default_factory=set)  # keys this round pinned
    landing: set[Any] = field(default_factory=set)  # needed keys to pin once ready
    generation: int = 0  # the CPU tier's generation of the pins
    idle_steps: int = 0
    protect_only: bool = False  # pins a waiting request's CPU chunks, no HIT


@dataclass(frozen=True)
class _Group:
    """One KV group of a request: its chunk size, window and keys by chunk."""

    index: int
    tokens_per_chunk: int
    window: int | None
    keys: list[Any]  # keys[i]: the key of chunk i (ending at (i + 1) * tokens_per_chunk)


class _Hot:
    """The request whose lookups ``lookup_call`` answers from its plan's set.

    Set after a lookup of a planned round that cannot plan again this step
    (see ``PromotionGuard._heat``); its HITs are kept in ``hits`` and moved
    into the round (count, landing, not-yet-loaded) by ``_cool``, which every
    other method of the guard calls first."""

    __slots__ = ("ctx", "hits", "planned", "req_id", "rnd")

    def __init__(self) -> None:
        self.ctx: Any = None
        self.req_id = ""
        self.rnd: _Round | None = None
        self.planned: set[Any] = set()
        self.hits: list[Any] = []


class PromotionGuard:
    """Answers HIT only for the disk hits vLLM will promote and load.

    Args:
        cpu_chunks: chunks of the CPU primary tier.
        fraction: share of them one request may promote over its life (0, 1].
        longest_request_chunks: chunks of one ``max_model_len`` request, for
            the warning (0 when unknown).
        chunk_bytes: bytes of one CPU tier chunk (for the warnings).
        tier_label: the tier's metric label (for the warnings).
        group_chunking: per KV group, ``(tokens per chunk, sliding window in
            chunks or None)``, in group order (default: from ``groups``).
        enabled: plan each request's HITs (False: every chunk on disk is a
            HIT, vLLM's own behaviour; HITs not loaded are still counted).
        groups: per KV group, ``(group index, tokens per chunk, window or
            None)``: the layout the plans use (default: ``group_chunking``
            numbered in order).
    """

    def __init__(
        self,
        cpu_chunks: int,
        fraction: float = 1.0,
        *,
        longest_request_chunks: int = 0,
        chunk_bytes: int = 0,
        tier_label: str = "",
        group_chunking: tuple[tuple[int, int | None], ...] = (),
        enabled: bool = True,
        groups: tuple[tuple[int, int, int | None], ...] = (),
    ) -> None:
        self.enabled = enabled
        self.cpu_chunks = cpu_chunks
        self.budget = max(1, int(cpu_chunks * fraction))
        self.hits_not_loaded = 0
        self.lookups_withheld = 0
        self.requests_larger_than_cpu_tier = 0
        self._longest = longest_request_chunks
        self._chunk_bytes = chunk_bytes
        self._tier_label = tier_label
        if not group_chunking:
            group_chunking = tuple((tpc, w) for _index, tpc, w in groups)
        self._groups = tuple((tpc, w) for tpc, w in group_chunking if tpc > 0)
        if not groups:
            groups = tuple((i, tpc, w) for i, (tpc, w) in enumerate(self._groups))
        self._layout = {g: (tpc, w) for g, tpc, w in groups if tpc > 0}
        self._step = 0
        self._rounds: dict[str, _Round] = {}
        # HITs answered this step that no submit_load took yet: key -> req_id.
        self._unloaded: dict[Any, str] = {}
        self._last_log = -math.inf
        self._not_logged = 0
        self._not_logged_reqs = 0
        self._last_size_log = -math.inf
        self._view: PrimaryView | None = None
        self._on_disk: Callable[[Any], bool] | None = None
        self._state: Callable[[Any], int] = _absent
        self._residency: Callable[[Any], int] = _absent
        self._pinned_step = -1
        # Requests vLLM has not scheduled yet (on_new_request, and again when
        # preempted): req_id -> context. Their CPU chunks are protected before
        # any promotion of a step (``_protect_waiting``).
        self._waiting: dict[str, Any] = {}
        self._protected_step = -1
        # Promotion jobs of planned rounds in flight: job id -> keys, and
        # their keys together (PENDING in the CPU tier until load_finished:
        # _pin_landed need not ask about them every step).
        self._load_jobs: dict[int, Collection[Any]] = {}
        self._in_flight: set[Any] = set()
        self._protect_spent: set[str] = set()
        self._hot = _Hot()

    # ------------------------------------------------------------ wiring
    def attach(self, view: PrimaryView, on_disk: Callable[[Any], bool]) -> None:
        """Plan from now on against the CPU tier ``view``; ``on_disk(key)``
        says whether the tier holds a key (no I/O)."""
        self._cool()
        self._view = view
        self._on_disk = on_disk
        self._state = view.state_call()
        self._residency = view.residency_call()

    # ------------------------------------------------------------ the tier's lookup
    def lookup_call(
        self,
        disk_lookup: Callable[[Any], Any],
        withheld: Callable[[Any], None] | None = None,
    ) -> Callable[[Any, Any], bool]:
        """The tier's whole answer to vLLM's ``lookup(key, ctx)`` as one
        function: ``admits``, then ``disk_lookup(key)`` (the disk's answer,
        truthy for a hit), then ``note_hit``; True for HIT. ``withheld(key)``,
        if given, is told of every key ``admits`` refused (the disk was not
        asked: a store's write admission counts it as asked for).

        Per request, not per key: the request's first lookup of a step takes
        the full path (its plan, the step's pins); every further lookup of the
        same request in that step, once it can plan no more, is one check of
        the plan's set (``_Hot``), the disk's answer for a planned key, and a
        list append for a HIT.
        """
        hot = self._hot

        def slow(key: Any, ctx: Any) -> bool:
            if not self.admits(key, ctx):
                if withheld is not None:
                    withheld(key)
                self._heat(ctx)
                return False
            hit = bool(disk_lookup(key))
            if hit:
                self.note_hit(key, ctx)
            self._heat(ctx)
            return hit

        if withheld is not None:

            def counted(key: Any, ctx: Any) -> bool:
                if ctx is hot.ctx:
                    planned = hot.planned
                    if key in planned:
                        if disk_lookup(key):
                            planned.discard(key)
                            hot.hits.append(key)
                            return True
                        return False
                    self.lookups_withheld += 1
                    withheld(key)
                    return False
                return slow(key, ctx)

            return counted

        def lookup(key: Any, ctx: Any) -> bool:
            if ctx is hot.ctx:
                planned = hot.planned
                if key in planned:
                    if disk_lookup(key):
                        planned.discard(key)
                        hot.hits.append(key)
                        return True
                    return False
                self.lookups_withheld += 1
                return False
            return slow(key, ctx)

        return lookup

    def _heat(self, ctx: Any) -> None:
        """Answer the request's next lookups from its plan's set, if no lookup
        of it can change the plan before the step ends: a planned round (not
        one that only protects) that planned this step, is closed, or made
        its last plan; the step's landed promotions already pinned."""
        if not self.enabled or self._view is None or self._pinned_step != self._step:
            return
        rnd = self._rounds.get(ctx.req_id)
        if rnd is None or not rnd.plans or rnd.protect_only:
            return
        if rnd.closed or rnd.step == self._step or rnd.plans >= MAX_PLANS:
            hot = self._hot
            hot.ctx = ctx
            hot.req_id = ctx.req_id
            hot.rnd = rnd
            hot.planned = rnd.planned

    def _cool(self) -> None:
        """Move the hot request's HITs into its round, as ``note_hit`` would
        have one by one, and stop answering from its set."""
        hot = self._hot
        if hot.ctx is None:
            return
        hits = hot.hits
        rnd = hot.rnd
        if hits and rnd is not None:
            rnd.hits += len(hits)
            rnd.landing.update(hits)
            self._unloaded.update(dict.fromkeys(hits, hot.req_id))
        hits.clear()
        hot.ctx = None
        hot.rnd = None
        hot.planned = set()

    # ------------------------------------------------------------ lookups
    def admits(self, key: Any, ctx: Any) -> bool:
        """Whether a lookup of ``key`` for request ``ctx`` may be answered HIT
        (if on disk).

        False (counted in ``lookups_withheld``) for every key outside the
        request's plan; the tier then answers MISS without asking the disk.
        """
        if self._hot.ctx is not None:
            self._cool()
        if not self.enabled:
            return True
        if self._view is None:
            return self._admits_unplanned(key, ctx)
        if self._pinned_step != self._step:
            # First lookup of the step: vLLM has applied the completions it
            # polled, so promotions that landed are pinned before any HIT
            # of this step can evict them.
            self._pinned_step = self._step
            self._pin_landed()
        rnd = self._rounds.get(ctx.req_id)
        if rnd is not None and rnd.protect_only:
            # Its walk reaches the tier now: a plan of its own, keeping the pins.
            rnd.protect_only = False
            rnd.plans = 0
            rnd.step = -1
            if not self._plan(rnd, key):
                rnd.protect_only = True
                return self._admits_unplanned(key, ctx)
        elif rnd is None:
            if not ctx.get_offload_key_position(key):
                return self._admits_unplanned(key, ctx)  # no positions: no plan
            rnd = self._rounds[ctx.req_id] = _Round(ctx, self._step)
            if not self._plan(rnd, key):
                del self._rounds[ctx.req_id]
                return self._admits_unplanned(key, ctx)
        elif not rnd.plans:
            return self._admits_unplanned(key, ctx)
        elif (
            not rnd.closed
            and rnd.step != self._step
            and rnd.plans < MAX_PLANS
            and (key in rnd.needed or not rnd.needed)
        ):
            self._plan(rnd, key)
        if key in rnd.planned:
            return True
        self.lookups_withheld += 1
        return False

    def note_hit(self, key: Any, ctx: Any) -> None:
        """The tier answers HIT for ``key`` of request ``ctx`` (after ``admits``)."""
        if self._hot.ctx is not None:
            self._cool()
        req_id = ctx.req_id
        if self._unloaded.get(key) == req_id:  # a key looked up twice counts once
            return
        self._unloaded[key] = req_id
        if not self.enabled:
            return
        rnd = self._rounds.get(req_id)
        if rnd is None:
            rnd = self._rounds[req_id] = _Round(ctx, self._step, self._request_budget(key, ctx))
        rnd.hits += 1
        if key in rnd.planned:
            rnd.planned.discard(key)
            rnd.landing.add(key)

    def note_loaded(self, keys: Iterable[Any]) -> None:
        """vLLM submitted a load (promotion) of ``keys``."""
        self._cool()
        if self._unloaded:
            # dict.pop over the keys at C speed (no Python frame per key).
            deque(map(self._unloaded.pop, keys, repeat(None)), maxlen=0)

    def note_load_job(self, job_id: int, keys: Collection[Any], ctx: Any) -> None:
        """vLLM submitted promotion job ``job_id`` of ``keys`` for ``ctx``."""
        self.note_loaded(keys)
        if self._view is not None and self._rounds:
            self._load_jobs[job_id] = keys
            self._in_flight.update(keys)

    def load_finished(self, job_id: int, success: bool, ok_keys: Collection[Any] | None) -> None:
        """Promotion job ``job_id`` finished (the tier is about to report it).

        The chunks that landed are made ready and pinned at once for the
        rounds that wait on them: vLLM would make them ready (and evictable)
        right after this poll, and a step whose walks never reach the tier
        would let its stores evict them before the guard could pin them. The
        orchestrator's own ``complete_write`` of ready chunks changes nothing.
        """
        keys = self._load_jobs.pop(job_id, None)
        view = self._view
        if keys is None or view is None:
            return
        self._in_flight.difference_update(keys)
        self._cool()
        landed = set(keys if ok_keys is None and success else ok_keys or ())
        if not landed:
            return
        generation = view.generation()
        made_ready = False
        for rnd in self._rounds.values():
            if not rnd.landing or rnd.generation != generation:
                continue
            mine = list(rnd.landing & landed)
            if not mine:
                continue
            if not made_ready:
                view.make_ready(list(landed), rnd.ctx)
                made_ready = True
            view.pin(mine, rnd.ctx)
            rnd.pinned.update(mine)
            rnd.landing.difference_update(mine)

    def track(self, ctx: Any) -> None:
        """A new request (``on_new_request``): waiting until vLLM schedules it."""
        self._waiting[ctx.req_id] = ctx

    # ------------------------------------------------------------ steps
    def end_step(
        self, new_req_ids: Collection[str] = (), preempted_req_ids: Collection[str] = ()
    ) -> None:
        """End of a scheduler step (after vLLM submitted its promotions and
        pinned the loads of the requests it scheduled)."""
        self._cool()
        self._step += 1
        rounds = self._rounds
        waiting = self._waiting
        for req_id in preempted_req_ids:
            rnd = rounds.pop(req_id, None)
            if rnd is not None:
                waiting[req_id] = rnd.ctx  # it walks again, from scratch
                self._release(rnd)
            self._protect_spent.discard(req_id)
        for req_id in new_req_ids:
            waiting.pop(req_id, None)
            self._protect_spent.discard(req_id)
            rnd = rounds.get(req_id)
            if rnd is not None:  # its own prepare_load holds its chunks now
                if rnd.protect_only:
                    del rounds[req_id]
                    self._release(rnd)
                else:
                    self._close(rnd)
        if rounds and self._view is not None:
            self._pin_landed()
            self._expire_idle()
        if not self._unloaded:
            return
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

    def finish(self, req_id: str) -> None:
        """The request finished: drop its pins and forget its round."""
        self._cool()
        self._waiting.pop(req_id, None)
        self._protect_spent.discard(req_id)
        rnd = self._rounds.pop(req_id, None)
        if rnd is not None:
            self._release(rnd)

    def release_all(self) -> None:
        """Drop every pin and round (before vLLM resets the CPU tier, or at
        shutdown): requests plan afresh at their next lookup."""
        self._cool()
        for rnd in self._rounds.values():
            self._release(rnd)
        self._rounds.clear()
        self._load_jobs.clear()
        self._in_flight.clear()

    def stats(self) -> dict[str, int]:
        """Counters and gauges for the tier's metrics."""
        self._cool()
        return {
            "hits_not_loaded": self.hits_not_loaded,
            "lookups_withheld": self.lookups_withheld,
            "requests_larger_than_cpu_tier": self.requests_larger_than_cpu_tier,
            "promotion_pins": sum(len(r.pinned) for r in self._rounds.values()),
        }

    # ------------------------------------------------------------ plans
    def _layout_of(self, ctx: Any) -> list[_Group]:
        """The request's KV groups, full attention first (vLLM's walk order),
        each with its chunk keys from the start; empty when unknown."""
        if len(self._layout) == 1:
            dense = self._layout_one_group(ctx)
            if dense is not None:
                return dense
        by_group = request_keys(ctx)
        out: list[_Group] = []
        for index, ends in sorted(by_group.items()):
            tpc, window = self._layout.get(index, (0, None))
            if tpc <= 0:
                tpc = _gcd_of(ends)
                if tpc <= 0:
                    return []
            out.append(_Group(index, tpc, window, _chunk_keys(ends, tpc)))
        out.sort(key=lambda g: (g.window is not None, -(g.window or 0), g.index))
        return out

    def _layout_one_group(self, ctx: Any) -> list[_Group] | None:
        """``_layout_of`` for a model of one KV group, at C speed: every key
        the request recorded is of that group (None: not so, or unknown)."""
        positions = key_positions(ctx)
        if not positions:
            return None
        ((index, (tpc, window)),) = self._layout.items()
        if set(map(_GROUP_SUFFIX, positions)) != {index.to_bytes(4, "big")}:
            return None
        ends = dict(zip(map(int, positions.values()), positions, strict=True))
        return [_Group(index, tpc, window, _chunk_keys(ends, tpc))]

    def _protect_waiting(self, planning: str) -> None:
        """Before the step's first promotion: pin the CPU chunks each waiting
        request would load from the CPU tier alone (requests whose walk has not
        reached the tier: deferred by vLLM, or waiting for GPU memory), so that
        no promotion evicts them. Once per request while it waits, for at most
        ``HOLD_STEPS`` steps; released when vLLM schedules it."""
        self._protected_step = self._step
        for req_id, ctx in self._waiting.items():
            if req_id == planning or req_id in self._rounds or req_id in self._protect_spent:
                continue
            groups = self._layout_of(ctx)
            if not groups:
                continue  # not walked yet: nothing of it is known
            # Once per request while it waits: a long queue costs one pass
            # over each request's keys, not one a step.
            self._protect_spent.add(req_id)
            anchor = _protect_anchor(groups, self._view)
            if anchor is None:
                continue
            rnd = _Round(ctx, self._step, protect_only=True)
            planned = self._plan(rnd, anchor, promote=False, groups=groups)
            if planned and (rnd.pinned or rnd.landing):
                self._rounds[req_id] = rnd

    def _plan(
        self,
        rnd: _Round,
        first_key: Any,
        *,
        promote: bool = True,
        groups: list[_Group] | None = None,
    ) -> bool:
        """Choose the request's load end and its promotions (see the module
        docstring); pin what the plan keeps that is in the CPU tier now.
        ``groups``: the request's layout when the caller has it already.
        False (nothing planned) when the request's keys are unknown."""
        view = self._view
        on_disk = self._on_disk
        assert view is not None and on_disk is not None
        if groups is None:
            groups = self._layout_of(rnd.ctx)
        position = rnd.ctx.get_offload_key_position(first_key)
        if not groups or not position:
            return False
        if promote and self._protected_step != self._step and self._waiting:
            self._protect_waiting(rnd.ctx.req_id)
        rnd.plans += 1
        rnd.step = self._step
        rnd.planned = set()
        state = self._state
        start = self._walk_start(groups, first_key, int(position), state, on_disk)
        step = _lcm_bounded([g.tokens_per_chunk for g in groups])
        end_tokens = min(len(g.keys) * g.tokens_per_chunk for g in groups)
        budget = self.budget - rnd.hits
        room = view.room()
        if room is None:
            room = self.cpu_chunks
        full = [g for g in groups if g.window is None]
        windows = [g for g in groups if g.window is not None]
        if len(full) == 1 and not windows:
            return self._plan_dense(rnd, full[0], start, budget, room, promote)
        known: dict[Any, int] = {}  # key -> READY / PENDING / ABSENT, or NOWHERE

        def classify(key: Any) -> int:
            got = known.get(key)
            if got is None:
                got = state(key)
                if got == ABSENT and not on_disk(key):
                    got = NOWHERE
                known[key] = got
            return got

        def pins_new(key: Any) -> int:
            return int(key not in rnd.pinned and view.evictable(key))

        # Full groups accumulate from the start (counted once, O(prompt));
        # windows are counted afresh per end (O(window) each).
        full_next = {g.index: start // g.tokens_per_chunk for g in full}
        full_need = full_promos = full_pins = 0
        best_end = no_disk_end = 0
        need_most = 0
        t = (start // step + 1) * step
        while t <= end_tokens:
            blocked = False
            for g in full:
                stop = t // g.tokens_per_chunk
                i = full_next[g.index]
                while i < stop:
                    where = classify(g.keys[i])
                    if where == NOWHERE:
                        blocked = True
                        break
                    full_need += 1
                    if where == ABSENT:
                        full_promos += 1
                    elif where == READY:
                        full_pins += pins_new(g.keys[i])
                    i += 1
                full_next[g.index] = i
                if blocked:
                    break
            if blocked:  # a full group's chunk is nowhere: no end past it
                break
            need, promos, pins = full_need, full_promos, full_pins
            for g in windows:
                for key in _window_keys(g, start, t):
                    where = classify(key)
                    if where == NOWHERE:
                        need = -1
                        break
                    need += 1
                    if where == ABSENT:
                        promos += 1
                    elif where == READY:
                        pins += pins_new(key)
                if need < 0:
                    break
            if need >= 0:
                need_most = need
                if not promos:
                    no_disk_end = t
                elif promote and promos <= budget and promos + pins <= room:
                    best_end = t
            t += step
        if need_most > self.cpu_chunks:
            self._warn_request_larger(need_most)
        if best_end <= no_disk_end:
            # The CPU tier alone serves as much: no HIT, the request loads
            # that now (its chunks pinned in case vLLM cannot schedule it yet).
            best_end = no_disk_end
        needed = [
            key
            for g in groups
            for key in (
                g.keys[start // g.tokens_per_chunk : best_end // g.tokens_per_chunk]
                if g.window is None
                else _window_keys(g, start, best_end)
            )
        ]
        rnd.needed = set(needed)
        rnd.planned = {k for k in needed if known[k] == ABSENT}
        generation = view.generation()
        if rnd.pinned and rnd.generation != generation:
            rnd.pinned.clear()  # vLLM reset the CPU tier since: those pins are void
        rnd.generation = generation
        to_pin = [k for k in rnd.needed if known[k] == READY and k not in rnd.pinned]
        if to_pin:
            view.pin(to_pin, rnd.ctx)
            rnd.pinned.update(to_pin)
        rnd.landing.update(k for k in rnd.needed if known[k] != READY and k not in rnd.pinned)
        return True

    def _plan_dense(
        self, rnd: _Round, group: _Group, start: int, budget: int, room: int, promote: bool
    ) -> bool:
        """``_plan`` for one full-attention group (a dense model): the same
        choice, in one pass over the request's chunks from the start, one CPU
        tier read (and, for a chunk it lacks, one disk read) per chunk.

        Every end adds one chunk, so promotions and pins only grow: once an
        end is not affordable no later one is, and the pass stops there
        unless the request could still need more chunks than the CPU tier
        holds (the warning's count)."""
        view = self._view
        on_disk = self._on_disk
        assert view is not None and on_disk is not None
        residency = self._residency
        keys = group.keys
        tpc = group.tokens_per_chunk
        first = start // tpc
        pinned = rnd.pinned
        may_stop = len(keys) - first <= self.cpu_chunks
        wheres: list[int] = []
        append = wheres.append
        need = promos = pins = best = no_disk = 0
        for key in keys[first:]:
            where = residency(key)
            if where == ABSENT:
                if not on_disk(key):
                    break
                promos += 1
            elif where == READY and key not in pinned:
                pins += 1  # pinning it takes a slot of room
            append(where)
            need += 1
            if not promos:
                no_disk = need
            elif promote and promos <= budget and promos + pins <= room:
                best = need
            elif may_stop:
                break  # no later end is affordable
        if need > self.cpu_chunks:
            self._warn_request_larger(need)
        if best <= no_disk:
            best = no_disk  # the CPU tier alone serves as much: no HIT
        needed = keys[first : first + best]
        wheres = wheres[:best]
        rnd.needed = set(needed)
        marked = list(zip(needed, wheres, strict=True))
        rnd.planned = {k for k, w in marked if w == ABSENT}
        generation = view.generation()
        if rnd.pinned and rnd.generation != generation:
            rnd.pinned.clear()  # vLLM reset the CPU tier since: those pins are void
        rnd.generation = generation
        pinned = rnd.pinned
        to_pin = [k for k, w in marked if w >= READY and k not in pinned]
        if to_pin:
            view.pin(to_pin, rnd.ctx)
            pinned.update(to_pin)
        rnd.landing.update(
            k for k, w in zip(needed, wheres, strict=True) if w < READY and k not in pinned
        )
        return True

    @staticmethod
    def _walk_start(
        groups: list[_Group],
        first_key: Any,
        position: int,
        state: Callable[[Any], int],
        on_disk: Callable[[Any], bool],
    ) -> int:
        """The token where the request's walk started (vLLM tells no tier).

        With a full-attention group: where the CPU tier's run of its chunks
        ends just before ``first_key`` starts (the walk found them all).
        Sliding windows only: the first token.
        """
        full = next((g for g in groups if g.window is None), None)
        if full is None:
            # Sliding windows only, scanned from the end: nothing tells where
            # the walk began; from the first token, the windows the plan
            # counts are the ones vLLM checks (a head in the GPU prefix cache
            # can make it accept a shorter window at its start, which the
            # plan does not count on).
            return 0
        tpc = full.tokens_per_chunk
        if first_key in full.keys:
            i = position // tpc - 1  # the first chunk the CPU tier did not have
        else:  # a later group's key: the full group's walk passed this chunk
            i = min(len(full.keys), -(-position // tpc))
        while i > 0 and state(full.keys[i - 1]) != ABSENT:
            i -= 1
        return i * tpc

    def _pin_landed(self) -> None:
        """Pin the planned chunks that became ready since (landed promotions,
        finished writes); forget those that are gone (a failed read)."""
        view = self._view
        if view is None:
            return
        generation = view.generation()
        for rnd in self._rounds.values():
            if not rnd.landing:
                continue
            if rnd.generation != generation:
                rnd.pinned.clear()
                rnd.landing.clear()
                continue
            ready = []
            state = self._state
            # A key of a promotion in flight stays PENDING until load_finished.
            for key in rnd.landing - self._in_flight if self._in_flight else list(rnd.landing):
                where = state(key)
                if where == READY:
                    ready.append(key)
                    rnd.landing.discard(key)
                elif where == ABSENT:
                    rnd.landing.discard(key)
            if ready:
                view.pin(ready, rnd.ctx)
                rnd.pinned.update(ready)

    def _expire_idle(self) -> None:
        """End the rounds whose request stays unscheduled with every
        promotion landed, so their pins do not hold the CPU tier for good."""
        for req_id, rnd in list(self._rounds.items()):
            if rnd.closed or not rnd.pinned or rnd.landing:
                continue
            rnd.idle_steps += 1
            if rnd.idle_steps <= HOLD_STEPS:
                continue
            if rnd.protect_only:  # never planned: its walk may still plan
                del self._rounds[req_id]
                self._release(rnd)
            else:
                self._close(rnd)

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

    # ------------------------------------------------------------ no CPU tier view
    def _chunks_before(self, position: int) -> int:
        """Chunks of a request before the chunk ending at token ``position``."""
        total = 0
        for tokens_per_chunk, window in self._groups:
            before = max(0, position // tokens_per_chunk - 1)
            total += before if window is None else min(before, window + 1)
        return total

    def _request_budget(self, key: Any, ctx: Any) -> int:
        """HITs a round starting at ``key`` may get: the budget less the
        request's chunks before ``key`` (those the CPU tier may hold)."""
        get_position = getattr(ctx, "get_offload_key_position", None)
        position = get_position(key) if get_position is not None and self._groups else None
        if not position:
            return self.budget
        return min(self.budget, self.cpu_chunks - self._chunks_before(int(position)))

    def _admits_unplanned(self, key: Any, ctx: Any) -> bool:
        """Without a CPU tier view: HITs only in the step of the request's
        first HIT, at most its budget."""
        req_id = ctx.req_id
        rnd = self._rounds.get(req_id)
        if rnd is None:  # no HIT yet: a round starts here if there is room
            budget = self._request_budget(key, ctx)
            if budget > 0:
                return True
            self._rounds[req_id] = _Round(ctx, self._step, budget, closed=True)
            self.lookups_withheld += 1
            return False
        if not rnd.closed and rnd.step == self._step and rnd.hits < rnd.budget:
            return True
        rnd.closed = True
        self.lookups_withheld += 1
        return False

    # ------------------------------------------------------------ warnings
    def _warn_request_larger(self, need: int) -> None:
        """A request needs more CPU tier chunks than there are: warn (at
        most once a minute) with the ``cpu_bytes_to_use`` that fits it."""
        self.requests_larger_than_cpu_tier += 1
        now = time.monotonic()
        if now - self._last_size_log < NOT_LOADED_LOG_INTERVAL_S:
            return
        self._last_size_log = now
        fits = f" (cpu_bytes_to_use >= {need * self._chunk_bytes})" if self._chunk_bytes else ""
        logger.warning(
            "nvmetier[%s]: a request needs %d CPU tier chunks to load its disk hits, but vLLM's "
            "CPU tier holds %d: it loads part of them and recomputes the rest (counted in "
            "vllm:nvmetier_requests_larger_than_cpu_tier). Raise cpu_bytes_to_use to fit the "
            "longest prompts%s (docs/vllm.md, 'Sizing the CPU tier')",
            self._tier_label,
            need,
            self.cpu_chunks,
            fits,
        )

    def _warn_not_loaded(self) -> None:
        need = ""
        if self._longest > self.cpu_chunks and self._chunk_bytes:
            need = (
                f"; one longest request needs {self._longest} chunks: "
                f"cpu_bytes_to_use >= {self._longest * self._chunk_bytes}"
            )
        logger.warning(
            "nvmetier[%s]: %d disk hits of %d requests were not loaded since the last report: "
            "vLLM's CPU tier (%d chunks) had no free slot for them, so those chunks are "
            "recomputed (counted in vllm:nvmetier_hits_not_loaded). Raise cpu_bytes_to_use%s, "
            "or send fewer long prompts at once (docs/vllm.md, 'Sizing the CPU tier')",
            self._tier_label,
            self._not_logged,
            self._not_logged_reqs,
            self.cpu_chunks,
            need,
        )
        self._not_logged = 0
        self._not_logged_reqs = 0


def _absent(key: Any) -> int:
    """The CPU tier's answer before the guard has a view of it."""
    return ABSENT


def _protect_anchor(groups: list[_Group], view: Any) -> Any:
    """The key a waiting request's walk would first ask the tier about, had
    it reached it: its first full-attention chunk the CPU tier does not hold
    (its last chunk when it holds them all), or, with sliding windows only,
    the last chunk of the first group (scanned from the end)."""
    full = next((g for g in groups if g.window is None), None)
    if full is None:
        return groups[0].keys[-1] if groups[0].keys else None
    if not full.keys:
        return None
    for key in full.keys:
        if view.state(key) == ABSENT:
            return key
    return full.keys[-1]


def _window_keys(group: _Group, start: int, end: int) -> list[Any]:
    """The keys of a sliding-window group that a load ending at token ``end``
    takes: its window's chunks before ``end``, none before ``start``."""
    assert group.window is not None
    stop = end // group.tokens_per_chunk
    lo = max(start // group.tokens_per_chunk, stop - group.window)
    return group.keys[lo:stop]


# The last 4 bytes of an offload key: its KV group (vLLM's make_offload_key).
_GROUP_SUFFIX = itemgetter(slice(-4, None))


def _chunk_keys(ends: dict[int, Any], tpc: int) -> list[Any]:
    """A group's keys by chunk from the start: the key ending at token
    ``(i + 1) * tpc`` for each i, up to the first chunk with none."""
    keys = list(map(ends.get, range(tpc, (len(ends) + 1) * tpc, tpc)))
    if None in keys:
        del keys[keys.index(None) :]
    return keys


def _gcd_of(ends: dict[int, Any]) -> int:
    """Tokens per chunk of a group whose layout is unknown: the gcd of its
    chunk keys' end tokens."""
    out = 0
    for end in ends:
        out = math.gcd(out, end)
    return out


def _lcm_bounded(sizes: list[int]) -> int:
    """The end positions a plan tries: multiples of every group's chunk
    (their lcm), or of the largest chunk when the lcm is unreasonably large."""
    out = 1
    for size in sizes:
        out = out * size // math.gcd(out, size)
    largest = max(sizes)
    return out if out <= 8 * largest else largest


__all__ = [
    "PromotionGuard",
    "check_cpu_tier_size",
    "group_chunking",
    "kv_groups",
    "longest_request_chunks",
]
