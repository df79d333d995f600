"""The promotion guard through vLLM's orchestrator and CPU tier, with the
real ``NvmeTierManager`` on disk: the cases issue 27 reported, each loading
what fits in the CPU tier where the earlier guard loaded nothing or less.

``walk_model.WalkModel`` steps vLLM's scheduler walk over KV groups; the
disk is filled by a first server (a roomy CPU tier) and read by a second one
(a warm restart, an empty CPU tier smaller than a prompt).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence

import pytest

from nvmetier.vllm import METRIC_PREFIX
from tests.vllm.conftest import nvme_tier
from tests.vllm.walk_model import GroupConfig, WalkModel

FULL = GroupConfig(0, 16, None)
FULL_AND_WINDOW1 = (FULL, GroupConfig(1, 16, 1))
FULL_AND_WINDOW2 = (FULL, GroupConfig(1, 16, 2))
TWO_FULL = (FULL, GroupConfig(1, 16, None))


def hashes(name: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{name}:{i}".encode()).digest() for i in range(n)]


@pytest.fixture
def models() -> Iterator[list[WalkModel]]:
    built: list[WalkModel] = []
    yield built
    for m in built:
        m.shutdown()


def restarted(
    models: list[WalkModel],
    root: str,
    groups: Sequence[GroupConfig],
    cpu_chunks: int,
    prompts: dict[str, list[bytes]],
    **tier_kw: object,
) -> WalkModel:
    """A server that computed ``prompts`` (stored to disk through a roomy CPU
    tier), then a fresh one on the same disk with ``cpu_chunks``."""
    first = WalkModel(
        groups,
        cpu_chunks=256,
        tier=nvme_tier(root),
        rng=random.Random(0),
        reads_land_in_step=True,
        store_whole_windows=True,
    )
    models.append(first)
    for name, chunk_hashes in prompts.items():
        first.add(f"first-{name}", chunk_hashes, 5, 0)
    first.run(50)
    first.settle()
    first.tier.store.wait_idle(timeout_s=10.0)
    first.shutdown()
    models.remove(first)
    second = WalkModel(
        groups,
        cpu_chunks=cpu_chunks,
        tier=nvme_tier(root, **tier_kw),
        rng=random.Random(0),
        reads_land_in_step=True,
    )
    models.append(second)
    return second


def counter(m: WalkModel, name: str) -> float:
    stats = m.manager.get_stats()
    values = stats.reduce() if stats is not None else {}
    return float(values.get(f"{METRIC_PREFIX}{name}:{(m.tier.tier_label,)}", 0))


@pytest.mark.parametrize(("groups", "positions"), [(FULL_AND_WINDOW1, 11), (FULL_AND_WINDOW2, 10)])
def test_a_hybrid_prompt_longer_than_the_cpu_tier_loads_the_positions_that_fit(
    tmp_path, models, groups: Sequence[GroupConfig], positions: int
) -> None:
    """CPU tier 12 chunks, a 14-chunk prompt all on disk (every window
    chunk stored, as a retention interval of one chunk keeps them): full
    attention needs a chunk per position, the window 1 or 2 more. The
    earlier guard spent its budget on the full group and loaded 0 tokens."""
    prompt = hashes("p", 14)
    m = restarted(models, str(tmp_path / "kv"), groups, 12, {"p": prompt})
    r = m.add("p", prompt, 5, 0)
    m.run(20)
    assert r.finished
    assert r.loaded_tokens == positions * 16
    window = groups[1].sliding_window_size_in_chunks or 0
    assert counter(m, "ops_read") == positions + window  # every read loaded
    assert counter(m, "hits_not_loaded") == 0


def test_two_full_groups_load_every_position_that_fits(tmp_path, models) -> None:
    """CPU tier 10 chunks, two full-attention groups, a 5-chunk prompt: 5
    positions of 2 chunks (the earlier guard loaded 2 and wasted 6 reads)."""
    prompt = hashes("p", 5)
    m = restarted(models, str(tmp_path / "kv"), TWO_FULL, 10, {"p": prompt})
    r = m.add("p", prompt, 5, 0)
    m.run(20)
    assert r.finished and r.loaded_tokens == 80
    assert counter(m, "ops_read") == 10


def test_a_request_keeps_its_cpu_chunks_while_the_next_one_promotes(tmp_path, models) -> None:
    """A has its first 4 chunks in the CPU tier and the rest on disk; B,
    walked after A in the same step, has all its chunks on disk. A's plan
    pins its 4 chunks, B promotes only into what is left: A loads at least
    its 4 (the earlier guard let B evict them, and A loaded 0)."""
    a, b = hashes("a", 10), hashes("b", 10)
    m = restarted(models, str(tmp_path / "kv"), (FULL,), 13, {"a": a, "b": b})
    head = m.add("head", a[:4], 0, 0)  # puts A's head in the CPU tier
    m.run(20)
    assert head.finished
    ra = m.add("a", a, 5, 0)
    rb = m.add("b", b, 5, 0)
    m.run(30)
    assert ra.finished and rb.finished
    assert ra.loaded_tokens is not None and ra.loaded_tokens >= 4 * 16
    assert ra.loaded_tokens + (rb.loaded_tokens or 0) == 13 * 16  # the CPU tier, all used
    assert counter(m, "hits_not_loaded") == 0


def test_pinned_cpu_chunks_are_not_counted_as_room(tmp_path, models) -> None:
    """3 of 13 CPU chunks pinned by another load: a request with 5 chunks in
    the CPU tier plans only into the 5 left, never evicting its own prefix
    (the earlier guard evicted it and loaded 2 instead of 5)."""
    prompt = hashes("p", 20)
    other = hashes("o", 3)
    m = restarted(models, str(tmp_path / "kv"), (FULL,), 13, {"p": prompt})
    warm = m.add("warm", prompt[:5], 0, 0)
    pinned = m.add("pinned", other, 0, 0)
    m.run(20)
    assert warm.finished and pinned.finished
    ctx_keys = [k for ks in pinned.keys.values() for k in ks]
    with m.manager.lock:
        m.manager.prepare_load(ctx_keys, pinned.ctx)  # another request's load in flight
    r = m.add("p", prompt, 5, 0)
    m.run(20)
    assert r.finished
    assert r.loaded_tokens == 10 * 16  # 5 in the CPU tier + 5 promoted into the room left
    assert counter(m, "hits_not_loaded") == 0
    with m.manager.lock:
        m.manager.complete_load(ctx_keys, pinned.ctx)


def test_a_preempted_request_plans_again_when_it_walks_again(tmp_path, models) -> None:
    """A request preempted after its load walks again from scratch (its GPU
    blocks are gone): the guard drops its pins and plans anew, so it loads
    its disk hits a second time instead of being told MISS for good."""
    prompt = hashes("p", 8)
    m = restarted(models, str(tmp_path / "kv"), (FULL,), 16, {"p": prompt})
    m.p_preempt = 1.0  # preempted in the step after its first scheduling
    r = m.add("p", prompt, 5, 0)
    for _ in range(3):
        m.step()
    m.p_preempt = 0.0
    m.run(20)
    assert r.finished
    assert len(r.loads) == 2 and all(len(keys) == 8 for keys in r.loads)
    stats = m.manager.get_stats()
    assert stats is not None
    assert stats.reduce()[f"{METRIC_PREFIX}promotion_pins:{(m.tier.tier_label,)}"] == 0


def test_every_counter_is_exported_at_zero_from_the_first_payload(tmp_path, models) -> None:
    """An operator's alert on hits_not_loaded or lookups_withheld needs the
    series before anything was counted (issue 27: absent until first counted)."""
    from nvmetier.vllm import METRICS

    m = WalkModel((FULL,), cpu_chunks=8, tier=nvme_tier(str(tmp_path / "kv")), rng=random.Random(0))
    models.append(m)
    stats = m.manager.get_stats()
    assert stats is not None
    values = stats.reduce()
    label = (m.tier.tier_label,)
    for name, (kind, _doc) in METRICS.items():
        assert f"{METRIC_PREFIX}{name}:{label}" in values, name
        if kind == "counter":
            assert values[f"{METRIC_PREFIX}{name}:{label}"] == 0, name


def test_the_first_request_the_cpu_tier_cannot_hold_is_warned_with_the_size_that_fits(
    tmp_path, models, caplog
) -> None:
    import logging

    caplog.set_level(logging.WARNING, logger="nvmetier")
    prompt = hashes("p", 14)
    m = restarted(models, str(tmp_path / "kv"), FULL_AND_WINDOW1, 12, {"p": prompt})
    m.add("p", prompt, 5, 0)
    m.add("q", prompt, 9, 0)
    m.run(20)
    warned = [
        r.getMessage() for r in caplog.records if "needs 15 CPU tier chunks" in r.getMessage()
    ]
    assert len(warned) == 1  # once, then at most once a minute
    assert f"cpu_bytes_to_use >= {15 * 4096}" in warned[0] and "holds 12" in warned[0]
    assert counter(m, "requests_larger_than_cpu_tier") >= 1
