"""Which disk hits vLLM is told about: the promotion guard and the CPU tier check.

Owns ``PromotionGuard`` (per request, how many of its chunks the tier answers
HIT for, and the count of HITs vLLM did not load) and
``check_cpu_tier_size`` (the start-up warning when one longest request's
chunks do not fit in the CPU tier).

Threads: every method runs on vLLM's scheduler thread under the
orchestrator's lock (through ``NvmeTierManager``); nothing blocks, nothing
does I/O.

Why a guard. vLLM's ``TieringOffloadingManager.lookup`` promotes a chunk we
answer HIT for by reserving a CPU slot at once (``prepare_write``, evicting
the least recently used unpinned chunk) and answers the connector
HIT_PENDING; with no slot free it answers MISS. The connector's prefix walk
(``OffloadingConnectorScheduler._maximal_prefix_lookup``) looks every key of
the request up until the first MISS, and defers the request (asks again next
step) while any key was HIT_PENDING. Promoted chunks are evictable once their
read lands and until the request pins them (``prepare_load``), which happens
only when a walk finds no pending key. So for a request with more chunks on
disk than the CPU tier holds, every step goes:

1. the walk reaches the chunks it promoted last step (now HIT in the CPU tier),
2. then asks us for the next ones, and each of our HITs evicts one of (1),
3. until the CPU tier has no evictable slot: that lookup is a MISS, the walk
   stops, the request is deferred because of (2),

and the next step starts again at the chunks (2) evicted: a CPU tier's worth
of disk reads per step, nothing ever loaded. It ends only when a walk finds
no slot at its very first disk chunk (every slot still in flight), and the
request is recomputed from there; where the reads always land within a step,
it never ends. Under ``vllm serve`` (13-chunk CPU tier, 39-chunk prompts) that
read 0.4 to 8.3 GB per run, loaded nothing, and doubled the time to first
token (issue 21).

The policy (per request, by ``req_id``):

- **One promotion round.** The tier answers HIT for a request's chunks only in
  the step of its first HIT (the step whose walk promotes them). From the next
  step on, every lookup of that request that reaches the tier (a chunk the CPU
  tier does not hold: one never promoted, or one evicted since) is answered
  MISS. The walk then stops at the first chunk the CPU tier lost, the request
  is no longer deferred once its reads land, and it loads that prefix in one
  go and recomputes the rest.
- **A budget.** Within that step, at most ``budget`` HITs (``fraction`` of the
  CPU tier's chunk count, at least 1), less the chunks of the request that come
  before its first disk hit: the rest of the walk gets MISS, so the request
  never evicts its own promoted chunks in the same step, nor the chunks it
  already has in the CPU tier (the CPU tier's lookups do not refresh their
  recency, so a request's older chunks are the first a promotion would evict,
  and it would then load nothing, a loss against no disk tier). Where those
  chunks are in vLLM's GPU prefix cache instead (the tier cannot tell; vLLM
  passes the walk's start to no tier), the budget is smaller than it could be:
  the request recomputes more, never worse than with no disk tier. The
  chunk's place comes from ``ReqContext.get_offload_key_position`` (the end
  token vLLM's connector records for every key); without it, only the
  fraction bounds the round.
- Hence a request reads at most ``budget`` chunks from disk over its life
  (at most the CPU tier's size), is deferred by the tier at most until its
  one round of reads lands (a read that fails or is cancelled completes the
  job too), and loads a prefix or nothing. Requests that never got a HIT are
  untouched. The state of a request goes with ``on_request_finished``.

A HIT whose key is in no ``submit_load`` by the end of the step
(``note_loaded`` never saw it) is a chunk vLLM found no CPU slot for: counted
in ``hits_not_loaded`` and logged (at most once a minute) with what to do.

Not covered: a request preempted after its load is recomputed past what the
CPU tier still holds (its round is spent); sliding-window groups (scanned from
the end) share the same budget, so a hybrid model may load less than fits.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from nvmetier.config import format_size

logger = logging.getLogger("nvmetier.vllm")

# Seconds between two "hits not loaded" warnings (the count in between is summed).
NOT_LOADED_LOG_INTERVAL_S = 60.0


@dataclass
class _Round:
    """One request's promotion round."""

    step: int  # the step of its first HIT; HITs are answered in this step only
    budget: int  # HITs it may get in that step
    hits: int = 0  # HITs answered in that step
    closed: bool = False


