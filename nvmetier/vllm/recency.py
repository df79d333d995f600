"""Disk recency for the prefix hits the disk never sees.

vLLM asks a secondary tier only about chunks that neither the GPU prefix
cache nor the CPU tier holds, and neither 0.32's nor 0.33's offloading
connector calls a tier's ``touch``. Left alone, the disk's recency (LRU within
each hash set, ``nvmetier.store``) would only know when a chunk was stored or
last loaded from disk, so a system prompt that every request hits in the CPU
tier would be the first thing the disk evicts, and gone after a restart.

What does see every chunk of a request is its ``ReqContext``: the connector's
``update_offload_keys`` records the end token of each key of each KV group
(``set_offload_key_position``) as the request's block hashes grow, GPU prefix
hits included, and the orchestrator hands that context to every tier's
``on_request_finished`` once the request's stores were submitted (0.32 and
0.33 alike). ``request_keys`` turns it into the keys to touch; the tier touches
them in one native call (``BlockStore.touch``), which refreshes the chunks the
disk holds and leaves the rest alone.

Owns: no state. Scheduler thread (under the orchestrator's lock); no I/O,
never blocks.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

from nvmetier.vllm.cpu_view import POSITIONS_ATTR, key_positions

logger = logging.getLogger(__name__)

_warned_missing = False


def request_keys(req_context: Any, max_chunks: int) -> list[bytes]:
    """The keys of a request's chunks in touch order, at most ``max_chunks``.

    Every key the scheduler derived for the request (all KV groups, prompt
    and generated tokens), tail first and head last, so that of two chunks in
    one disk set the head, which every longer prompt with this prefix needs
    first, ends up the more recent.

    Bounded: the work is ``O(min(keys, max_chunks))`` at C speed (a copy of
    the dict's keys, or a slice of it), whatever the prompt's length. The
    scheduler adds keys in prefix order (each ``update_offload_keys`` call
    appends every group's new keys, group by group), so a request with more
    keys than ``max_chunks`` keeps the first ones it recorded: for one KV
    group exactly its prefix; for several, the earliest chunks, first
    group's first.

    Returns:
        The keys, or ``[]`` when the context records none (a request the
        connector never tracked) or this vLLM keeps no positions (warned once).
    """
    positions = key_positions(req_context)
    if positions is None:
        _warn_missing(req_context)
        return []
    if len(positions) <= max_chunks:
        return list(reversed(positions))
    keys = list(itertools.islice(positions, max_chunks))
    keys.reverse()
    return keys


def _warn_missing(req_context: Any) -> None:
    global _warned_missing
    if _warned_missing:
        return
    _warned_missing = True
    logger.warning(
        "nvmetier: vLLM's %s has no %s; CPU-tier and GPU prefix-cache hits cannot refresh "
        "the disk's recency (hot prefixes may be evicted from disk first). Set "
        "recency_refresh_chunks: 0 to silence this",
        type(req_context).__name__,
        POSITIONS_ATTR,
    )
