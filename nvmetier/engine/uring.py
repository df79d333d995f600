"""io_uring I/O engine: the ``IoEngine`` over the native ``nvmetier._uring``.

Owns: ``workers`` io_urings, each driven by its own native I/O thread (all
inside the extension), plus a reference to the caller's buffer from
construction to ``close``. Ops are routed to a worker of their file (one file
per drive), so every drive keeps its queue depth and each worker hashes the
ops it completes. The files are borrowed (the store opens and closes them; they must
stay open until ``close`` returns).

Threads: ``submit`` is called by the store's caller (the scheduler thread); it
only appends to the workers' native queues under mutexes and, when an I/O
thread is idle, writes its eventfd — it never waits for the kernel. The native
I/O threads run without the GIL: it hashes write payloads before submitting them, reaps
completions, hashes read payloads, continues short transfers and queues the
results. ``wait_completions`` blocks up to ``timeout_s`` with the GIL released.
``close`` blocks until the ops in the ring finish.

With ``sealing`` (encryption at rest, ``engine/sealed.py``) the native I/O
threads also seal each written chunk before its SQE and open each read chunk
in place before its completion is published, through the store's key table
(``Sealing.native``, shared with the thread engine: random nonces, the
epoch's key); a write the table refuses (no epoch may seal) fails with
``-EAGAIN``, a read of an epoch not loaded yet with ``-ENOKEY``.

Importing this module raises ``ImportError`` when the extension was not built;
``nvmetier.engine.uring_status`` turns that into a reason string.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import nvmetier._uring as _uring

if TYPE_CHECKING:
    from nvmetier.engine.sealed import Sealing
from nvmetier.engine.base import Completion, IoEngine, Op
from nvmetier.errors import EngineClosedError

__all__ = ["DEFAULT_MAX_INFLIGHT_BYTES", "DEFAULT_QUEUE_DEPTH", "UringEngine", "probe"]

logger = logging.getLogger(__name__)

DEFAULT_QUEUE_DEPTH = 64
DEFAULT_MAX_INFLIGHT_BYTES = 64 << 20
# The kernel's limit on one registered buffer; larger buffers are split.
MAX_REGISTER_CHUNK_BYTES = 1 << 30

_IO_URING_DISABLED = "/proc/sys/kernel/io_uring_disabled"


def probe() -> tuple[bool, str]:
    """Whether io_uring can run in this process: a tiny ring and one NOP.

    Returns:
        ``(True, "io_uring works")``, or ``(False, reason)`` where the reason
        names the failed step, the error and its usual cause (a seccomp filter
        such as Docker's default, or ``kernel.io_uring_disabled``).
        Never raises.
    """
    try:
        err, stage = _uring.probe()
    except Exception as exc:  # never raise from a probe
        return False, f"io_uring probe failed: {exc!r}"
    if err == 0:
        return True, "io_uring works"
    reason = f"{stage} failed: {os.strerror(err)}"
    hint = _probe_hint(err)
    return False, f"{reason} ({hint})" if hint else reason


def _probe_hint(err: int) -> str:
    disabled = ""
    try:
        with open(_IO_URING_DISABLED, encoding="ascii") as f:
            disabled = f.read().strip()
    except OSError:
        pass
    if err in (errno.EPERM, errno.EACCES):
        if disabled == "2":
            return "kernel.io_uring_disabled=2 turns io_uring off for every process"
        if disabled == "1":
            return "kernel.io_uring_disabled=1 and this process is not in kernel.io_uring_group"
        return "blocked by seccomp or kernel.io_uring_disabled"
    if err == errno.ENOSYS:
        return "kernel without io_uring, or blocked by seccomp"
    if err == errno.ENOMEM:
        return "RLIMIT_MEMLOCK too small for the ring"
    return ""


class UringEngine(IoEngine):
    """An ``IoEngine`` on ``workers`` io_urings, each driven by a native thread.

    Per drive (file), up to ``queue_depth`` ops and ``max_inflight_bytes / n_files``
    bytes are in flight at once (a single larger op still runs, alone); the
    rest wait in FIFO order in a native queue per worker. With W workers and
    F files, file f is served by workers f, f+F, f+2F, ... (its ops alternate
    between them) when W >= F, else by worker f % W.

    With ``register_buffers`` the buffer is registered with the kernel (in
    pieces of at most 1 GiB) and ops use READ_FIXED/WRITE_FIXED: once, on a
    source ring that every worker clones (``IORING_REGISTER_CLONE_BUFFERS``,
    kernel 6.12+, nothing pinned twice), or per ring on older kernels. With
    ``fixed_files`` the fds are registered. When registration fails
    (RLIMIT_MEMLOCK, a file-backed buffer the kernel will not pin, ...) the
    engine logs one warning and uses plain READ/WRITE; ``describe()`` says
    which, per worker.

    A worker whose ring keeps failing (io_uring_enter refused ~100 times in a
    row) fails the ops routed to it with that error; ops of its files go to
    another worker of the same file where there is one. Other workers go on.

    A short transfer is continued with the remaining bytes; a continuation
    that moves nothing or fails ends the op with ``-EIO``.

    Args:
        buffer: writable, C-contiguous memory the ops address by byte offset.
            Held (its exports count) until ``close``.
        fds: open file descriptors the ops address by index; they must stay
            open until ``close`` returns.
        queue_depth: ops in the ring at once, 1..32767.
        max_inflight_bytes: bytes in the ring at once, >= 1.
        register_buffers: try registered (fixed) buffers; False forces the
            unregistered path.
        fixed_files: try registered files; False forces plain fds.
        register_chunk_bytes: bytes per registered buffer piece, a multiple of
            4096 up to 1 GiB (the kernel's limit). Ops crossing a piece
            boundary are split there. Smaller values exist for tests.
        workers: rings and I/O threads, 1..64.

    Raises:
        ValueError: an argument is out of range.
        BufferError, TypeError: ``buffer`` is not writable, contiguous memory.
        OSError: the ring cannot be created (see ``probe``).

    Not usable in a forked child: its I/O threads do not exist there. The
    child's copy closes its inherited rings at the fork (a ring holds the
    store's lock, which must go with the parent), refuses ops
    (``EngineClosedError``) and closes at once; create an engine in the
    process that uses it.
    """

    name = "uring"

    def __init__(
        self,
        buffer: memoryview,
        fds: Sequence[int],
        *,
        queue_depth: int = DEFAULT_QUEUE_DEPTH,
        max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
        register_buffers: bool = True,
        fixed_files: bool = True,
        register_chunk_bytes: int = MAX_REGISTER_CHUNK_BYTES,
        workers: int = 1,
        keepalive_fd: int = -1,
        staging_bytes: int = 0,
        sealing: Sealing | None = None,
    ) -> None:
        # keepalive_fd (the store's lock fd, -1: none) is registered in every
        # ring and never used for I/O: a ring holds its files until its queued
        # I/O is done, so if this process dies, its lock (which tells the other
        # sharers it is alive) outlives its in-flight writes, and no sharer
        # reclaims a slot such a write may still land on.
        self._native = _uring.Engine(
            buffer,
            list(fds),
            queue_depth=queue_depth,
            max_inflight_bytes=max_inflight_bytes,
            register_buffers=register_buffers,
            fixed_files=fixed_files,
            register_chunk_bytes=register_chunk_bytes,
            workers=workers,
            keepalive_fd=keepalive_fd,
            staging_bytes=staging_bytes,
            sealing=None if sealing is None else sealing.native_config(),
        )
        self._sealing = sealing
        info = self._native.info()
        self._lock_registered = bool(info.get("lock_registered", False))
        self._workers_info = [dict(w) for w in info["workers"]]
        self._registered_buffers = bool(info["registered_buffers"])
        self._fixed_files = bool(info["fixed_files"])
        self._queue_depth = int(info["queue_depth"])
        self._max_inflight_bytes = int(info["max_inflight_bytes"])
        failed = []
        if register_buffers and not self._registered_buffers and info["buffers_errno"]:
            failed.append(f"buffer registration: {os.strerror(info['buffers_errno'])}")
        if fixed_files and not self._fixed_files and info["files_errno"]:
            failed.append(f"file registration: {os.strerror(info['files_errno'])}")
        plain = sum(w["buffers"] == "plain" for w in self._workers_info)
        unstaged = [w["staging_errno"] for w in self._workers_info if w["staging_errno"]]
        if staging_bytes and unstaged:
            logger.warning(
                "io_uring: %d of %d worker(s) could not map their staging memory (%s); "
                "their ops move directly",
                len(unstaged),
                len(self._workers_info),
                os.strerror(unstaged[0]),
            )
        if failed:
            logger.warning(
                "io_uring %s; %d of %d worker ring(s) use unregistered I/O (more CPU per byte). "
                "Raise RLIMIT_MEMLOCK (ulimit -l) to register the buffer.",
                "; ".join(failed),
                plain,
                len(self._workers_info),
            )

    # ------------------------------------------------------------ sealing
    @property
    def auth_failures(self) -> int:
        """Sealed reads whose trailer or tag did not verify (``-EBADMSG``;
        not those under an epoch known destroyed, ``-EKEYREVOKED``)."""
        return int(self._native.auth_failures())

    def submit(self, ops: Sequence[Op]) -> None:
        """Queue ops; never blocks on I/O.

        Ops with a bad ``file_idx`` (``-EBADF``), a range outside the buffer
        (``-EFAULT``), a negative file offset or unknown kind (``-EINVAL``)
        complete at once without I/O.

        Raises:
            EngineClosedError: after ``close`` began; no op was queued.
        """
        if not self._native.submit(ops):
            raise EngineClosedError("the I/O engine is closed")

    @property
    def native_submit_raw(self) -> object:
        """``submit_raw`` without the Python frame (the store submits every
        job through it): returns False, queuing nothing, once ``close``
        began, which the table takes as the engine's refusal."""
        return self._native.submit_raw

    @property
    def native_wait_raw(self) -> object:
        """``wait_raw`` without the Python frame (the store polls at every engine step)."""
        return self._native.wait_raw

    @property
    def native_apply_hook(self) -> object:
        """The capsule through which the native slot table installs its
        completion hook (``Table.bind``): the I/O threads then publish each
        common completion with its slot already applied (a write's record and
        READY, a verified load's lease released), so the scheduler thread's
        poll only accounts for it. Raw ops only."""
        return self._native.apply_hook()

    def submit_raw(self, ops: bytes) -> None:
        """Queue packed ops (``OP_DTYPE``) as they are: no Python object per op.
        An engine carries either op objects or packed ops, never both.

        Raises:
            EngineClosedError: after ``close`` began; no op was queued.
        """
        if not self._native.submit_raw(ops):
            raise EngineClosedError("the I/O engine is closed")

    def wait_raw(self, timeout_s: float) -> bytes:
        """Completions of packed ops as packed ``COMPLETION_DTYPE`` records."""
        return self._native.wait_raw(timeout_s)  # type: ignore[no-any-return]

    def wait_completions(self, timeout_s: float) -> list[Completion]:
        """Return completed ops, waiting up to ``timeout_s`` for the first.

        The GIL is released while waiting; ``timeout_s <= 0`` only polls.
        Returns ``[]`` on timeout, and at once when the engine is closed and
        every completion was returned.
        """
        return list(map(Completion._make, self._native.wait(timeout_s)))

    def close(self) -> None:
        """Cancel queued ops, finish ops in the ring, stop the I/O thread.

        Ops not yet in the ring complete with ``-ECANCELED``; ops in the ring
        finish normally (a half-done transfer would corrupt data). The ring,
        its registrations and the buffer reference are released. Completions
        remain available from ``wait_completions``. Idempotent; blocks.
        """
        self._native.close()

    def worker_stats(self) -> list[dict[str, float]]:
        """Per worker: ``ops`` completed, ``bytes`` moved, ``hashed_bytes``,
        ``cpu_s`` of its thread and ``failed_errno`` (0 unless its ring
        failed). Read without locks: for rates, not accounting."""
        return self._native.worker_stats()  # type: ignore[no-any-return]

    def inject_ring_failure(self, worker: int, err: int = errno.EIO) -> None:
        """Test hook: fail worker ``worker``'s ring with ``err``, as the I/O
        thread does when its ring keeps refusing io_uring_enter.

        Raises:
            ValueError: no such worker, or ``err`` is not positive.
        """
        self._native.fail_worker(worker, err)

    def describe(self) -> dict[str, object]:
        return {
            "engine": self.name,
            "registered_buffers": self._registered_buffers,
            "fixed_files": self._fixed_files,
            "lock_registered": self._lock_registered,
            "queue_depth": self._queue_depth,
            "max_inflight_bytes": self._max_inflight_bytes,
            "workers": len(self._workers_info),
            "worker_buffers": [w["buffers"] for w in self._workers_info],
            "worker_queue_depth": [w["queue_depth"] for w in self._workers_info],
            "worker_max_inflight_bytes": [w["max_inflight_bytes"] for w in self._workers_info],
            "staging": any(w["staging_bytes"] for w in self._workers_info),
            "worker_staging_bytes": [w["staging_bytes"] for w in self._workers_info],
            "worker_staging": [
                (w["staging_addr"], w["staging_bytes"])
                for w in self._workers_info
                if w["staging_bytes"]
            ],
            "staged_bytes": sum(w.get("staged_bytes", 0) for w in self._native.worker_stats()),
            **(
                {}
                if self._sealing is None
                else {
                    "encryption": "aes-256-gcm",
                    "key_fingerprint": self._sealing.keys.fingerprint_hex,
                }
            ),
        }
