"""The machine under the benchmark: CPU clocks, heap settling, page cache, mounts.

Owns: ``_Cpu`` (process and calling-thread CPU time), ``_settle_heap``,
``drop_caches`` and ``machine_info`` for the report header. Called from the
benchmark's own thread; ``drop_caches`` blocks on ``sync``. Imports nothing
else of the benchmark.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import shutil
import time
from typing import Any

import numpy as np

from nvmetier.config import format_size
from nvmetier.thread_cpu import thread_times


def _settle_heap() -> None:
    """Collect, then freeze the heap, as vLLM's engine core does after start-up
    (``vllm.utils.gc_utils.freeze_gc_heap``). Without it a gen-2 collection over
    vLLM's and torch's objects lands inside the timed phase (tens of ms each)."""
    import gc

    gc.collect()
    gc.freeze()


class _Cpu:
    """Process CPU time (all threads) between construction and ``stop``, and
    the calling thread's share of it (``thread_s`` after ``stop``)."""

    def __init__(self) -> None:
        self.thread_s = 0.0
        self._thread = time.thread_time()
        self._t = os.times()

    def stop(self) -> tuple[float, float]:
        t = os.times()
        self.thread_s = time.thread_time() - self._thread
        return t.user - self._t.user, t.system - self._t.system


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) of this process's live threads, summed by
    thread name (``nvt-uring-0``, ``nvmetier-io-3``, ``iou-wrk-...``). A
    profile of where the process's CPU goes; threads that already exited are
    missing. Never raises."""
    out: dict[str, float] = {}
    for name, user, system, _total in thread_times().values():
        out[name] = out.get(name, 0.0) + user + system
    return out


def machine_cpu() -> tuple[int, int]:
    """(busy, total) jiffies of every CPU of the machine (``/proc/stat``): the
    share of the cores anything used (the drives' kernel threads, other
    processes) over a phase. (0, 0) when unreadable."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields) - idle, sum(fields)
    return 0, 0


def busy_cores(start: tuple[int, int], end: tuple[int, int]) -> float:
    """Cores busy on average between two ``machine_cpu()`` readings."""
    total = end[1] - start[1]
    return (end[0] - start[0]) / total * (os.cpu_count() or 1) if total > 0 else 0.0


def xxh3_s_per_gb(bs: int, total_bytes: int = 512 << 20) -> float:
    """CPU seconds per GB that XXH3-64 takes over ``bs``-byte chunks (the
    floor of a checksummed tier's own work), with the tier's own native build
    (``nvmetier._table.xxh3``: AVX-512 or AVX2 where the CPU has them). Warm
    data: a chunk just written by a device's DMA costs more (cache misses;
    ``--profile`` also measures that, ``nvmetier.bench.cpuprof``)."""
    from nvmetier import _table

    chunk = memoryview(os.urandom(bs))
    n = max(1, total_bytes // bs)
    t0 = time.thread_time()
    for i in range(n):
        _table.xxh3(chunk, i)
    dt = time.thread_time() - t0
    return dt / (n * bs / 1e9)


def drop_caches() -> tuple[bool, str]:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``. Never raises."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True, "dropped"
    except OSError as exc:
        return False, f"could not drop the page cache ({exc}); buffered reads may be inflated"


def _fs_of(path: str) -> str:
    """``"ext4 on /dev/vda"`` for the mount holding ``path``."""
    path = os.path.realpath(path)
    best = ("", "?", "?")
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best[0]):
                best = (mnt, fstype, dev)
    return f"{best[1]} on {best[2]} (mounted at {best[0]})"


def machine_info(directory: str) -> dict[str, Any]:
    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = 0
    with contextlib.suppress(OSError, ValueError):
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host_cpus": os.cpu_count(),
        "cpu_model": cpu,
        "memory": format_size(mem) if mem else "?",
        "kernel": platform.release(),
        "python": platform.python_version(),
        "filesystem": _fs_of(directory),
        "free_bytes": shutil.disk_usage(directory).free,
    }


def disk_requests(path: str) -> tuple[int, int] | None:
    """(reads, writes) completed so far by the block device holding ``path``,
    from /proc/diskstats (whole-device counts: other processes' I/O on the same
    device is included). None where it cannot be told (tmpfs, no /proc)."""
    try:
        st = os.stat(path)
        major, minor = os.major(st.st_dev), os.minor(st.st_dev)
        with open("/proc/diskstats") as f:
            for line in f:
                p = line.split()
                if int(p[0]) == major and int(p[1]) == minor:
                    return int(p[3]), int(p[7])
    except (OSError, ValueError, IndexError):
        return None
    return None


_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def vllm_like_primary(length: int, tag: str = "bench", shm_dir: str | None = None) -> mmap.mmap:
    """A primary of ``length`` bytes made as vLLM's CPU tier makes its own.

    vLLM 0.33's ``SharedOffloadRegion`` creates ``/dev/shm/vllm_offload_*.mmap``,
    ``ftruncate``s it, maps it ``MAP_SHARED`` and pre-faults the whole region
    with one ``MADV_POPULATE_WRITE`` (a per-page write where the kernel lacks
    it); the file is unlinked once mapped. Its pages are whatever tmpfs gives:
    4 KiB and physically scattered unless the host enables shmem huge pages
    (``shmem_enabled`` or a ``huge=`` mount; see docs/vllm.md).
    ``shm_dir`` (else ``NVMETIER_BENCH_SHM_DIR``, else ``/dev/shm``) picks
    another tmpfs, e.g. one mounted ``huge=within_size``, to measure that case.
    """
    shm_dir = shm_dir or os.environ.get("NVMETIER_BENCH_SHM_DIR", "/dev/shm")
    path = os.path.join(shm_dir, f"nvmetier_{tag}_{os.getpid()}.mmap")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.unlink(path)
        os.ftruncate(fd, length)
        buf = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    try:
        buf.madvise(_MADV_POPULATE_WRITE, 0, length)
    except OSError:
        np.frombuffer(buf, dtype=np.uint8)[:: mmap.PAGESIZE] |= 0
    return buf
