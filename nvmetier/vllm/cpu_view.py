"""What the promotion guard reads of vLLM: the CPU primary tier, a request's
keys and the KV cache groups' windows.

Owns every access the guard makes to vLLM objects that no tier interface
passes it, so ``nvmetier.vllm.promotion`` stays pure logic over small
protocols and the private names of vLLM are read in one place:

- ``PrimaryView``: the CPU primary tier (``CPUPrimaryTierOffloadingManager``)
  of the orchestrator this tier belongs to: whether a chunk is in it (ready or
  being written), how many chunks a promotion could take now (free plus
  evictable), and pins (``prepare_read`` / ``complete_load``, the same pair the
  orchestrator uses for a cascade) that keep a chunk a request will load from
  being evicted while the request waits for its promotions.
- ``request_keys``: a request's offload keys by KV group and chunk index, from
  the end token vLLM's connector records for every key
  (``ReqContext.set_offload_key_position``).
- ``connector_groups`` / ``connector_max_model_len``: the KV groups as vLLM's
  connector walks them (tokens per chunk and sliding window in chunks) and
  the longest request, read from the connector scheduler that is building
  this tier (vLLM 0.32's offloading config has neither).

Threads: the scheduler thread, under the orchestrator's lock; nothing blocks.
Each accessor degrades to "unknown" (None or empty) when a vLLM build lacks
what it reads; the guard then falls back to its per-request budget alone.
Tested on vLLM 0.32 and 0.33 (tests/vllm run in both environments).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from functools import partial
from types import FrameType
from typing import Any

from vllm.v1.kv_offload.base import get_offload_group_idx

# Residency of a chunk in the CPU tier (``PrimaryView.state``); ``residency``
# tells a ready chunk someone pinned (not evictable) apart as ``READY_HELD``.
ABSENT, PENDING, READY, READY_HELD = 0, 1, 2, 3

try:  # vLLM's default CPU tier policy, whose get is its map's get
    from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy as _LRU
except ImportError:  # pragma: no cover - depends on the vLLM build
    _LRU = None


def _policy_get(policy: Any) -> Callable[[Any], Any] | None:
    """The CPU tier policy's ``get`` (None: it has none), or, for vLLM's
    own LRU policy whose ``get`` is exactly ``self.chunks.get``, that dict's
    ``get`` itself (no Python frame per key; the dict is cleared in place on
    a reset, never replaced)."""
    get = getattr(policy, "get", None)
    if get is None or _LRU is None or type(policy).get is not _LRU.get:
        return get
    chunks = getattr(policy, "chunks", None)
    return chunks.get if type(chunks) is dict else get


class PrimaryView:
    """The CPU primary tier, as the guard sees it.

    Args:
        primary: vLLM's ``CPUPrimaryTierOffloadingManager``.
    """

    def __init__(self, primary: Any) -> None:
        self._primary = primary
        self._policy = getattr(primary, "_policy", None)
        self._pin = primary.prepare_read
        self._unpin = primary.complete_load
        self._complete_write = getattr(primary, "complete_write", primary.complete_store)
        from vllm.v1.kv_offload.base import LookupResult, ReqContext

        self._hit = LookupResult.HIT
        self._pending = LookupResult.HIT_PENDING
        # The CPU tier's lookup ignores its context; one serves every call.
        self._ctx = ReqContext(req_id="nvmetier-promotion-guard")

    def state(self, key: Any) -> int:
        """``READY``, ``PENDING`` (a write in flight) or ``ABSENT``."""
        result = self._primary.lookup(key, self._ctx)
        if result is self._hit:
            return READY
        return PENDING if result is self._pending else ABSENT

    def state_call(self) -> Callable[[Any], int]:
        """``state`` as one small function: vLLM's policy map read the way
        its ``lookup`` reads it (the guard's plan asks once per chunk)."""
        get = _policy_get(self._policy)
        if get is None:
            return self.state

        def state(key: Any) -> int:
            chunk = get(key)
            if chunk is None:
                return ABSENT
            return READY if chunk.is_ready else PENDING

        return state

    def residency_call(self) -> Callable[[Any], int]:
        """``state`` with a ready chunk's pins: ``READY`` (evictable),
        ``READY_HELD`` (pinned: ``evictable`` is False), ``PENDING`` or
        ``ABSENT``; one policy read per chunk."""
        get = _policy_get(self._policy)
        if get is None:

            def slow(key: Any) -> int:
                got = self.state(key)
                return READY_HELD if got == READY and not self.evictable(key) else got

            return slow

        def residency(key: Any) -> int:
            chunk = get(key)
            if chunk is None:
                return ABSENT
            if not chunk.is_ready:
                return PENDING
            return READY_HELD if getattr(chunk, "ref_cnt", 0) else READY

        return residency

    def residencies_call(self) -> Callable[[list[Any]], list[int]]:
        """``residency_call`` of many keys at once: one list, one policy read
        per key in a comprehension (no Python frame per key: vLLM's LRU
        policy's own map read directly, ``_policy_get``), and none of that
        when the CPU tier holds none of the keys (a request's chunks on disk
        only, the usual case)."""
        get = _policy_get(self._policy)
        if get is None:
            one = self.residency_call()
            return lambda keys: list(map(one, keys))

        def residencies(keys: list[Any]) -> list[int]:
            chunks = list(map(get, keys))
            if chunks.count(None) == len(chunks):
                return [ABSENT] * len(chunks)
            return [
                ABSENT
                if chunk is None
                else PENDING
                if not chunk.is_ready
                else READY_HELD
                if getattr(chunk, "ref_cnt", 0)
                else READY
                for chunk in chunks
            ]

        return residencies

    def room(self) -> int | None:
        """Chunks a promotion can take now: free plus evictable (None: unknown)."""
        free = getattr(self._primary, "_get_num_free_chunks", None)
        evictable = getattr(self._primary, "_num_evictable_cache_chunks", None)
        if free is None or not isinstance(evictable, int):
            return None
        return int(free()) + evictable

    def evictable(self, key: Any) -> bool:
        """Whether a ready chunk is unpinned (True when unknown: the
        conservative answer, pinning it then costs a slot of room)."""
        chunk = self._policy.get(key) if self._policy is not None else None
        ref_cnt = getattr(chunk, "ref_cnt", None)
        return ref_cnt is None or ref_cnt == 0

    def generation(self) -> int:
        """Changes when vLLM resets the CPU tier (pins taken before are void)."""
        return int(getattr(self._primary, "_cache_generation", 0))

    def generation_call(self) -> Callable[[], Any]:
        """``generation`` as one C call (``getattr`` bound by a partial): the
        guard's native end of step reads it every quiet step."""
        return partial(getattr, self._primary, "_cache_generation", 0)

    def pin(self, keys: list[Any], ctx: Any) -> None:
        """Pin ready chunks (ref_cnt + 1), as a cascade read does."""
        self._pin(keys, ctx)

    def make_ready(self, keys: list[Any], ctx: Any) -> None:
        """Complete the CPU writes of promoted chunks that landed (what the
        orchestrator does right after the tier reports the job; a second
        ``complete_write`` of a ready chunk is a no-op in vLLM)."""
        self._complete_write(keys, ctx, True)

    def unpin(self, keys: Iterable[Any], ctx: Any) -> int:
        """Drop one pin of each chunk still held; returns how many."""
        held = []
        policy = self._policy
        for key in keys:
            chunk = policy.get(key) if policy is not None else None
            if chunk is not None and getattr(chunk, "ref_cnt", 0) > 0:
                held.append(key)
        if held:
            self._unpin(held, ctx)
        return len(held)


def find_primary(offloading_spec: Any, tier: Any) -> Any:
    """The CPU primary tier of the orchestrator that holds ``tier``, or None.

    vLLM's ``TieringOffloadingSpec`` builds the tiers, then the orchestrator,
    and keeps it; by a tier's first lookup it is there.
    """
    manager = getattr(offloading_spec, "_manager", None)
    tiers = getattr(manager, "secondary_tiers", None) or ()
    if not any(t is tier for t in tiers):
        return None
    primary = getattr(manager, "primary_tier", None)
    needed = ("lookup", "prepare_read", "complete_load", "complete_store")
    if primary is None or not all(hasattr(primary, n) for n in needed):
        return None
    return primary


# vLLM's ReqContext keeps the key positions in a private dict (0.32 and 0.33);
# its public get_offload_key_position answers only for a key the caller knows.
POSITIONS_ATTR = "_offload_key_positions"


def key_positions(ctx: Any) -> dict[Any, int] | None:
    """Every key the connector recorded for a request -> its end token, in
    the order recorded (None: this vLLM keeps no such record)."""
    positions = getattr(ctx, POSITIONS_ATTR, None)
    return positions if isinstance(positions, dict) else None


def request_keys(ctx: Any) -> dict[int, dict[int, Any]]:
    """A request's keys: ``{group index: {end token: key}}`` (empty: unknown).

    Partial-tail keys (an end token inside a chunk) are included; the caller
    keeps the chunk-aligned ones.
    """
    positions = key_positions(ctx)
    if not positions:
        return {}
    out: dict[int, dict[int, Any]] = {}
    for key, end in positions.items():
        out.setdefault(get_offload_group_idx(key), {})[int(end)] = key
    return out


def connector_groups(max_depth: int = 16) -> tuple[tuple[int, int, int | None], ...]:
    """The KV groups of the connector scheduler building this tier:
    ``(group index, tokens per chunk, sliding window in chunks or None)``.

    vLLM's ``OffloadingConnectorScheduler.__init__`` sets its config (one
    ``GroupOffloadConfig`` per group, windows included, on 0.32 and 0.33)
    before it asks the spec for the manager, which builds this tier: the
    config is read from that caller's frame. Empty when the tier is built
    another way (a test harness, a future vLLM).
    """
    frame: FrameType | None = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        configs = getattr(getattr(owner, "config", None), "kv_group_configs", None)
        if configs:
            out = []
            for cfg in configs:
                window = getattr(cfg, "sliding_window_size_in_chunks", None)
                out.append(
                    (
                        int(cfg.group_idx),
                        int(cfg.tokens_per_chunk),
                        None if window is None else int(window),
                    )
                )
            return tuple(out)
        frame = frame.f_back
    return ()


def connector_max_model_len(max_depth: int = 16) -> int:
    """``max_model_len`` of the vLLM config the connector scheduler building
    this tier was given (its ``vllm_config`` argument; 0: not found). vLLM
    0.32's offloading config does not carry it."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            break
        vllm_config = frame.f_locals.get("vllm_config")
        model_config = getattr(vllm_config, "model_config", None)
        value = getattr(model_config, "max_model_len", None)
        if isinstance(value, int) and value > 0:
            return value
        frame = frame.f_back
    return 0