class PromotionGuard:
    """Bounds the disk hits of each request to what the CPU tier can take.

    Args:
        cpu_chunks: chunks of the CPU primary tier.
        fraction: share of them one request may promote in its round (0, 1].
        longest_request_chunks: chunks of one ``max_model_len`` request, for
            the warning (0 when unknown).
        chunk_bytes: bytes of one CPU tier chunk (for the warning).
        tier_label: the tier's metric label (for the warning).
        group_chunking: per KV group, ``(tokens per chunk, sliding window in
            chunks or None)``: how many chunks a request holds before a token
            position (empty: unknown, the fraction alone bounds a round).
        enabled: bound each request's HITs (False: every chunk on disk is a
            HIT, vLLM's own behaviour; HITs not loaded are still counted).
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
    ) -> None:
        self.enabled = enabled
        self.cpu_chunks = cpu_chunks
        self.budget = max(1, int(cpu_chunks * fraction))
        self.hits_not_loaded = 0
        self.lookups_withheld = 0
        self._longest = longest_request_chunks
        self._chunk_bytes = chunk_bytes
        self._tier_label = tier_label
        self._groups = tuple((tpc, w) for tpc, w in group_chunking if tpc > 0)
        self._step = 0
        self._rounds: dict[str, _Round] = {}
        # HITs answered this step that no submit_load took yet: key -> req_id.
        self._unloaded: dict[Any, str] = {}
        self._last_log = -math.inf
        self._not_logged = 0
        self._not_logged_reqs = 0

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

    def admits(self, key: Any, ctx: Any) -> bool:
        """Whether a lookup of ``key`` for request ``ctx`` may be answered HIT
        (if on disk).

        False (counted in ``lookups_withheld``) once the request's round is
        over or its budget is spent, or when its chunks before ``key`` leave
        no room; the tier then answers MISS without asking the disk.
        """
        if not self.enabled:
            return True
        req_id = ctx.req_id
        rnd = self._rounds.get(req_id)
        if rnd is None:  # no HIT yet: a round starts here if there is room
            budget = self._request_budget(key, ctx)
            if budget > 0:
                return True
            self._rounds[req_id] = _Round(self._step, budget, closed=True)
            self.lookups_withheld += 1
            return False
        if not rnd.closed and rnd.step == self._step and rnd.hits < rnd.budget:
            return True
        rnd.closed = True
        self.lookups_withheld += 1
        return False

    def note_hit(self, key: Any, ctx: Any) -> None:
        """The tier answers HIT for ``key`` of request ``ctx`` (after ``admits``)."""
        req_id = ctx.req_id
        if self._unloaded.get(key) == req_id:  # a key looked up twice counts once
            return
        self._unloaded[key] = req_id
        if self.enabled:
            rnd = self._rounds.get(req_id)
            if rnd is None:
                rnd = self._rounds[req_id] = _Round(self._step, self._request_budget(key, ctx))
            rnd.hits += 1

    def note_loaded(self, keys: Iterable[Any]) -> None:
        """vLLM submitted a load (promotion) of ``keys``."""
        if self._unloaded:
            pop = self._unloaded.pop
            for key in keys:
                pop(key, None)

    def end_step(self) -> None:
        """End of a scheduler step (after vLLM submitted its promotions)."""
        self._step += 1
        if not self._unloaded:
            return
        n = len(self._unloaded)
        reqs = set(self._unloaded.values())
        self._unloaded.clear()
        self.hits_not_loaded += n
        self._not_logged += n
        self._not_logged_reqs += len(reqs)
        for req_id in reqs:
            rnd = self._rounds.get(req_id)
            if rnd is not None:
                rnd.closed = True
        now = time.monotonic()
        if now - self._last_log >= NOT_LOADED_LOG_INTERVAL_S:
            self._last_log = now
            self._warn_not_loaded()

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

    def finish(self, req_id: str) -> None:
        """The request finished: forget its round."""
        self._rounds.pop(req_id, None)

    def stats(self) -> dict[str, int]:
        """Counters for the tier's metrics."""
        return {
            "hits_not_loaded": self.hits_not_loaded,
            "lookups_withheld": self.lookups_withheld,
        }


