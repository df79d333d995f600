"""I/O engine selection: ``threads`` (always available) or ``uring`` (native).

Owns: the choice of engine. ``NVMETIER_ENGINE=threads|uring`` overrides the
configured ``io_engine`` (used to run the whole test suite once per engine).
Called once per store open, on the constructing thread; probing io_uring may
take a few milliseconds.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from nvmetier.engine.base import (
    COMPLETION_DTYPE,
    OP_DTYPE,
    OP_READ,
    OP_WRITE,
    Completion,
    IoEngine,
    Op,
)
from nvmetier.engine.threads import ThreadEngine
from nvmetier.errors import ConfigError, EngineUnavailableError

if TYPE_CHECKING:
    from nvmetier.engine.sealed import Sealing

__all__ = [
    "COMPLETION_DTYPE",
    "OP_DTYPE",
    "OP_READ",
    "OP_WRITE",
    "Completion",
    "IoEngine",
    "Op",
    "ThreadEngine",
    "count_drives",
    "inflight_bytes",
    "make_engine",
    "resolve_engine_name",
    "resolve_workers",
    "uring_status",
]

logger = logging.getLogger(__name__)

ENGINE_ENV = "NVMETIER_ENGINE"
# Forces the io_uring worker count over io_workers (an integer or "auto"): runs
# a test suite with several workers, as ENGINE_ENV runs it per engine.
WORKERS_ENV = "NVMETIER_IO_WORKERS"
ENGINE_NAMES = ("auto", "threads", "uring")

# Bytes in flight per drive: enough ops of the chunk size to keep an NVMe
# drive's queue busy (fio reaches a drive's rate from ~8 ops of 2 MiB), within
# bounds that keep small chunks deep enough and large ones from hoarding.
DRIVE_INFLIGHT_CHUNKS = 32
DRIVE_INFLIGHT_MIN_BYTES = 32 << 20
DRIVE_INFLIGHT_MAX_BYTES = 64 << 20


def inflight_bytes(n_drives: int, chunk_bytes: int, cap_bytes: int) -> int:
    """Bytes in flight over ``n_drives`` drives for chunks of ``chunk_bytes``.

    Per drive: ``DRIVE_INFLIGHT_CHUNKS`` chunks, at least 32 MiB and at most
    64 MiB (2 MiB chunks: 64 MiB, 32 ops; 8 MiB: 64 MiB, 8 ops; 64 KiB:
    32 MiB, where ``queue_depth`` binds first). The total is capped by
    ``cap_bytes`` (``max_inflight_bytes``). The engine splits it evenly
    between the drives.
    """
    per_drive = min(
        DRIVE_INFLIGHT_MAX_BYTES,
        max(DRIVE_INFLIGHT_MIN_BYTES, DRIVE_INFLIGHT_CHUNKS * max(1, chunk_bytes)),
    )
    return max(1, min(cap_bytes, max(1, n_drives) * per_drive))


def _block_members(dev: int) -> int:
    """Member drives of block device ``dev`` (a RAID/dm device's slaves), 1
    for a plain drive or when sysfs does not say."""
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    try:
        members = len(os.listdir(os.path.join(base, "slaves")))
    except OSError:
        members = 0
    return max(1, members)


def count_drives(fds: Sequence[int]) -> int:
    """Distinct drives under ``fds``: files on one filesystem count once, a
    RAID or device-mapper device counts as its member drives. Never raises."""
    devices: set[int] = set()
    for fd in fds:
        try:
            devices.add(os.fstat(fd).st_dev)
        except OSError:
            continue
    return max(1, sum(_block_members(d) for d in devices))


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. a cgroup cpuset)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def resolve_workers(io_workers: int | str, fds: Sequence[int], per_drive: int = 1) -> int:
    """The io_uring worker count for ``io_workers`` (an int or ``"auto"``).

    ``"auto"``: one worker per drive (``count_drives``), at most
    ``usable_cpus()`` and at most 64. One worker moves ~8 GB/s of checked
    I/O on one core of the development machine (docs/bench.md), about one
    PCIe Gen4 NVMe drive, so one per drive keeps each drive's queue fed; a
    faster drive gets more only when set explicitly. ``per_drive`` (2 with
    staging, whose copy out of the arena doubles the I/O thread's work per
    byte) multiplies the drive count, still at most the usable CPUs.

    ``NVMETIER_IO_WORKERS`` (an integer 1..64 or ``auto``) overrides it.

    Raises:
        ConfigError: ``NVMETIER_IO_WORKERS`` holds something else.
    """
    forced = os.environ.get(WORKERS_ENV, "").strip()
    if forced:
        if forced != "auto" and not (forced.isdigit() and 1 <= int(forced) <= 64):
            raise ConfigError(
                f"{WORKERS_ENV}={forced!r} is not a worker count; use an integer from 1 to 64 "
                "or 'auto', or unset it"
            )
        io_workers = forced if forced == "auto" else int(forced)
    if io_workers == "auto":
        return max(1, min(64, per_drive * count_drives(fds), usable_cpus()))
    return int(io_workers)


def uring_status() -> tuple[bool, str]:
    """Whether the io_uring engine can run here, and if not, why.

    Never raises: a missing extension, ``kernel.io_uring_disabled`` and a
    seccomp filter all come back as ``(False, reason)``.
    """
    try:
        from nvmetier.engine import uring
    except ImportError as exc:  # extension not built
        return False, f"native extension not available ({exc})"
    return uring.probe()


def resolve_engine_name(configured: str) -> tuple[str, str]:
    """Pick the engine for ``configured`` (``auto|threads|uring``).

    Returns:
        (name, reason): the engine to use and a sentence saying why.

    Raises:
        ConfigError: ``NVMETIER_ENGINE`` holds an unknown name.
        EngineUnavailableError: ``uring`` was asked for and cannot run.
    """
    forced = os.environ.get(ENGINE_ENV, "").strip()
    if forced:
        if forced not in ("threads", "uring"):
            raise ConfigError(
                f"{ENGINE_ENV}={forced!r} is not an engine; use 'threads' or 'uring', or unset it"
            )
        configured = forced
    if configured == "threads":
        return "threads", "io_engine is 'threads'" if not forced else f"{ENGINE_ENV}=threads"
    ok, why = uring_status()
    if configured == "uring":
        if not ok:
            raise EngineUnavailableError(
                f"io_engine 'uring' is unavailable on this machine: {why}; "
                "set io_engine to 'auto' or 'threads'"
            )
        return "uring", "io_engine is 'uring'" if not forced else f"{ENGINE_ENV}=uring"
    if ok:
        return "uring", "io_uring probed OK"
    return "threads", f"io_uring unusable: {why}"


def _sealing_workers(workers: int, io_workers: int | str, sealing: Sealing | None) -> int:
    """Workers of a sealing io_uring engine: with ``auto``, at least one per
    usable CPU (at most 8). Each worker seals its writes before their SQEs
    and opens its reads before publishing them (~0.2 s of one core per GB):
    one worker per drive would put all of that on one core and serialize it
    with the drive's I/O; the file's ops alternate between its workers."""
    if sealing is None or str(io_workers) != "auto" or os.environ.get(WORKERS_ENV, "").strip():
        return workers
    return max(workers, min(usable_cpus(), 8))


def make_engine(
    name: str,
    buffer: memoryview,
    fds: Sequence[int],
    *,
    io_threads: int,
    queue_depth: int,
    register_buffers: bool = True,
    max_inflight_bytes: int = 64 << 20,
    io_workers: int | str = 1,
    chunk_bytes: int | None = None,
    keepalive_fd: int = -1,
    staging: bool = False,
    sealing: Sealing | None = None,
) -> IoEngine:
    """Construct the engine ``name`` (already resolved) over ``buffer`` and ``fds``.

    For ``uring``: ``io_workers`` rings (``resolve_workers``); with
    ``chunk_bytes`` the bytes in flight are sized per drive
    (``inflight_bytes``), capped by ``max_inflight_bytes``; without it
    ``max_inflight_bytes`` is used as given; ``keepalive_fd`` (the store's
    lock fd) is registered in every ring so a dead process's lock outlives
    its queued writes. The thread engine uses ``io_threads`` and ignores the
    rest (its threads die with the process, and the lock only then).
    ``staging``: move ops through huge-page staging memory (see
    ``nvmetier.memory``); each uring worker's arena is twice its byte cap
    (ops in flight, and reads reaped but not yet copied out).
    With ``sealing`` both seal and open every chunk in their own threads
    (``engine/sealed.py``); ``buffer`` is then the primary itself. Staging
    then holds the sealed slot image: a write is sealed from the row into the
    arena and written from there, a read lands there and is opened from
    there into the row (no copy either way, only huge pages under the I/O).
    """
    if name == "threads":
        return ThreadEngine(buffer, fds, n_threads=io_threads, staging=staging, sealing=sealing)
    if name == "uring":
        from nvmetier.engine import uring

        if chunk_bytes is not None:
            max_inflight_bytes = inflight_bytes(len(fds), chunk_bytes, max_inflight_bytes)
        return uring.UringEngine(
            buffer,
            fds,
            queue_depth=queue_depth,
            register_buffers=register_buffers,
            max_inflight_bytes=max_inflight_bytes,
            workers=_sealing_workers(
                resolve_workers(io_workers, fds, per_drive=2 if staging else 1), io_workers, sealing
            ),
            keepalive_fd=keepalive_fd,
            staging_bytes=2 * max_inflight_bytes if staging else 0,
            sealing=sealing,
        )
    raise ConfigError(f"unknown I/O engine {name!r}; use one of {ENGINE_NAMES}")
