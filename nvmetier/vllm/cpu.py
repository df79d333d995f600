"""vLLM's CPU platform: ``CpuTieringOffloadingSpec``, the tiering spec for CPU servers.

Used as::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "CpuTieringOffloadingSpec",
        "spec_module_path": "nvmetier.vllm.cpu", "cpu_bytes_to_use": ...,
        "secondary_tiers": [{"type": "nvme", "root_dir": ..., "capacity_bytes": ...}]}}'

What is vLLM's and what is ours: the spec is vLLM's ``TieringOffloadingSpec``
(scheduler side, primary tier, secondary tiers, metrics: all unchanged), and
its worker is vLLM's ``CPUOffloadingWorker`` with vLLM's
``SingleDirectionOffloadingHandler``, which computes the copy descriptors
(source address, destination address, size) exactly as on a GPU. Ours is only
what vLLM's CPU build cannot run there:

- the device checks: vLLM's ``CPUOffloadingSpec.get_worker`` raises unless the
  platform is CUDA-alike or XPU, and the handler asserts device tensors;
- the copy: instead of vLLM's stream-ordered ``swap_blocks_batch`` kernel (not
  in the CPU build), ``memcpy_descriptors`` copies each descriptor with a plain
  memory copy, synchronously. On the CPU platform every kernel has finished
  when the connector submits a transfer (there is no device queue), so the
  ordering vLLM's streams and events provide (stores after the model wrote
  the KV, loads after pending writes to the destination) holds by program
  order; the handler's streams and events become ``_SyncStream``/``_SyncEvent``,
  which record completion at once.

And one thing vLLM leaves to every stop: the primary tier's shared-memory file
``/dev/shm/vllm_offload_<engine_id>.mmap`` (``cpu_bytes_to_use`` of RAM) is
unlinked by vLLM only on a clean shutdown, and ``vllm serve`` never shuts its
engine down cleanly (docs/vllm.md). This spec unlinks it as soon as the
scheduler, the last process to open it, has mapped it (the workers map it
first, while the engine allocates the KV cache); the mappings stay valid and
the kernel frees the memory when the last process exits, however it exits.
Files left by servers that died before that point are reclaimed at the next
start (``reclaim_stale_offload_regions``), and a live server's never, from
any PID namespace: each worker process claims the file (a shared flock it
holds for its life) before vLLM opens it, and a reclaim removes only files
it can lock exclusively (``nvmetier.shm_region``).

Threads: the worker side runs on vLLM's model-runner thread, the copies
synchronous (they block that thread for the copy, as a forward pass would);
the scheduler side is vLLM's.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import time
from collections.abc import Iterator
from typing import Any, SupportsIndex

import numpy as np
import torch
from typing_extensions import override
from vllm.v1.kv_offload.cpu import gpu_worker as _vllm_gpu_worker
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from nvmetier.shm_region import (
    REGION_DIR,
    REGION_PATTERN,
    STALE_REGION_MIN_AGE_S,
    RegionClaim,
    claim_region,
    reclaim_stale_regions,
    region_path,
)

logger = logging.getLogger(__name__)

# Where vLLM's SharedOffloadRegion puts the primary tier's file.
OFFLOAD_REGION_GLOB = os.path.join(REGION_DIR, REGION_PATTERN)

_memmove = ctypes.memmove


def memcpy_descriptors(
    src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, **_kwargs: Any
) -> None:
    """Copy ``sizes[i]`` bytes from address ``src[i]`` to ``dst[i]``, for every i.

    The stand-in for vLLM's ``swap_blocks_batch`` kernel on the CPU platform,
    over the same descriptor arrays (int64 addresses and sizes). Keyword
    arguments of the kernel (``is_src_access_order_any``) have no meaning for
    a synchronous copy and are ignored.
    """
    n = int(sizes.numel())
    if n == 0:
        return
    srcs = src.numpy().view(np.uint64).tolist()
    dsts = dst.numpy().view(np.uint64).tolist()
    lens = sizes.numpy().tolist()
    for s, d, length in zip(srcs, dsts, lens, strict=True):
        _memmove(d, s, length)


class _SyncStream:
    """A transfer "stream" on the CPU platform: the copy has run by the time
    the handler records its end event, so there is nothing to order."""

    def wait_stream(self, _other: object) -> None:
        return

    def wait_event(self, _event: object) -> None:
        return


class _SyncEvent:
    """A completion event of a synchronous copy: complete once recorded."""

    def __init__(self) -> None:
        self._t = 0.0

    def record(self, _stream: object = None) -> None:
        self._t = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return

    def elapsed_time(self, end: _SyncEvent) -> float:
        """Milliseconds from this event to ``end`` (torch.Event's unit)."""
        return max(0.0, (end._t - self._t) * 1e3)


class _EndlessPool(list):  # type: ignore[type-arg]
    """The handler's stream/event pool: never empty, so vLLM's handler takes
    its streams and events from here and never asks the platform for a device
    stream or a ``torch.Event``."""

    def __init__(self, factory: type) -> None:
        super().__init__()
        self._factory = factory

    def __bool__(self) -> bool:
        return True

    def pop(self, index: SupportsIndex = -1) -> Any:
        return super().pop(index) if len(self) else self._factory()


class _DeviceChecksView:
    """What vLLM's handler constructor checks of a "GPU" tensor (dtype, ndim,
    device), for a CPU tensor. Only the constructor sees it; the handler then
    works on the real tensor."""

    is_cuda = True
    is_xpu = False

    def __init__(self, tensor: torch.Tensor) -> None:
        self.dtype = tensor.dtype
        self.ndim = tensor.ndim
        self.shape = tensor.shape


class CpuCopyHandler(_vllm_gpu_worker.SingleDirectionOffloadingHandler):
    """vLLM's ``SingleDirectionOffloadingHandler`` with plain memory copies.

    Everything but the copy is vLLM's: the constructor (copy plans for the
    direct and canonical layouts), ``transfer_async`` (descriptor computation,
    skip counts, writer rotation), ``get_finished``, ``wait`` and ``shutdown``.
    """

    def __init__(self, gpu_tensors: list[torch.Tensor], *args: Any, **kwargs: Any) -> None:
        super().__init__([_DeviceChecksView(t) for t in gpu_tensors], *args, **kwargs)  # type: ignore[misc]
        if self.gpu_to_cpu:
            self.src_tensors = list(gpu_tensors)
        else:
            self.dst_tensors = list(gpu_tensors)
        self._swap_blocks_batch = memcpy_descriptors
        self._stream_pool = _EndlessPool(_SyncStream)
        self._event_pool = _EndlessPool(_SyncEvent)


@contextlib.contextmanager
def _cpu_copy_handlers() -> Iterator[None]:
    """While vLLM's ``CPUOffloadingWorker`` is built, its handlers are
    ``CpuCopyHandler``. The worker resolves the handler class by module
    global at construction (0.32 and 0.33), in the worker process's one
    model-runner thread; restored right after."""
    original = _vllm_gpu_worker.SingleDirectionOffloadingHandler
    _vllm_gpu_worker.SingleDirectionOffloadingHandler = CpuCopyHandler  # type: ignore[misc]
    try:
        yield
    finally:
        _vllm_gpu_worker.SingleDirectionOffloadingHandler = original  # type: ignore[misc]


def _region_paths(region: Any) -> list[str]:
    """Every file backing a SharedOffloadRegion (0.33 may split it in segments)."""
    segments = getattr(region, "_segments", None)
    if segments:
        return [str(seg[0]) for seg in segments]
    return [str(region.mmap_path)]


def reclaim_stale_offload_regions(
    min_age_s: float = STALE_REGION_MIN_AGE_S, region_dir: str = REGION_DIR
) -> list[str]:
    """Remove primary-tier files of dead servers from ``region_dir``.

    A file is removed only while no server holds a claim on it (in any PID
    namespace), no visible process maps it, and it is older than
    ``min_age_s``; one of another user that this process may not remove is
    left with one warning naming its owner (``nvmetier.shm_region``). Such
    files are left by servers killed before their region was unlinked
    (vLLM's own spec on a GPU server unlinks only on a clean shutdown);
    nothing can use one again (a new server uses a new engine id).

    Returns:
        The paths removed.
    """
    return reclaim_stale_regions(region_dir, min_age_s)


class CpuTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` for vLLM's CPU platform.

    The scheduler side is vLLM's, plus: stale primary-tier files of dead
    servers are reclaimed before the primary tier is made, and this server's
    file is unlinked once mapped. The worker side is vLLM's
    ``CPUOffloadingWorker`` with ``CpuCopyHandler`` (plain memory copies),
    plus: each worker process claims the region file before vLLM opens it
    and holds the claim for its life, so no other server's reclaim removes
    it, whatever PID namespace that server sees (``nvmetier.shm_region``).
    Works on GPU platforms too (the copies are then CPU copies of device
    memory, which is wrong: use vLLM's ``TieringOffloadingSpec`` there), so
    ``get_worker`` refuses a tensor that is not on the CPU.
    """

    _worker: Any
    # This worker process's claim on the region file, held until it exits.
    _region_claim: RegionClaim | None = None

    @override
    def get_manager(self) -> Any:
        if self._manager is None:
            reclaim_stale_offload_regions()
            self._check_workers_region()
            manager = super().get_manager()
            self._unlink_scheduler_region()
            return manager
        return super().get_manager()

    def _check_workers_region(self) -> None:
        """Refuse to make the primary tier where the workers' region file is
        missing: vLLM would create a new, empty one that no worker shares
        (the workers make theirs while the engine allocates the KV cache,
        before it builds the scheduler, and hold claims on it)."""
        path = region_path(self.config.engine_id)
        if self.num_chunks > 0 and not os.path.exists(path):
            raise RuntimeError(
                f"nvmetier: the primary tier's file {path} is missing when the scheduler "
                "opens it, so the scheduler would make a new, empty region that the workers "
                "do not share (their file was removed: by hand, or by a program that ignores "
                "their claims). Restart the server"
            )

    def _unlink_scheduler_region(self) -> None:
        """Unlink the primary tier's file: every process that needs it has
        mapped it (the workers, while the engine allocated the KV cache before
        it built the scheduler; the scheduler, just now)."""
        region = getattr(self, "_scheduler_mmap", None)
        if region is None:
            return
        unlinked = []
        for path in _region_paths(region):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                unlinked.append(path)
        region._creator = False  # nothing left for its cleanup() to remove
        if unlinked:
            logger.info(
                "nvmetier: unlinked %s once mapped: the primary tier's memory is freed "
                "when the last vLLM process exits, however it exits",
                unlinked[0],
            )

    @override
    def get_worker(self, kv_caches: Any) -> Any:
        # vLLM's CPUOffloadingSpec.get_worker refuses any platform but
        # CUDA-alike and XPU; the worker itself is vLLM's, built below.
        if self._worker is None:
            for kv_tensor in kv_caches.tensors:
                device = kv_tensor.tensor.device.type
                if device != "cpu":
                    raise ValueError(
                        f"CpuTieringOffloadingSpec copies with the CPU, and the KV cache is on "
                        f"'{device}': use vLLM's TieringOffloadingSpec on a GPU server"
                    )
            self._worker = self.create_worker(kv_caches)
        return self._worker

    @override
    def create_worker(self, kv_caches: Any) -> Any:
        # Claimed before vLLM's SharedOffloadRegion opens the file, so the
        # region is never usable unclaimed; vLLM then joins the file the
        # claim created and sized (or a peer worker's claim did).
        claim = self._claim_region()
        try:
            with _cpu_copy_handlers():
                worker = super().create_worker(kv_caches)
        except BaseException:
            if claim is not None:
                if claim.created:
                    claim.remove()  # peers waiting for the file fail at once
                claim.release()
            raise
        self._region_claim = claim
        # The scheduler unlinks the file once it mapped it too; the worker's
        # cleanup() must not try again (it would log a failure).
        region = getattr(worker, "_mmap_region", None)
        if region is not None:
            region._creator = False
        return worker

    def _claim_region(self) -> RegionClaim | None:
        """Claim this engine's region file, as vLLM's ``SharedOffloadRegion``
        names and sizes it (one file: the tiering spec asks for no segments);
        None for a region of 0 chunks, which vLLM refuses on its own."""
        size_bytes = self.num_chunks * self.kv_bytes_per_chunk
        if size_bytes <= 0:
            return None
        from vllm.distributed.device_communicators.shm_broadcast import check_shm_free_space

        return claim_region(
            region_path(self.config.engine_id),
            size_bytes,
            check_space=functools.partial(
                check_shm_free_space, allocation_name="CPU KV offload shared region in /dev/shm"
            ),
        )
