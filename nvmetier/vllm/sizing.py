"""The KV groups' layout as vLLM's connector walks them, and the CPU tier's size
against the longest request.

Owns ``kv_groups`` / ``group_chunking`` (per KV group: tokens per chunk and
sliding window in chunks, from vLLM 0.33's offloading config or, on 0.32,
from the connector's own group configs), ``longest_request_chunks`` and
``check_cpu_tier_size`` (the start-up warning when one ``max_model_len``
request does not fit in the CPU tier).

Threads: called while vLLM builds the tier (the scheduler's start); no I/O,
nothing blocks.
"""

from __future__ import annotations

import logging
from typing import Any

from nvmetier.config import format_size

logger = logging.getLogger("nvmetier.vllm")


def kv_groups(
    spec: Any, connector: tuple[tuple[int, int, int | None], ...] = ()
) -> tuple[tuple[int, int, int | None], ...]:
    """Per KV group of ``spec``: ``(group index, tokens per chunk, sliding
    window in chunks or None for full attention)``; empty when the spec does
    not say.

    vLLM 0.33's offloading config gives each group's window; 0.32's has none,
    so there the window comes from ``connector`` (``cpu_view.
    connector_groups``: the groups as vLLM's connector walks them), and a
    group neither names is taken as full attention (a plan that loads less,
    never one vLLM cannot load).
    """
    config = getattr(spec, "config", None)
    groups = getattr(config, "groups", None) or ()
    blocks_per_chunk = int(getattr(spec, "blocks_per_chunk", 0) or 0)
    walked = {index: (tpc, window) for index, tpc, window in connector}
    out = []
    for i, group in enumerate(groups):
        index = int(getattr(group, "group_id", i))
        tokens_per_chunk = int(getattr(group, "tokens_per_block", 0) or 0) * blocks_per_chunk
        if tokens_per_chunk <= 0:
            return tuple(connector)
        if hasattr(group, "sliding_window_size_in_chunks"):
            window = group.sliding_window_size_in_chunks
        else:
            window = walked.get(index, (0, None))[1]
        out.append((index, tokens_per_chunk, None if window is None else int(window)))
    return tuple(out) or tuple(connector)


def group_chunking(
    spec: Any, connector: tuple[tuple[int, int, int | None], ...] = ()
) -> tuple[tuple[int, int | None], ...]:
    """Per KV group of ``spec``: (tokens per chunk, sliding window in chunks
    or None for full attention); empty when the spec does not say. See
    ``kv_groups`` for where the windows come from."""
    return tuple((tpc, window) for _index, tpc, window in kv_groups(spec, connector))


def longest_request_chunks(
    spec: Any, connector: tuple[tuple[int, int, int | None], ...] = (), max_model_len: int = 0
) -> int:
    """CPU tier chunks one ``max_model_len`` request occupies (0: unknown).

    A full-attention group needs one chunk per ``tokens_per_block *
    blocks_per_chunk`` tokens; a sliding-window group only its window. The
    model length comes from the offloading config (vLLM >= 0.33), else from
    ``max_model_len`` (the connector's vLLM config, 0.32), else from vLLM's
    current config when one is set.
    """
    config = getattr(spec, "config", None)
    max_len = int(getattr(getattr(config, "model", None), "max_model_len", 0) or 0)
    if max_len <= 0:
        max_len = max_model_len or _current_max_model_len()
    groups = group_chunking(spec, connector)
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
