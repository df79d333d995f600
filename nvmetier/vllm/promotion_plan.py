"""The promotion guard's plan: which of a request's chunks it may load, and how.

Owns ``RequestPlanner``, the part of ``nvmetier.vllm.promotion.PromotionGuard``
that computes a request's plan (its walk's start, its load end, the
promotions and the CPU tier pins), the request's layout by KV group, the
protection of waiting requests' CPU chunks, the rule without a view of the
CPU tier (one round in the step of a request's first HIT, within its budget)
and the guard's warnings; the guard adds the per-lookup
fast path and the per-step bookkeeping (pins landing, rounds ending).

Threads: vLLM's scheduler thread only, under the orchestrator's lock
(through the guard); nothing blocks, nothing does I/O (the disk's answers
come from the index in memory; a promotion's plan takes its HITs' leases in
the same native read, released by the tier's ``on_schedule_end``).

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

"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import compress
from operator import itemgetter
from typing import Any

from nvmetier._table import chunk_run
from nvmetier.vllm.cpu_view import ABSENT, READY, PrimaryView, key_positions, request_keys

# A chunk neither in the CPU tier nor on disk (``_plan``'s classification).
NOWHERE = -1

logger = logging.getLogger("nvmetier.vllm")

# Seconds between two "hits not loaded" (or "request larger than the CPU
# tier") warnings; the count in between is summed.
NOT_LOADED_LOG_INTERVAL_S = 60.0
# Chunks a dense plan reads from the CPU tier and the disk per batch: a
# request of up to 256 chunks in one call of each (each call's prefetch
# pipeline starts cold; 128 cost such a request ~10 us more on vLLM's thread
# through the vllm bench level), while a plan that stops early leases at most
# this many chunks it does not use, until the step ends.
PLAN_BATCH = 256


@dataclass(slots=True)
class _Round:
    """One request's promotion round."""

    ctx: Any
    step: int  # the step of its last plan (or, without a plan, of its first HIT)
    budget: int = 0  # without a plan: HITs it may get in that step
    hits: int = 0  # HITs answered (every round)
    closed: bool = False
    plans: int = 0
    planned: set[Any] = field(default_factory=set)  # keys to answer HIT
    # A plan's HITs in the walk's order that it did not lease itself, for
    # the guard to lease (then None).
    to_lease: list[Any] | None = None
    # Planned keys the disk leased at the plan, in step lease_step only
    # (release_leases drops every lease at the step's end).
    leased: set[Any] = field(default_factory=set)
    lease_step: int = -1
    # Keys the planned load takes: a set, or (a dense plan) the list of them,
    # made a set only when asked (``needs``).
    needed: set[Any] | list[Any] = field(default_factory=set)
    pinned: set[Any] = field(default_factory=set)  # keys this round pinned
    landing: set[Any] = field(default_factory=set)  # needed keys to pin once ready
    # len(landing) when every landing key was found in a promotion job in
    # flight (PromotionGuard._pin_landed): while landing keeps that size and
    # no job of it finished, each of its keys is PENDING, so no step need
    # ask about it.
    in_flight_n: int = -1
    generation: int = 0  # the CPU tier's generation of the pins
    idle_steps: int = 0
    protect_only: bool = False  # pins a waiting request's CPU chunks, no HIT

    def needs(self, key: Any) -> bool:
        """Whether the planned load takes ``key`` (or the plan is empty)."""
        needed = self.needed
        if type(needed) is list:
            needed = self.needed = set(needed)
        return not needed or key in needed


@dataclass(slots=True)
class _Group:
    """One KV group of a request: its chunk size, window and keys by chunk.

    Made once per plan on vLLM's thread and not changed after; not frozen: a
    frozen dataclass sets each field through ``object.__setattr__`` (~4 us a
    plan, cold)."""

    index: int
    tokens_per_chunk: int
    window: int | None
    keys: list[Any]  # keys[i]: the key of chunk i (ending at (i + 1) * tokens_per_chunk)


