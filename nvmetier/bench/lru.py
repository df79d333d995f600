"""The exact-LRU reference of the ``trace`` level: the prefix hits an exact LRU
cache of a given capacity would give a trace (``lru_hits``), every capacity at
once (``prefix_depths``, ``DepthProfile``), and the capacity curve of one
shared store against one store per replica (``capacity_curve``).

Owns: no state. Pure functions, no I/O, no threads; any thread may call them.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from nvmetier.bench.traces import TraceRequest

# A block that no finite LRU would serve (the first reference to its id).
NEVER = np.iinfo(np.int64).max


# --------------------------------------------------------------- exact LRU
@dataclasses.dataclass
class Hits:
    """Prefix hits of a replay or a simulation, in blocks and prompt tokens."""

    blocks: int
    tokens: int
    total_blocks: int
    total_tokens: int

    @property
    def block_ratio(self) -> float:
        return self.blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def token_ratio(self) -> float:
        return self.tokens / self.total_tokens if self.total_tokens else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "hit_blocks": self.blocks,
            "hit_tokens": self.tokens,
            "blocks": self.total_blocks,
            "tokens": self.total_tokens,
            "block_hit_ratio": round(self.block_ratio, 4),
            "token_hit_ratio": round(self.token_ratio, 4),
        }


def lru_hits(requests: Sequence[TraceRequest], capacity_blocks: int, block_tokens: int) -> Hits:
    """Prefix hits of an exact LRU cache of ``capacity_blocks`` blocks.

    Per request, as vLLM's scheduler looks a prompt up: its blocks in order
    until the first one not cached are hits; every block of the request is
    then referenced (the hits are loaded, the rest computed and stored), so it
    becomes the most recently used, and the least recently used blocks beyond
    the capacity are evicted.
    """
    cache: collections.OrderedDict[int, None] = collections.OrderedDict()
    hit_blocks = hit_tokens = total_blocks = total_tokens = 0
    for r in requests:
        prefix = True
        for bid, tok in zip(r.hash_ids, r.block_tokens(block_tokens), strict=True):
            if prefix and bid in cache:
                hit_blocks += 1
                hit_tokens += tok
            else:
                prefix = False
            if bid in cache:
                cache.move_to_end(bid)
            else:
                cache[bid] = None
                if len(cache) > capacity_blocks:
                    cache.popitem(last=False)
        total_blocks += len(r.hash_ids)
        total_tokens += r.input_length
    return Hits(hit_blocks, hit_tokens, total_blocks, total_tokens)


def prefix_depths(
    requests: Sequence[TraceRequest], block_tokens: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """For every block reference: the smallest LRU capacity (in blocks) that
    serves it as a prefix hit, and its tokens; plus the requests' prompt tokens.

    One pass of Mattson's stack algorithm: an LRU of capacity ``c`` holds a
    block iff its stack distance (distinct blocks referenced since its last
    reference, itself included) is at most ``c``, for every ``c`` at once. A
    block is a prefix hit iff it and every block before it in its request are
    held, so its depth is the running maximum of the distances in its request.
    ``NEVER`` marks first references. The distances come from a Fenwick tree
    over reference times that marks each block's latest reference:
    O(references x log references).
    """
    n = sum(len(r.hash_ids) for r in requests)
    tree = [0] * (n + 1)
    last: dict[int, int] = {}
    depths = np.empty(n, dtype=np.int64)
    tokens = np.empty(n, dtype=np.int64)
    total_tokens = 0
    t = 0
    for r in requests:
        run = 0
        for bid, tok in zip(r.hash_ids, r.block_tokens(block_tokens), strict=True):
            t += 1
            p = last.get(bid)
            if p is None:
                run = NEVER
            else:
                # Marks at or before p; those after it (all before t) are the
                # distinct blocks referenced since.
                before = 0
                i = p
                while i:
                    before += tree[i]
                    i &= i - 1
                d = len(last) - before + 1
                run = max(run, d)
                i = p
                while i <= n:
                    tree[i] -= 1
                    i += i & -i
            i = t
            while i <= n:
                tree[i] += 1
                i += i & -i
            last[bid] = t
            depths[t - 1] = run
            tokens[t - 1] = tok
        total_tokens += r.input_length
    return depths, tokens, total_tokens


@dataclasses.dataclass
class DepthProfile:
    """``prefix_depths`` sorted, for hits at any capacity in O(log n)."""

    depths: np.ndarray
    cum_tokens: np.ndarray
    total_blocks: int
    total_tokens: int

    @classmethod
    def of(cls, requests: Sequence[TraceRequest], block_tokens: int) -> DepthProfile:
        depths, tokens, total_tokens = prefix_depths(requests, block_tokens)
        order = np.argsort(depths, kind="stable")
        cum = np.concatenate([[0], np.cumsum(tokens[order])])
        return cls(depths[order], cum, len(depths), total_tokens)

    def hits(self, capacity_blocks: int) -> Hits:
        k = int(np.searchsorted(self.depths, capacity_blocks, side="right"))
        return Hits(k, int(self.cum_tokens[k]), self.total_blocks, self.total_tokens)


def capacity_curve(
    shared: DepthProfile, per_replica: Sequence[DepthProfile], capacities_blocks: Sequence[int]
) -> dict[str, list[float]]:
    """Hit ratios against total capacity: one store shared by all replicas, and
    one store of ``capacity // replicas`` per replica."""
    out: dict[str, list[float]] = {
        "shared_token_ratio": [],
        "shared_block_ratio": [],
        "per_replica_token_ratio": [],
        "per_replica_block_ratio": [],
    }
    n = len(per_replica)
    for c in capacities_blocks:
        s = shared.hits(c)
        parts = [p.hits(c // n) for p in per_replica]
        sum_p = _sum_hits(parts)
        out["shared_token_ratio"].append(round(s.token_ratio, 5))
        out["shared_block_ratio"].append(round(s.block_ratio, 5))
        out["per_replica_token_ratio"].append(round(sum_p.token_ratio, 5))
        out["per_replica_block_ratio"].append(round(sum_p.block_ratio, 5))
    return out


def _sum_hits(parts: Sequence[Hits]) -> Hits:
    return Hits(
        sum(h.blocks for h in parts),
        sum(h.tokens for h in parts),
        sum(h.total_blocks for h in parts),
        sum(h.total_tokens for h in parts),
    )
