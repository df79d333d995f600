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
start (``reclaim_stale_offload_regions``).

Threads: the worker side runs on vLLM's model-runner thread, the copies
synchronous (they block that thread for the copy, as a forward pass would);
the scheduler side is vLLM's.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
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

logger = logging.getLogger(__name__)

# Where vLLM's SharedOffloadRegion puts the primary tier's file.
OFFLOAD_REGION_GLOB = "/dev/shm/vllm_offload_*.mmap*"
# A file younger than this may be between its creation and its first mapping
# by a starting server: never reclaimed.
STALE_REGION_MIN_AGE_S = 120.0

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


def _could_be_vllm(pid_dir: str) -> bool:
    """Whether a process whose maps we may not read could be a vLLM process
    (a Python): then nothing can be called unmapped. Others (a sandbox's
    init, a daemon of another user) are not."""
    try:
        with open(os.path.join(pid_dir, "cmdline"), "rb") as f:
            cmd = f.read().lower()
    except FileNotFoundError:
        return False
    except PermissionError:
        return True
    return b"python" in cmd or b"vllm" in cmd


def _mapped_paths() -> set[str] | None:
    """Files mapped by any live process (from /proc/*/maps); None when a
    process that could be vLLM's cannot be read (then nothing may be called
    unmapped)."""
    mapped: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if "/dev/shm/vllm_offload_" in line:
                        mapped.add(line.split(None, 5)[-1].strip().removesuffix(" (deleted)"))
        except FileNotFoundError:  # the process exited meanwhile
            continue
        except PermissionError:
            if _could_be_vllm(os.path.dirname(maps)):
                return None
    return mapped


def reclaim_stale_offload_regions(min_age_s: float = STALE_REGION_MIN_AGE_S) -> list[str]:
    """Remove primary-tier files that no live process maps, older than ``min_age_s``.

    Such a file is left by a server killed before its shared region was
    unlinked (vLLM's own spec on a GPU server unlinks only on a clean
    shutdown); nothing can use it again (a new server uses a new engine id).

    Returns:
        The paths removed.
    """
    candidates = glob.glob(OFFLOAD_REGION_GLOB)
    if not candidates:
        return []
    mapped = _mapped_paths()
    if mapped is None:
        return []
    removed = []
    now = time.time()
    for path in candidates:
        try:
            if path in mapped or now - os.stat(path).st_mtime < min_age_s:
                continue
            os.unlink(path)
        except FileNotFoundError:
            continue
        removed.append(path)
    if removed:
        logger.info(
            "nvmetier: removed %d stale primary-tier file(s) of dead vLLM servers "
            "from /dev/shm (%s)",
            len(removed),
            ", ".join(os.path.basename(p) for p in removed),
        )
    return removed


class CpuTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` for vLLM's CPU platform.

    The scheduler side is vLLM's, plus: stale primary-tier files of dead
    servers are reclaimed before the primary tier is made, and this server's
    file is unlinked once mapped. The worker side is vLLM's
    ``CPUOffloadingWorker`` with ``CpuCopyHandler`` (plain memory copies).
    Works on GPU platforms too (the copies are then CPU copies of device
    memory, which is wrong: use vLLM's ``TieringOffloadingSpec`` there), so
    ``get_worker`` refuses a tensor that is not on the CPU.
    """

    _worker: Any

    @override
    def get_manager(self) -> Any:
        if self._manager is None:
            reclaim_stale_offload_regions()
            manager = super().get_manager()
            self._unlink_scheduler_region()
            return manager
        return super().get_manager()

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
        with _cpu_copy_handlers():
            worker = super().create_worker(kv_caches)
        # The scheduler unlinks the file once it mapped it too; the worker's
        # cleanup() must not try again (it would log a failure).
        region = getattr(worker, "_mmap_region", None)
        if region is not None:
            region._creator = False
        return worker