class RequestPlanner:
    """The plan half of ``PromotionGuard`` (its base class): the state it
    reads is the guard's, set up by ``PromotionGuard.__init__``."""

    enabled: bool
    cpu_chunks: int
    budget: int
    requests_larger_than_cpu_tier: int
    _chunk_bytes: int
    _tier_label: str
    _last_size_log: float
    _layout: dict[int, tuple[int, int | None]]
    # The one group's (index, tokens per chunk, window, key suffix), once
    # made (a model of one KV group; None until then).
    _one_group: tuple[int, int, int | None, bytes] | None
    _step: int
    _protected_step: int
    _rounds: dict[str, _Round]
    _waiting: dict[str, Any]
    _protect_spent: set[str]
    _view: PrimaryView | None
    _on_disk: Callable[[Any], bool] | None
    _on_disk_many: Callable[[list[Any]], bytes] | None
    _lease_many: Callable[[list[Any]], bytes] | None
    _state: Callable[[Any], int]
    _residencies: Callable[[list[Any]], list[int]]
    lookups_withheld: int
    _groups: tuple[tuple[int, int | None], ...]
    _longest: int
    _not_logged: int
    _not_logged_reqs: int

    def _layout_of(self, ctx: Any) -> list[_Group]:
        """The request's KV groups, full attention first (vLLM's walk order),
        each with its chunk keys from the start; empty when unknown."""
        if len(self._layout) == 1:
            dense = self._layout_one_group(ctx)
            if dense is not None:
                return dense
        return self._layout_of_groups(ctx)

    def _layout_of_groups(self, ctx: Any) -> list[_Group]:
        """``_layout_of`` by the general path: the keys sorted by group."""
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
        one = self._one_group
        if one is None:
            ((index, (tpc, window)),) = self._layout.items()
            one = self._one_group = (index, tpc, window, index.to_bytes(4, "big"))
        index, tpc, window, suffix = one
        if tpc > 0:
            # The usual record (every key of the group, chunk after chunk
            # from the first) in one native pass; anything else below.
            run = chunk_run(positions, suffix, tpc)
            if run is not None:
                return [_Group(index, tpc, window, run)]
        if set(map(_GROUP_SUFFIX, positions)) != {suffix}:
            return None
        if list(positions.values()) == list(range(tpc, (len(positions) + 1) * tpc, tpc)):
            # Recorded chunk after chunk from the first (the connector's
            # order): the keys by chunk are the record's keys as they are.
            return [_Group(index, tpc, window, list(positions))]
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
        if len(groups) == 1 and groups[0].window is None:
            # One full-attention group (a dense model): its walk's start and
            # the plan, without the general path's per-group bookkeeping.
            group = groups[0]
            start = self._walk_start(groups, first_key, int(position), state, on_disk, group)
            room = view.room()
            return self._plan_dense(
                rnd,
                group,
                start,
                self.budget - rnd.hits,
                self.cpu_chunks if room is None else room,
                promote,
            )
        start = self._walk_start(groups, first_key, int(position), state, on_disk)
        step = _lcm_bounded([g.tokens_per_chunk for g in groups])
        end_tokens = min(len(g.keys) * g.tokens_per_chunk for g in groups)
        budget = self.budget - rnd.hits
        room = view.room()
        if room is None:
            room = self.cpu_chunks
        full = [g for g in groups if g.window is None]
        windows = [g for g in groups if g.window is not None]
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
        rnd.to_lease = [k for k in needed if known[k] == ABSENT]
        rnd.planned = set(rnd.to_lease)
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
        holds (the warning's count).

        A promotion's plan reads the disk with ``_lease_many`` when there is
        one: every planned HIT was leased by that read (``rnd.leased``, for
        this step; a key read past the plan's end stays leased until the
        step's ``release_leases``, as a HIT vLLM did not load does)."""
        view = self._view
        on_disk = self._on_disk
        assert view is not None and on_disk is not None
        residencies = self._residencies
        keys = group.keys
        tpc = group.tokens_per_chunk
        first = start // tpc
        pinned = rnd.pinned
        may_stop = len(keys) - first <= self.cpu_chunks
        wheres: list[int] = []
        append = wheres.append
        need = promos = pins = best = no_disk = 0
        lease = promote and self._lease_many is not None
        on_disk_many = self._lease_many if lease else self._on_disk_many
        stop = False
        # The CPU tier's answers, then the disk's for the chunks it lacks,
        # a batch of chunks at a time: one native call per batch, whose
        # index cache misses overlap (a pass that stops early reads at most a
        # batch more than it uses; the leases of those end with the step).
        for lo in range(first, len(keys), PLAN_BATCH):
            batch = keys[lo : lo + PLAN_BATCH]
            states = residencies(batch)
            disk = None
            if on_disk_many is not None and ABSENT in states:
                if states.count(ABSENT) < len(states):
                    absent = [k for k, w in zip(batch, states, strict=True) if w == ABSENT]
                    disk = iter(on_disk_many(absent))
                else:
                    found = on_disk_many(batch)
                    if 0 not in found:
                        # Every chunk of the batch is a promotion (the usual
                        # batch of a request on disk): the loop below in one
                        # step. The j-th chunk's end is affordable while
                        # j <= fits; past it the pass stops at that chunk
                        # (may_stop) or goes on without a better end.
                        n = len(batch)
                        fits = min(budget - promos, room - pins - promos) if promote else 0
                        if fits > 0:
                            best = need + min(fits, n)
                        take = n if fits >= n or not may_stop else max(fits, 0) + 1
                        wheres.extend(states[:take])
                        need += take
                        promos += take
                        if fits < n and may_stop:
                            stop = True
                            break
                        continue
                    disk = iter(found)
            for key, where in zip(batch, states, strict=True):
                if where == ABSENT:
                    if not (next(disk) if disk is not None else on_disk(key)):
                        stop = True
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
                    stop = True
                    break  # no later end is affordable
            if stop:
                break
        if need > self.cpu_chunks:
            self._warn_request_larger(need)
        if best <= no_disk:
            best = no_disk  # the CPU tier alone serves as much: no HIT
        needed = keys[first : first + best]
        wheres = wheres[:best]
        # The list itself: a set only if a later lookup asks (_Round.needs).
        rnd.needed = needed
        # At C speed (compress), a chunk's class read once per set built; a
        # request all on disk (the common case) makes one set, and copies it.
        all_absent = wheres.count(ABSENT) == best
        if all_absent:
            rnd.planned = set(needed)
        else:
            rnd.planned = set(compress(needed, map(_ABSENT_EQ, wheres)))
        if lease:
            # The disk's read leased every planned key: this step's leased set
            # is the planned set itself (no copy; a HIT from a lease leaves
            # both at once, and ``PromotionGuard._take_lease`` and ``_cool``
            # then add it to ``landing`` as ``note_hit`` would).
            rnd.leased = rnd.planned
            rnd.lease_step = self._step
        generation = view.generation()
        if rnd.pinned and rnd.generation != generation:
            rnd.pinned.clear()  # vLLM reset the CPU tier since: those pins are void
        rnd.generation = generation
        pinned = rnd.pinned
        ready = [] if all_absent else list(compress(needed, map(_READY_LE, wheres)))
        to_pin = [k for k in ready if k not in pinned] if pinned else ready
        if to_pin:
            view.pin(to_pin, rnd.ctx)
            pinned.update(to_pin)
        # All on disk: the planned set is every needed chunk (no HIT has left
        # it yet); update copies it.
        not_ready = rnd.planned if all_absent else set(compress(needed, map(_READY_GT, wheres)))
        rnd.landing.update(not_ready - pinned if pinned else not_ready)
        return True

    @staticmethod
    def _walk_start(
        groups: list[_Group],
        first_key: Any,
        position: int,
        state: Callable[[Any], int],
        on_disk: Callable[[Any], bool],
        full: _Group | None = None,
    ) -> int:
        """The token where the request's walk started (vLLM tells no tier).

        With a full-attention group (``full``, when the caller has it):
        where the CPU tier's run of its chunks ends just before
        ``first_key`` starts (the walk found them all). Sliding windows
        only: the first token.
        """
        if full is None:
            full = next((g for g in groups if g.window is None), None)
        if full is None:
            # Sliding windows only, scanned from the end: nothing tells where
            # the walk began; from the first token, the windows the plan
            # counts are the ones vLLM checks (a head in the GPU prefix cache
            # can make it accept a shorter window at its start, which the
            # plan does not count on).
            return 0
        tpc = full.tokens_per_chunk
        keys = full.keys
        at = position // tpc - 1  # where the key's own chunk is, if it is this group's
        if (0 <= at < len(keys) and keys[at] == first_key) or first_key in keys:
            i = at  # the first chunk the CPU tier did not have
        else:  # a later group's key: the full group's walk passed this chunk
            i = min(len(full.keys), -(-position // tpc))
        while i > 0 and state(full.keys[i - 1]) != ABSENT:
            i -= 1
        return i * tpc

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


# A chunk's class tests, as C callables for ``compress``: ABSENT, ready
# (READY or READY_HELD), not ready.
_ABSENT_EQ = ABSENT.__eq__
_READY_LE = READY.__le__
_READY_GT = READY.__gt__

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
