"""The refresh at a request's finish and the loads it leaves to their own
marks (``NvmeTierManager.on_request_finished``, ``Table.touch(keys, loaded)``):
a load that did not take a chunk (missing when it ran) marked nothing for it,
so the refresh must mark it, as a full refresh would.

The tier is driven directly (its submit_load, get_finished_jobs and
on_request_finished, as vLLM's orchestrator calls them), over a 2 MiB disk of
one set (exact LRU), read by eviction.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob

from nvmetier.vllm.harness import key_of, record_positions
from tests.vllm.conftest import nvme_tier

pytestmark = pytest.mark.timeout(120)

_jobs = itertools.count(10**6)  # ids vLLM's orchestrator never gave


def test_a_chunk_its_load_missed_is_marked_by_the_refresh(tmp_path, make_engine) -> None:
    eng = make_engine([nvme_tier(str(tmp_path / "kv"), capacity_bytes="2MiB")], cpu_chunks=16)
    tier = eng.tiers[0]

    def put(keys: list[bytes]) -> None:
        tier.store.submit_store(next(_jobs), keys, list(range(len(keys))))
        assert tier.store.wait_idle(timeout_s=30)
        list(tier.get_finished_jobs())

    head, tail = key_of(1), key_of(2)
    put([head])
    ctx = ReqContext(req_id="req")
    record_positions(ctx, [head, tail], eng.tokens_per_chunk)
    with eng.manager.lock:
        tier.submit_load(
            TransferJob(
                job_id=next(_jobs),
                keys=[head, tail],  # the tail not on disk yet: the job fails it
                chunk_ids=np.array([0, 1], dtype=np.int32),
                is_promotion=True,
                req_context=ctx,
            )
        )
    assert tier.store.wait_idle(timeout_s=30)
    put([tail])  # stored since (another request): more recent than the head
    list(tier.get_finished_jobs())
    with eng.manager.lock:
        tier.on_request_finished(ctx)
    # A full refresh marks the tail, then the head: the tail goes first.
    store = tier.store
    for i in range(64):
        put([key_of(1000 + i)])
        if not (store.contains(head) and store.contains(tail)):
            break
    assert store.contains(head) and not store.contains(tail)