def group_chunking(spec: Any) -> tuple[tuple[int, int | None], ...]:
    """Per KV group of ``spec``: (tokens per chunk, sliding window in chunks
    or None for full attention); empty when the spec does not say."""
    config = getattr(spec, "config", None)
    groups = getattr(config, "groups", None) or ()
    blocks_per_chunk = int(getattr(spec, "blocks_per_chunk", 0) or 0)
    out = []
    for group in groups:
        tokens_per_chunk = int(getattr(group, "tokens_per_block", 0) or 0) * blocks_per_chunk
        if tokens_per_chunk <= 0:
            return ()
        window = getattr(group, "sliding_window_size_in_chunks", None)
        out.append((tokens_per_chunk, None if window is None else int(window)))
    return tuple(out)


def longest_request_chunks(spec: Any) -> int:
    """CPU tier chunks one ``max_model_len`` request occupies (0: unknown).

    A full-attention group needs one chunk per ``tokens_per_block *
    blocks_per_chunk`` tokens; a sliding-window group only its window. The
    model length comes from the offloading config (vLLM >= 0.33), else from
    vLLM's current config when one is set.
    """
    config = getattr(spec, "config", None)
    max_len = int(getattr(getattr(config, "model", None), "max_model_len", 0) or 0)
    if max_len <= 0:
        max_len = _current_max_model_len()
    groups = group_chunking(spec)
    if max_len <= 0 or not groups:
        return 0
    total = 0
    for tokens_per_chunk, window in groups:
        chunks = max_len // tokens_per_chunk
        total += chunks if window is None else min(chunks, window + 1)
    return total


def _current_max_model_len() -> int:
    try:
        from vllm.config import get_current_vllm_config
    except ImportError:  # pragma: no cover - depends on the vLLM build
        return 0
    try:
        model_config = get_current_vllm_config().model_config
    except Exception:  # no config set: nothing to warn about
        return 0
    return int(getattr(model_config, "max_model_len", 0) or 0)


def check_cpu_tier_size(
    longest_chunks: int, cpu_chunks: int, chunk_bytes: int, tier_label: str
) -> bool:
    """Warn when one longest request's chunks cannot all be in the CPU tier.

    vLLM loads a disk hit through a CPU slot, so a prompt with more chunks on
    disk than the CPU tier holds can load at most a CPU tier's worth of them.

    Returns:
        True when it warned.
    """
    if longest_chunks <= cpu_chunks or longest_chunks <= 0:
        return False
    need = longest_chunks * chunk_bytes
    logger.warning(
        "nvmetier[%s]: vLLM's CPU tier holds %d chunks but one request of max_model_len "
        "tokens has %d: a prompt longer than the CPU tier loads at most %d of its chunks "
        "from disk and recomputes the rest. Set cpu_bytes_to_use to at least %d (%s) so the "
        "longest prompt's disk hits can all be loaded (docs/vllm.md, 'Sizing the CPU tier')",
        tier_label,
        cpu_chunks,
        longest_chunks,
        cpu_chunks,
        need,
        format_size(need),
    )
    return True
