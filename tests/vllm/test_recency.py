"""Prefix hits the disk never sees still refresh its recency (issue 27, item 6).

vLLM asks the disk only about chunks that neither the GPU prefix cache nor the
CPU tier holds, and its connector never calls a tier's ``touch``. Here a
6-chunk prefix shared by every request is served by the CPU tier (or the GPU
prefix cache) while each request's 4 new chunks flow to a 31-slot disk (one
set: exact LRU), 2.5 disks' worth in all. Through vLLM's real orchestrator and
CPU tier, driven as its connector drives them (``connector_model``), on the
installed vLLM (0.33 in ``.venv``, 0.32 in ``.venv-serve``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from vllm.v1.kv_offload.base import ReqContext

from nvmetier.vllm import METRIC_PREFIX
from nvmetier.vllm.harness import SimulatedEngine, key_of
from nvmetier.vllm.recency import request_keys
from tests.vllm.conftest import new_key, nvme_tier
from tests.vllm.connector_model import TOKENS_PER_CHUNK, ConnectorModel

pytestmark = pytest.mark.timeout(180)

CPU_CHUNKS = 16
DISK = "2MiB"  # 31 slots of 64 KiB chunks, all in one set
PREFIX = [key_of(9000 + j) for j in range(6)]
TAIL_CHUNKS = 4
ROUNDS = 20  # 80 new chunks: the disk is overwritten 2.5 times
MAX_STEPS = 20


def tail(i: int) -> list[bytes]:
    return [key_of(100 * (i + 1) + j) for j in range(TAIL_CHUNKS)]


def engine(
    make_engine: Callable[..., SimulatedEngine], root: str, **tier_kw: Any
) -> SimulatedEngine:
    return make_engine([nvme_tier(root, capacity_bytes=DISK, **tier_kw)], cpu_chunks=CPU_CHUNKS)


def serve(model: ConnectorModel, req_id: str, keys: list[bytes], gpu_cached: int = 0) -> Any:
    p = model.add(req_id, keys, gpu_cached=gpu_cached)
    model.run(MAX_STEPS)
    model.drain()
    assert p.finished
    return p


def run_rounds(eng: SimulatedEngine, hits_in: str) -> ConnectorModel:
    """Round 0 computes the prefix (stored to the CPU tier and the disk); each
    later round hits it in ``hits_in`` ("cpu" or "gpu") and computes 4 new
    chunks, which the CPU tier cascades to the disk."""
    model = ConnectorModel(eng, reads_land_in_step=True)
    first = serve(model, "r0", PREFIX + tail(0))
    assert first.hit_chunks == 0
    for i in range(1, ROUNDS):
        gpu_cached = len(PREFIX) if hits_in == "gpu" else 0
        p = serve(model, f"r{i}", PREFIX + tail(i), gpu_cached=gpu_cached)
        if hits_in == "cpu":
            assert p.hit_chunks == p.correct_chunks == len(PREFIX)
            assert model.chunks_read[p.ctx.req_id] == 0  # all from the CPU tier
    return model


def on_disk(eng: SimulatedEngine, keys: list[bytes]) -> list[bool]:
    store = eng.tiers[0].store
    return [store.contains(k) for k in keys]


@pytest.mark.parametrize("hits_in", ["cpu", "gpu"])
def test_a_prefix_hit_only_above_the_disk_stays_on_disk_while_other_chunks_are_evicted(
    tmp_path, make_engine, hits_in: str
) -> None:
    eng = engine(make_engine, str(tmp_path / "kv"))
    run_rounds(eng, hits_in)
    assert eng.tiers[0].store.stats()["evictions"] >= ROUNDS * TAIL_CHUNKS - 31
    assert not any(on_disk(eng, tail(0) + tail(1)))  # the early tails were evicted
    assert all(on_disk(eng, PREFIX))


@pytest.mark.parametrize("hits_in", ["cpu", "gpu"])
def test_with_the_refresh_off_a_prefix_hit_only_above_the_disk_is_evicted_first(
    tmp_path, make_engine, hits_in: str
) -> None:
    """What vLLM alone does: the disk sees the prefix once, when it is stored."""
    eng = engine(make_engine, str(tmp_path / "kv"), recency_refresh_chunks=0)
    run_rounds(eng, hits_in)
    assert not any(on_disk(eng, PREFIX))
    assert all(on_disk(eng, tail(ROUNDS - 1)))


def test_a_sealed_stores_prefix_hit_only_in_the_cpu_tier_stays_on_disk(
    tmp_path, make_engine
) -> None:
    eng = engine(make_engine, str(tmp_path / "kv"), **_sealing(tmp_path))
    assert eng.tiers[0].store.sealed
    run_rounds(eng, "cpu")
    assert not any(on_disk(eng, tail(0) + tail(1)))
    assert all(on_disk(eng, PREFIX))


def test_a_prefix_hot_in_the_cpu_tier_loads_from_disk_after_a_restart(
    tmp_path, make_engine
) -> None:
    root = str(tmp_path / "kv")
    eng = engine(make_engine, root)
    run_rounds(eng, "cpu")
    eng.shutdown()
    restarted = engine(make_engine, root)
    model = ConnectorModel(restarted, reads_land_in_step=True)
    p = serve(model, "after-restart", PREFIX + tail(ROUNDS))
    assert p.hit_chunks == p.correct_chunks == len(PREFIX)
    assert model.chunks_read["after-restart"] == len(PREFIX)


def test_a_request_with_more_chunks_than_the_bound_refreshes_only_its_head(
    tmp_path, make_engine
) -> None:
    eng = engine(make_engine, str(tmp_path / "kv"), recency_refresh_chunks=3)
    run_rounds(eng, "cpu")
    assert on_disk(eng, PREFIX) == [True] * 3 + [False] * 3


def test_chunks_touched_counts_the_prefix_chunks_a_cpu_hit_refreshed(tmp_path, make_engine) -> None:
    """Only chunks the disk holds count: the first request's own chunks are
    still being written when it finishes, the second's prefix is on disk."""
    eng = engine(make_engine, str(tmp_path / "kv"))
    model = ConnectorModel(eng, reads_land_in_step=True)
    label = (eng.tiers[0].tier_label,)
    name = f"{METRIC_PREFIX}chunks_touched:{label}"
    serve(model, "first", PREFIX + tail(0))
    assert eng.manager.get_stats().reduce().get(name, 0) == 0
    serve(model, "second", PREFIX + tail(1))
    assert eng.manager.get_stats().reduce()[name] == len(PREFIX)


