"""CpuTieringOffloadingSpec's worker: vLLM's CPUOffloadingWorker and handler,
with plain memory copies, on CPU tensors (no server; tests/serve runs it under
a real vllm serve). Runs on whichever vLLM is installed (0.33 in .venv, 0.32
in .venv-serve)."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu import gpu_worker
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.gpu_worker import (
    CPUOffloadingWorker,
    SingleDirectionOffloadingHandler,
)

from nvmetier.vllm.cpu import CpuCopyHandler, _cpu_copy_handlers

PAGE = 4096  # bytes per "GPU" block per layer
BLOCKS = 8
PER_CHUNK = 2  # GPU blocks per offloaded chunk


@pytest.fixture(autouse=True)
def _cpu_platform_pinning(monkeypatch: pytest.MonkeyPatch) -> None:
    # What vLLM's CPU platform gives the worker in a CPU server (this
    # scheduler-side install detects no platform): no pinned memory, and
    # torch.cpu's stream functions.
    from vllm.platforms.cpu import CpuPlatform

    monkeypatch.setattr(gpu_worker, "PIN_MEMORY", False)
    monkeypatch.setattr(gpu_worker, "current_platform", CpuPlatform())


def make_worker() -> tuple[CPUOffloadingWorker, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    layers = [
        torch.randint(-128, 127, (BLOCKS, PAGE), dtype=torch.int8, generator=gen) for _ in range(2)
    ]
    kv = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=PAGE) for t in layers],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=PAGE) for i in (0, 1)]],
    )
    with _cpu_copy_handlers():
        worker = CPUOffloadingWorker(kv_caches=kv, blocks_per_chunk=PER_CHUNK, num_cpu_chunks=4)
    return worker, layers


def finished(worker: CPUOffloadingWorker) -> dict[int, bool]:
    return {r.job_id: r.success for r in worker.get_finished()}


def test_worker_is_vllms_with_cpu_copy_handlers_only_while_built() -> None:
    worker, _ = make_worker()
    assert isinstance(worker._store_handler, CpuCopyHandler)
    assert isinstance(worker._load_handler, CpuCopyHandler)
    assert gpu_worker.SingleDirectionOffloadingHandler is SingleDirectionOffloadingHandler


def test_store_then_load_moves_exactly_the_blocks_vllm_names() -> None:
    worker, layers = make_worker()
    original = [t.clone() for t in layers]
    # GPU blocks 1,2 -> CPU chunk 3 and 5,6 -> chunk 0 (two blocks per chunk).
    gpu = GPULoadStoreSpec([1, 2, 5, 6], [4], [0])
    assert worker.submit_store(1, gpu, CPULoadStoreSpec([3, 0]))
    assert finished(worker) == {1: True}
    cpu = worker._store_handler.dst_tensors
    for layer in (0, 1):
        assert torch.equal(cpu[layer][3], torch.cat([original[layer][1], original[layer][2]]))
        assert torch.equal(cpu[layer][0], torch.cat([original[layer][5], original[layer][6]]))
    for t in layers:
        t.zero_()
    # Back into other GPU blocks: chunk 3 -> 7,4 and chunk 0 -> 0,3.
    assert worker.submit_load(2, CPULoadStoreSpec([3, 0]), GPULoadStoreSpec([7, 4, 0, 3], [4], [0]))
    assert finished(worker) == {2: True}
    for layer in (0, 1):
        for dst, src in ((7, 1), (4, 2), (0, 5), (3, 6)):
            assert torch.equal(layers[layer][dst], original[layer][src])
        for untouched in (1, 2, 5, 6):
            assert not layers[layer][untouched].any()


def test_load_of_a_partial_first_chunk_skips_its_first_block() -> None:
    worker, layers = make_worker()
    original = [t.clone() for t in layers]
    assert worker.submit_store(1, GPULoadStoreSpec([1, 2], [2], [0]), CPULoadStoreSpec([2]))
    for t in layers:
        t.zero_()
    # Logical block 1 of the request: the second half of chunk 2 only.
    assert worker.submit_load(2, CPULoadStoreSpec([2]), GPULoadStoreSpec([6], [1], [1]))
    assert finished(worker) == {1: True, 2: True}
    for layer in (0, 1):
        assert torch.equal(layers[layer][6], original[layer][2])
        assert not layers[layer][1].any()


def test_stale_primary_tier_files_are_reclaimed_and_mapped_ones_kept() -> None:
    import mmap
    import os
    import uuid

    from nvmetier.vllm.cpu import reclaim_stale_offload_regions

    stale = f"/dev/shm/vllm_offload_nvmetier-test-{uuid.uuid4().hex}.mmap"
    mapped = f"/dev/shm/vllm_offload_nvmetier-test-{uuid.uuid4().hex}.mmap"
    young = f"/dev/shm/vllm_offload_nvmetier-test-{uuid.uuid4().hex}.mmap"
    for path in (stale, mapped, young):
        with open(path, "wb") as f:
            f.truncate(mmap.PAGESIZE)
    old = 1_000_000_000
    os.utime(stale, (old, old))
    os.utime(mapped, (old, old))
    with open(mapped, "r+b") as f:
        m = mmap.mmap(f.fileno(), mmap.PAGESIZE)
    try:
        removed = reclaim_stale_offload_regions()
        assert stale in removed
        assert not os.path.exists(stale)
        assert os.path.exists(mapped) and os.path.exists(young)
    finally:
        m.close()
        for path in (stale, mapped, young):
            if os.path.exists(path):
                os.unlink(path)
