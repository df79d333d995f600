"""Which disk hits vLLM is told about: the promotion guard and the CPU tier check.

Owns ``PromotionGuard``: per request, which of its chunks the tier answers
HIT for, the CPU tier chunks it holds for the request while its promotions
land, and the count of HITs vLLM did not load. (The groups' layout and the
start-up size check live in ``nvmetier.vllm.sizing``, re-exported here.)

Threads: every method runs on vLLM's scheduler thread under the
orchestrator's lock (through ``NvmeTierManager``); nothing blocks, nothing
does I/O. The work is per request, not per key: the tier's lookup
(``lookup_call``) plans at a request's first lookup of a step (the plan's
one read of the disk's index also leases the chunks it will answer HIT for,
until the step ends), and answers the request's further keys in that step
from the plan's sets, without asking the disk again.

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

The plan itself (how a request's load end, promotions and pins are chosen)
is ``nvmetier.vllm.promotion_plan``'s, whose docstring says how; this module
answers from it and keeps its pins until vLLM loads the request (what a
step's end does to the rounds' pins: ``nvmetier.vllm.promotion_rounds``).

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
from collections import deque
from collections.abc import Callable, Collection, Iterable
from itertools import compress, repeat
from typing import Any

from nvmetier._table import GuardCall
from nvmetier._table import HotRequest as _Hot
from nvmetier.vllm.cpu_view import ABSENT, PrimaryView
from nvmetier.vllm.promotion_plan import (
    NOT_LOADED_LOG_INTERVAL_S,
    NOWHERE,
    RequestPlanner,
    _Round,
)
from nvmetier.vllm.promotion_rounds import RoundKeeper
from nvmetier.vllm.sizing import (  # re-exported: the names this module always had
    check_cpu_tier_size,
    group_chunking,
    kv_groups,
    longest_request_chunks,
)

logger = logging.getLogger("nvmetier.vllm")

# Steps a request keeps its pins once all its promotions landed and it is
# still not scheduled.
HOLD_STEPS = 8
# Plans one request may make (the first and the re-plans after a lost key).
MAX_PLANS = 3


# The request whose lookups are answered from its plan's set: set after a
# lookup of a planned round that cannot plan again this step (see
# ``PromotionGuard._heat``); its HITs are kept in ``hits`` and moved into the
# round (count, landing, not-yet-loaded) by ``_cool``, which every other
# method of the guard calls first. ``leased``: the round's planned keys the
# disk leased at this step's plan (a HIT without asking the disk again; the
# round's own set, a key leaving it at its HIT), of which ``n_leased`` were
# there when it was heated. ``planned``: the round's other planned keys (the
# disk is asked; a key leaves it at its HIT). A HIT leaves the round's
# ``planned`` at ``_cool``: while hot, a key answered HIT is in neither set,
# so a second lookup of it is a MISS as ``note_hit`` makes it.
#
# It is native (``nvmetier._table.HotRequest``, native/nvt_hot_request.c):
# plain attributes as a slotted class has, and callable as the tier's
# ``lookup(key, ctx)``, answering a leased key of the hot request in C (no
# Python frame per key on vLLM's scheduler thread) and calling its
# ``fallback`` for anything else (``NvmeTierManager`` wires both). Imported
# above as ``_Hot``, the name of the Python class it replaced.


class PromotionGuard(RoundKeeper):
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
        self._one_group = None
        self._step = 0
        self._rounds: dict[str, _Round] = {}
        # HITs answered this step that no submit_load took yet: key -> req_id,
        # and, not yet in it, the hot requests' HITs moved out by _cool, as
        # (keys, req_id) in order (_note_pending puts them in; a load that
        # takes them all drops them without that pass over the keys).
        self._unloaded: dict[Any, str] = {}
        self._pending: list[tuple[list[Any], str]] = []
        self._last_log = -math.inf
        self._not_logged = 0
        self._not_logged_reqs = 0
        self._last_size_log = -math.inf
        self._view: PrimaryView | None = None
        self._on_disk: Callable[[Any], bool] | None = None
        self._on_disk_many: Callable[[list[Any]], bytes] | None = None
        self._state: Callable[[Any], int] = _absent
        self._residencies: Callable[[list[Any]], list[int]] = _all_absent
        self._pinned_step = -1
        # Requests vLLM has not scheduled yet (on_new_request, and again when
        # preempted): req_id -> context. Their CPU chunks are protected before
        # any promotion of a step (``_protect_waiting``).
        self._waiting: dict[str, Any] = {}
        self._protected_step = -1
        # Whether the last end of step found every round waiting on promotions
        # in flight (or no round) and nothing to count, with nothing of the
        # guard's changed since: every method that changes a round, a HIT or
        # a pin clears it. Then the next end of step only counts the step
        # (unless it schedules or preempts a request, or the CPU tier's
        # generation moved).
        self._quiet = False
        self._quiet_generation: int | None = None
        # The view's generation as one C call (None without a view): what
        # the native end of step compares (GuardCall, native/nvt_guard_calls.c).
        self._generation: Callable[[], int] | None = None
        # Promotion jobs of planned rounds in flight: job id -> keys (PENDING
        # in the CPU tier until load_finished: _pin_landed need not ask about
        # them every step). Their union is taken only when a round's landing
        # changed (_pin_landed), not kept per job on vLLM's thread.
        self._load_jobs: dict[int, Collection[Any]] = {}
        self._protect_spent: set[str] = set()
        self._hot = _Hot()
        # The disk's leasing read of many keys, and who counts the HITs
        # answered from its leases (attach).
        self._lease_many: Callable[[list[Any]], bytes] | None = None
        self._count_hits: Callable[[int], None] | None = None

    # ------------------------------------------------------------ wiring
    def attach(
        self,
        view: PrimaryView,
        on_disk: Callable[[Any], bool],
        on_disk_many: Callable[[list[Any]], bytes] | None = None,
        lease_many: Callable[[list[Any]], bytes] | None = None,
        count_hits: Callable[[int], None] | None = None,
    ) -> None:
        """Plan from now on against the CPU tier ``view``; ``on_disk(key)``
        says whether the tier holds a key (no I/O), and ``on_disk_many(keys)``
        (optional: one byte per key, nonzero when held) the same of many
        keys in one call.

        ``lease_many(keys)`` (optional: ``on_disk_many`` that also leases
        each key held, as the disk's lookup leases a hit, until the step
        ends; it counts nothing) lets a promotion's plan read the disk and
        lease its HITs in the same call: the request's lookups of them this
        step ask the disk nothing, and ``count_hits(n)`` is told how many
        HITs were so answered (once per request and step). A
        planned key not leased is asked of the disk's own lookup when vLLM
        looks it up, as without it."""
        self._quiet = False
        self._cool()
        self._view = view
        # (A view without the C call, a test's, is asked through its method.)
        generation_call = getattr(view, "generation_call", None)
        self._generation = view.generation if generation_call is None else generation_call()
        self._on_disk = on_disk
        self._on_disk_many = on_disk_many
        self._lease_many = lease_many
        self._count_hits = count_hits
        self._state = view.state_call()
        self._residencies = view.residencies_call()

    # ------------------------------------------------------------ the tier's lookup
    def lookup_call(
        self,
        disk_lookup: Callable[[Any], Any],
        withheld: Callable[[Any], None] | None = None,
    ) -> Callable[[Any, Any], bool]:
        """The tier's whole answer to vLLM's ``lookup(key, req_context)`` as
        one function (its parameters named as vLLM's: the tier's native
        lookup passes a call by keyword to it as it is): ``admits``, then
        ``disk_lookup(key)`` (the disk's answer, truthy for a hit), then
        ``note_hit``; True for HIT. ``withheld(key)``,
        if given, is told of every key ``admits`` refused (the disk was not
        asked: a store's write admission counts it as asked for).

        Per request, not per key: the request's first lookup of a step takes
        the full path (its plan, which leases the plan's HITs on disk in one
        call when ``attach`` gave ``lease_many``, and the step's pins); every
        further lookup of the same request in that step, once it can plan no
        more, is one check of the plan's leased set (``_Hot``) and a list
        append for a HIT; a planned key not leased is asked of the disk
        (``disk_lookup``) as before.
        """
        hot = self._hot

        def slow(key: Any, req_context: Any) -> bool:
            if not self.admits(key, req_context):
                if withheld is not None:
                    withheld(key)
                self._heat(req_context)
                return False
            hit = self._take_lease(key, req_context) or bool(disk_lookup(key))
            if hit:
                self.note_hit(key, req_context)
            self._heat(req_context)
            return hit

        if withheld is not None:

            def counted(key: Any, req_context: Any) -> bool:
                if req_context is hot.ctx:
                    leased = hot.leased
                    if key in leased:
                        leased.discard(key)
                        hot.hits.append(key)
                        return True
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
                return slow(key, req_context)

            return counted

        def lookup(key: Any, req_context: Any) -> bool:
            if req_context is hot.ctx:
                leased = hot.leased
                if key in leased:
                    leased.discard(key)
                    hot.hits.append(key)
                    return True
                planned = hot.planned
                if key in planned:
                    if disk_lookup(key):
                        planned.discard(key)
                        hot.hits.append(key)
                        return True
                    return False
                self.lookups_withheld += 1
                return False
            return slow(key, req_context)

        return lookup

    @property
    def hot(self) -> _Hot:
        """The hot request's state (``_heat``): the tier's ``lookup`` answers
        a leased key of it inline, as ``lookup_call``'s function does."""
        return self._hot

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
            if rnd.lease_step == self._step and rnd.leased:
                hot.leased = rnd.leased
                hot.n_leased = len(rnd.leased)
                # The planned keys not leased (usually none: a dense plan's
                # leased set is its planned set): the only ones the disk is
                # asked about while hot.
                hot.planned = set() if rnd.leased is rnd.planned else rnd.planned - rnd.leased
            else:
                hot.planned = rnd.planned

    def _note_pending(self) -> None:
        """Put the HITs ``_cool`` set aside into ``_unloaded``, in order."""
        unloaded = self._unloaded
        for hits, req_id in self._pending:
            unloaded.update(dict.fromkeys(hits, req_id))
        self._pending.clear()

    def _cool(self) -> None:
        """Move the hot request's HITs into its round, as ``note_hit`` would
        have one by one, and stop answering from its set."""
        hot = self._hot
        if hot.ctx is None:
            return
        hits = hot.hits
        rnd = hot.rnd
        if hits and rnd is not None:
            if hot.leased is not rnd.planned:
                rnd.planned.difference_update(hits)
                rnd.landing.update(hits)
            # else its HITs left the plan as they came, and were landing
            # already: a dense plan lands every key it plans, and nothing
            # takes a planned key (ABSENT in the CPU tier) out of landing
            # within the plan's step.
            rnd.hits += len(hits)
            # Not loaded yet (note_loaded): the list itself, noted in
            # _unloaded only if needed (_note_pending).
            self._pending.append((hits, hot.req_id))
            hot.hits = []
        elif hits:
            hits.clear()
        if hot.n_leased:
            n = hot.n_leased - len(hot.leased)
            hot.n_leased = 0
            hot.leased = set()
            if n and self._count_hits is not None:
                self._count_hits(n)
        hot.ctx = None
        hot.rnd = None
        hot.planned = set()

    def _plan_and_lease(self, rnd: _Round, key: Any) -> bool:
        """``_plan`` with the plan's HITs leased on disk (when ``attach`` gave
        ``lease_many``): a dense plan's own read of the disk leased them; a
        layout of several groups leases them after its plan, in one call.
        Those leased are HITs this step without asking the disk again
        (``_take_lease`` and the hot path)."""
        rnd.leased = set()
        if not self._plan(rnd, key):
            return False
        keys = rnd.to_lease
        rnd.to_lease = None
        lease_many = self._lease_many
        if lease_many is None or not keys:
            return True
        got = lease_many(keys)
        rnd.leased = set(keys) if got.count(0) == 0 else set(compress(keys, got))
        rnd.lease_step = self._step
        return True

    def _take_lease(self, key: Any, ctx: Any) -> bool:
        """Whether the plan leased ``key`` for request ``ctx`` this step (the
        lease is then the HIT's, counted for ``count_hits``)."""
        rnd = self._rounds.get(ctx.req_id)
        if rnd is None or rnd.lease_step != self._step or key not in rnd.leased:
            return False
        rnd.leased.discard(key)
        if rnd.leased is rnd.planned:  # it left the plan too: note_hit will not land it
            rnd.landing.add(key)
        if self._count_hits is not None:
            self._count_hits(1)
        return True

    # ------------------------------------------------------------ lookups
    def admits(self, key: Any, ctx: Any) -> bool:
        """Whether a lookup of ``key`` for request ``ctx`` may be answered HIT
        (if on disk).

        False (counted in ``lookups_withheld``) for every key outside the
        request's plan; the tier then answers MISS without asking the disk.
        """
        self._quiet = False
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
            if not self._plan_and_lease(rnd, key):
                rnd.protect_only = True
                return self._admits_unplanned(key, ctx)
        elif rnd is None:
            if not ctx.get_offload_key_position(key):
                return self._admits_unplanned(key, ctx)  # no positions: no plan
            rnd = self._rounds[ctx.req_id] = _Round(ctx, self._step)
            if not self._plan_and_lease(rnd, key):
                del self._rounds[ctx.req_id]
                return self._admits_unplanned(key, ctx)
        elif not rnd.plans:
            return self._admits_unplanned(key, ctx)
        elif not rnd.closed and rnd.step != self._step and rnd.plans < MAX_PLANS and rnd.needs(key):
            self._plan_and_lease(rnd, key)
        if key in rnd.planned:
            return True
        self.lookups_withheld += 1
        return False

    def note_hit(self, key: Any, ctx: Any) -> None:
        """The tier answers HIT for ``key`` of request ``ctx`` (after ``admits``)."""
        self._quiet = False
        if self._hot.ctx is not None:
            self._cool()
        if self._pending:
            self._note_pending()
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
        self._quiet = False
        self._cool()
        pending = self._pending
        head = keys
        tail: Iterable[Any] = ()
        if pending:
            # The usual load: the request's first HIT (noted in _unloaded)
            # then every HIT of its hot lookups, in order, as one job. Those
            # (the job's end, compared by identity) were never noted: nothing
            # to take out of _unloaded for them unless it still holds keys
            # once the job's head is taken out (then they may be there too).
            hits = pending[-1][0]
            n = len(hits)
            if type(keys) is list and len(keys) >= n and keys[len(keys) - n :] == hits:
                pending.pop()
                head, tail = keys[: len(keys) - n], hits
            if pending:
                self._note_pending()
        unloaded = self._unloaded
        if unloaded:
            # dict.pop over the keys at C speed (no Python frame per key).
            deque(map(unloaded.pop, head, repeat(None)), maxlen=0)
            if unloaded and tail:
                deque(map(unloaded.pop, tail, repeat(None)), maxlen=0)

    def note_load_job(self, job_id: int, keys: Collection[Any], ctx: Any) -> None:
        """vLLM submitted promotion job ``job_id`` of ``keys`` for ``ctx``."""
        self.note_loaded(keys)
        if self._view is not None and self._rounds:
            self._load_jobs[job_id] = keys

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
        if self._hot.ctx is not None:
            self._cool()
        if success and ok_keys is None:
            for rnd in self._rounds.values():
                if rnd.landing:
                    break
            else:
                # No round waits on a chunk (the usual load: its request was
                # scheduled in the step of its HITs, and vLLM's own
                # prepare_load holds its chunks): nothing to make ready or
                # pin, nothing changed.
                return
        self._quiet = False
        if not success or ok_keys is not None:
            # Some of its chunks did not land: every round asks again.
            for rnd in self._rounds.values():
                rnd.in_flight_n = -1
        landed = keys if ok_keys is None and success else ok_keys or ()
        if not landed:
            return
        generation = view.generation()
        made_ready = False
        for rnd in self._rounds.values():
            if not rnd.landing or rnd.generation != generation:
                continue
            # One pass over the job's keys (no set of them built), and the
            # round's landing emptied at once when they were all of it.
            mine = rnd.landing.intersection(landed)
            if not mine:
                continue
            if not made_ready:
                view.make_ready(landed if type(landed) is list else list(landed), rnd.ctx)
                made_ready = True
            view.pin(list(mine), rnd.ctx)
            if rnd.pinned:
                rnd.pinned.update(mine)
            else:
                rnd.pinned = mine
            if len(mine) == len(rnd.landing):
                rnd.landing = set()
            else:
                rnd.landing.difference_update(mine)
            rnd.in_flight_n = -1

    def track(self, ctx: Any) -> None:
        """A new request (``on_new_request``): waiting until vLLM schedules it."""
        self._waiting[ctx.req_id] = ctx

    def track_call(self) -> Callable[[str, Any], None]:
        """``track`` as one bound C call per request: the waiting map's own
        ``__setitem__`` needs the id, so the adapter calls
        ``track_call()(ctx.req_id, ctx)``; kept for vLLM's scheduler thread,
        where every Python frame per request counts."""
        return self._waiting.__setitem__

    # ------------------------------------------------------------ steps
    def end_step_call(self) -> Callable[..., None]:
        """``end_step`` as one native call (``nvmetier._table.GuardCall``,
        native/nvt_guard_calls.c): while no round is open (nothing planned,
        pinned, noted or protected), the step's scheduled requests leave the
        waiting map and the step is counted in C; any other call is this
        method. An end of step that schedules and preempts nothing while the
        guard is quiet (its first lines) is counted in C too, rounds open or
        not. For vLLM's scheduler thread, where a frame per step counts.
        (A subclass that overrides ``end_step`` gets its own method.)"""
        if type(self).end_step is not PromotionGuard.end_step:
            return self.end_step
        return GuardCall("end_step", self, self.end_step, *self._idle_state())

    def finish_call(self) -> Callable[[str], None]:
        """``finish`` as one native call, as ``end_step_call``: a request
        with no round leaves the waiting map in C."""
        if type(self).finish is not PromotionGuard.finish:
            return self.finish
        return GuardCall("finish", self, self.finish, *self._idle_state())

    def _idle_state(self) -> tuple[Any, ...]:
        """What a GuardCall reads to tell that no round is open (the guard's
        own containers, never replaced: cleared in place)."""
        return (
            self._waiting,
            self._rounds,
            self._protect_spent,
            self._pending,
            self._unloaded,
            self._hot,
        )

    def end_step(
        self, new_req_ids: Collection[str] = (), preempted_req_ids: Collection[str] = ()
    ) -> None:
        """End of a scheduler step (after vLLM submitted its promotions and
        pinned the loads of the requests it scheduled)."""
        if self._quiet and not new_req_ids and not preempted_req_ids:
            # Nothing of the guard's changed since the last end of step found
            # every round waiting (``_quiet``): this one would find the same.
            view = self._view
            if view is None or view.generation() == self._quiet_generation:
                self._step += 1
                return
        self._quiet = False
        if self._hot.ctx is not None:
            self._cool()
        self._step += 1
        rounds = self._rounds
        waiting = self._waiting
        if not rounds and not preempted_req_ids:
            # No round to close or pin (every request that reached the tier
            # finished): the step's scheduled requests stop waiting, at C speed.
            if new_req_ids:
                deque(map(waiting.pop, new_req_ids, repeat(None)), maxlen=0)
                if self._protect_spent:
                    self._protect_spent.difference_update(new_req_ids)
            if self._pending:
                self._note_pending()
            if self._unloaded:
                self._count_unloaded()
            self._set_quiet(True)  # no round: the next end of step has nothing to do
            return
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
        # The usual step while promotions are in flight: every round waits on
        # keys all in jobs in flight, or holds no pin to count idle steps of.
        # Then _pin_landed and _expire_idle would pass over each round and
        # change nothing: one pass (_rounds_waiting) instead of their two.
        view = self._view
        quiet = True
        if rounds and view is not None and not self._rounds_waiting(view):
            self._pin_landed()
            self._expire_idle()
            quiet = False  # it may have changed something: the next step looks again
        if self._pending:
            self._note_pending()
        if self._unloaded:
            self._count_unloaded()
        self._set_quiet(quiet)

    def _set_quiet(self, quiet: bool) -> None:
        """End of ``end_step``: whether the next one only counts its step,
        against the CPU tier's generation now."""
        self._quiet = quiet
        if quiet:
            view = self._view
            self._quiet_generation = None if view is None else view.generation()

    def finish(self, req_id: str) -> None:
        """The request finished: drop its pins and forget its round."""
        self._quiet = False
        if self._hot.ctx is not None:
            self._cool()
        self._waiting.pop(req_id, None)
        if self._protect_spent:
            self._protect_spent.discard(req_id)
        if self._rounds:
            rnd = self._rounds.pop(req_id, None)
            if rnd is not None:
                self._release(rnd)

    def release_all(self) -> None:
        """Drop every pin and round (before vLLM resets the CPU tier, or at
        shutdown): requests plan afresh at their next lookup."""
        self._quiet = False
        self._cool()
        for rnd in self._rounds.values():
            self._release(rnd)
        self._rounds.clear()
        self._load_jobs.clear()

    def stats(self) -> dict[str, int]:
        """Counters and gauges for the tier's metrics (the HITs answered
        from leases are told to ``count_hits`` first, by ``_cool``)."""
        self._cool()
        return {
            "hits_not_loaded": self.hits_not_loaded,
            "lookups_withheld": self.lookups_withheld,
            "requests_larger_than_cpu_tier": self.requests_larger_than_cpu_tier,
            "promotion_pins": sum(len(r.pinned) for r in self._rounds.values()),
        }

    def _expire_idle(self) -> None:
        """End the rounds whose request stays unscheduled with every
        promotion landed, so their pins do not hold the CPU tier for good."""
        gone = []
        for req_id, rnd in self._rounds.items():
            if rnd.closed or not rnd.pinned or rnd.landing:
                continue
            rnd.idle_steps += 1
            if rnd.idle_steps <= HOLD_STEPS:
                continue
            if rnd.protect_only:  # never planned: its walk may still plan
                gone.append(req_id)
                self._release(rnd)
            else:
                self._close(rnd)
        for req_id in gone:
            del self._rounds[req_id]


def _all_absent(keys: list[Any]) -> list[int]:
    """The CPU tier's answers before the guard has a view of it."""
    return [ABSENT] * len(keys)


def _absent(key: Any) -> int:
    """The CPU tier's answer before the guard has a view of it."""
    return ABSENT


__all__ = [
    "HOLD_STEPS",
    "MAX_PLANS",
    "NOT_LOADED_LOG_INTERVAL_S",
    "NOWHERE",
    "PromotionGuard",
    "RequestPlanner",
    "check_cpu_tier_size",
    "group_chunking",
    "kv_groups",
    "longest_request_chunks",
]
