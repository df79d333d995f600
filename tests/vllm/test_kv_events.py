"""KV cache events of the disk tier, through vLLM's own events pipeline.

vLLM's connector turns the manager's ``OffloadingEvent``s into KV cache
events with its ``OffloadingEventsTracker`` (``scheduler.take_events``): the
scheduler snapshots each stored chunk's block hashes (``record_store``) and the
tracker keeps them while some tier that announced ``removal_expected`` still
holds the chunk, so that chunk's removal names all of them. Here a chunk is 4
blocks of 16 tokens (4 block hashes; its key is the last one), the scheduler
side is played as vLLM's ``_build_store_jobs`` does it, and a router-like
consumer replays the events.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections import Counter
from collections.abc import Iterable
from typing import Any

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.offloading.events")

import torch
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventsTracker,
    get_offloading_event_group_spec,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    GroupOffloadConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.kv_offload.base import Medium, ReqContext, make_offload_key
from vllm.v1.kv_offload.config import OffloadingCacheConfig
from vllm.v1.request import Request

from nvmetier.vllm import compat
from nvmetier.vllm.harness import SimulatedEngine, make_config, payload_of

from .conftest import nvme_tier

BLOCK_TOKENS = 16
HASHES_PER_CHUNK = 4
CHUNK_TOKENS = BLOCK_TOKENS * HASHES_PER_CHUNK
BLOCK_BYTES = 16 << 10  # a chunk: 64 KiB

pytestmark = pytest.mark.skipif(
    not compat.EVENTS_TRACK_TIER_COPIES,
    reason="this vLLM's OffloadingEvent has no ownership/removal_expected",
)


class Scheduler:
    """vLLM's scheduler side of the offloading connector, for events: stores
    each request's chunks in the CPU tier (``_build_store_jobs`` records
    every chunk it stores) and drains the manager's events through the
    tracker (``take_events``)."""

    def __init__(self, eng: SimulatedEngine) -> None:
        self.eng = eng
        spec = FullAttentionSpec(
            block_size=BLOCK_TOKENS, num_kv_heads=1, head_size=64, dtype=torch.float16
        )
        event_spec = get_offloading_event_group_spec(KVCacheGroupSpec(["l0"], spec))
        self.group = GroupOffloadConfig(
            group_idx=0,
            tokens_per_block=BLOCK_TOKENS,
            tokens_per_chunk=CHUNK_TOKENS,
            hashes_per_chunk=HASHES_PER_CHUNK,
            kv_event_group_spec=event_spec,
            sliding_window_size_in_chunks=None,
            kv_cache_spec=spec,
            manager_cls=FullAttentionManager,
        )
        config = eng.spec.kv_events_config
        assert config.enable_kv_cache_events and config.self_describing_kv_events
        # 0.33 also takes the groups' static specs; 0.32 only the config.
        if len(inspect.signature(OffloadingEventsTracker).parameters) > 1:
            self.tracker = OffloadingEventsTracker(config, {0: event_spec})
        else:
            self.tracker = OffloadingEventsTracker(config)
        self.hasher = get_request_block_hasher(BLOCK_TOKENS, sha256)
        self.n = 0

    def request(self, n_chunks: int) -> Request:
        self.n += 1
        tokens = [(self.n * 7919 + i) % 50000 for i in range(n_chunks * CHUNK_TOKENS)]
        return Request(
            f"r{self.n}", tokens, SamplingParams(max_tokens=1), None, block_hasher=self.hasher
        )

    def store(self, req: Request) -> list[bytes]:
        """The request's chunks into the CPU tier (cascading to the disk)."""
        keys = chunk_keys(req)
        manager = self.eng.manager
        ctx = ReqContext(req_id=req.request_id)
        with manager.lock:
            manager.on_new_request(ctx)
            out = manager.prepare_store(keys, ctx)
        if out is not None and out.keys_to_store:
            chunk_ids = out.store_spec.chunk_ids  # type: ignore[attr-defined]
            for key, cid in zip(out.keys_to_store, chunk_ids, strict=True):
                self.eng.rows[int(cid)] = payload_of(key, self.eng.chunk_bytes)
                self.tracker.record_store(req, self.group, keys.index(key), key)
            with manager.lock:
                manager.complete_store(out.keys_to_store, ctx)
        with manager.lock:
            manager.on_request_finished(ctx)
        return keys

    def take_events(self) -> list[Any]:
        with self.eng.manager.lock:
            raw = list(self.eng.manager.take_events())
        return list(self.tracker.take_events(raw))