def test_request_keys_are_the_contexts_keys_head_last() -> None:
    ctx = ReqContext(req_id="r")
    keys = [key_of(j) for j in range(5)]
    for j, key in enumerate(keys, 1):
        ctx.set_offload_key_position(key, j * TOKENS_PER_CHUNK)
    assert request_keys(ctx, 100) == keys[::-1]


def test_request_keys_of_a_long_request_are_its_first_max_chunks() -> None:
    ctx = ReqContext(req_id="r")
    keys = [key_of(j) for j in range(10_000)]
    for j, key in enumerate(keys, 1):
        ctx.set_offload_key_position(key, j * TOKENS_PER_CHUNK)
    assert request_keys(ctx, 4) == keys[:4][::-1]


def test_request_keys_of_an_untracked_request_are_none() -> None:
    assert request_keys(ReqContext(req_id="untracked"), 4096) == []


def _restarted_with_prefix_on_disk(tmp_path, make_engine, **tier_kw: Any) -> SimulatedEngine:
    """An engine restarted (the CPU tier empty) on a disk holding PREFIX."""
    root = str(tmp_path / "kv")
    eng = engine(make_engine, root, **tier_kw)
    serve(ConnectorModel(eng, reads_land_in_step=True), "r0", PREFIX + tail(0))
    eng.shutdown()
    restarted = engine(make_engine, root, **tier_kw)
    assert all(on_disk(restarted, PREFIX))
    return restarted


def _sealing(tmp_path) -> dict[str, Any]:
    pytest.importorskip("nvmetier._crypto")
    return {"encryption": {"key_file": new_key(tmp_path)}}


@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
def test_a_loaded_head_stays_more_recent_than_the_requests_other_chunks(
    tmp_path, make_engine, sealed: bool
) -> None:
    """Of a request's chunks in one disk set, the head must end up the most
    recent (``request_keys``), also when the head came from disk and the rest
    from the CPU tier: a head the load marked, then left out of the refresh
    that marks the rest later, is evicted before its own tail. (A sealed
    store's refresh marks every key again: it keeps no load's key list.)"""
    tier_kw = _sealing(tmp_path) if sealed else {}
    restarted = _restarted_with_prefix_on_disk(tmp_path, make_engine, **tier_kw)
    tier = restarted.tiers[0]
    submit_load = tier.submit_load
    kept: list[int] = []

    def watched(job: Any) -> None:
        submit_load(job)
        kept.append(len(tier._loads_of))

    tier.submit_load = watched
    model = ConnectorModel(restarted, reads_land_in_step=True)
    rest = tail(50)
    serve(model, "rest", rest)  # computed: in the CPU tier and on disk
    p = serve(model, "req", PREFIX + rest)
    assert model.chunks_read["req"] == len(PREFIX)  # the head from disk, the rest from the CPU
    assert p.hit_chunks == len(PREFIX) + len(rest)
    mine = PREFIX + rest
    for i in range(60, 80):  # new chunks until one of the request's is evicted
        serve(model, f"fill{i}", tail(i))
        if not all(on_disk(restarted, mine)):
            break
    assert not all(on_disk(restarted, mine))
    assert all(on_disk(restarted, PREFIX)), "the head went before the request's own tail"
    assert kept, "the request loaded nothing from disk"
    assert (max(kept) == 0) == sealed  # a plain store keeps the loads' keys for the refresh