def chunk_keys(req: Request) -> list[bytes]:
    n = len(req.block_hashes) // HASHES_PER_CHUNK
    return [make_offload_key(req.block_hashes[(c + 1) * HASHES_PER_CHUNK - 1], 0) for c in range(n)]


def chunk_hashes(req: Request, chunk: int) -> set[Any]:
    first = chunk * HASHES_PER_CHUNK
    return {maybe_convert_block_hash(h) for h in req.block_hashes[first : first + HASHES_PER_CHUNK]}


class Router:
    """What a KV-aware router keeps: per medium, a reference count per block
    hash (vLLM asks consumers to count repeated announcements)."""

    def __init__(self) -> None:
        self.held: dict[str, Counter[Any]] = {}

    def replay(self, events: Iterable[Any]) -> None:
        for ev in events:
            held = self.held.setdefault(ev.medium, Counter())
            if isinstance(ev, BlockStored):
                held.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                held.subtract(ev.block_hashes)

    def hashes(self, medium: str) -> set[Any]:
        return {h for h, n in self.held.get(medium, Counter()).items() if n > 0}


@pytest.fixture
def scheduler(tmp_path) -> Any:
    init_none_hash(sha256)  # the seed vLLM draws at start (a fixed one for sha256)
    config = make_config(
        [nvme_tier(str(tmp_path / "kv"), capacity_bytes="2MiB", enable_kv_events=True)],
        chunk_bytes=BLOCK_BYTES,
        cpu_chunks=8 * HASHES_PER_CHUNK,  # 8 chunks of 4 blocks
        enable_kv_cache_events=True,
        extra={"self_describing_kv_events": True},
    )
    config = dataclasses.replace(
        config,
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK_TOKENS, blocks_per_chunk=4),
    )
    eng = SimulatedEngine(config)
    yield Scheduler(eng)
    eng.shutdown()


def test_disk_events_expect_their_removal_under_the_tier_label(scheduler) -> None:
    tier = scheduler.eng.tiers[0]
    scheduler.store(scheduler.request(2))
    scheduler.eng.wait_idle()
    with scheduler.eng.manager.lock:
        events = [e for e in scheduler.eng.manager.take_events() if e.medium is Medium.STORAGE]
    assert events and all(e.removal_expected for e in events)
    assert {e.ownership for e in events} == {tier.tier_label}


def test_a_disk_removal_names_every_block_hash_of_its_chunk(scheduler) -> None:
    eng, tier = scheduler.eng, scheduler.eng.tiers[0]
    req = scheduler.request(1)
    (key,) = scheduler.store(req)
    eng.wait_idle()
    # The CPU tier (8 chunks) evicts it first: newer chunks push it out ...
    for _ in range(8):
        scheduler.store(scheduler.request(1))
        eng.wait_idle()
    assert not eng.primary_has(key) and tier.store.contains(key)
    cpu_removed = [
        e for e in scheduler.take_events() if isinstance(e, BlockRemoved) and e.medium == MEDIUM_CPU
    ]
    assert chunk_hashes(req, 0) <= {h for e in cpu_removed for h in e.block_hashes}
    # ... then the disk drops it.
    assert tier.store.invalidate(key)
    removed = [
        e
        for e in scheduler.take_events()
        if isinstance(e, BlockRemoved) and e.medium == MEDIUM_STORAGE
    ]
    assert len(removed) == 1
    assert set(removed[0].block_hashes) == chunk_hashes(req, 0)


def test_a_router_replaying_the_events_holds_exactly_the_chunks_on_disk(scheduler) -> None:
    eng, tier = scheduler.eng, scheduler.eng.tiers[0]
    router = Router()
    requests = []
    # 60 chunks through an 8-chunk CPU tier and a 32-slot disk: both evict.
    for _ in range(30):
        req = scheduler.request(2)
        requests.append(req)
        scheduler.store(req)
        eng.wait_idle()
        router.replay(scheduler.take_events())
    stats = tier.store.stats()
    assert stats["evictions"] > 0 and stats["kv_events_lost"] == 0
    on_disk = set()
    for req in requests:
        for c, key in enumerate(chunk_keys(req)):
            if tier.store.contains(key):
                on_disk |= chunk_hashes(req, c)
    assert on_disk
    assert router.hashes(MEDIUM_CPU)  # the CPU tier's events are replayed too
    assert router.hashes(MEDIUM_STORAGE) == on_disk
