"""Thread-pool I/O engine: ``os.preadv``/``os.pwritev`` on worker threads.

Owns: ``n_threads`` daemon worker threads and one op queue. The files and
the buffer are borrowed (the store opens and closes them).

Threads: workers block in the syscalls with the GIL released; the checksum is
computed on the worker by the native XXH3 (``nvmetier._table.xxh3``: the
widest vector build the CPU has, the GIL released). A worker survives any exception an op
raises: the op completes with an error (``-EBADF``/``-EFAULT``/``-EINVAL`` for
an op that fails the same checks as the io_uring engine's, ``-EIO`` for
anything unexpected, logged once per engine) and the worker takes the next op,
so no op, and no slot the table holds WRITING for it, is ever stranded.

With ``sealing`` (encryption at rest, ``engine/sealed.py``) every op moves
one chunk: a worker seals the row into its own page-aligned bounce slot and
writes that; a load reads the slot straight into the row plus the trailer
page into the worker's small buffer (one ``preadv``) and opens the row in
place (libcrypto, the GIL released). A tag that does not verify completes
with ``-EBADMSG``, an epoch known destroyed with ``-EKEYREVOKED``. With
``staging`` too, the slot image lives in the worker's huge-page arena
instead: sealed into it from the row, or read into it whole and opened from
it into the row.

``submit`` only enqueues. Completions go to a ``queue.SimpleQueue`` that
``wait_completions`` drains. Packed ops (``submit_raw``) are enqueued as one
item and unpacked by a worker, and their completions are packed by the
workers, so the caller's thread pays per job, not per op.

With ``staging`` each worker moves its ops through its own arena of
transparent huge pages (mapped on first use, grown to the largest op): a
read lands there and is copied into the buffer and hashed in one pass; a
write is copied there and hashed in one pass, and written from there (see
``nvmetier.memory`` for why). The copies run natively
(``nvmetier._table.xxh3_copy``), with the GIL released.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import queue
import struct
import threading
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from nvmetier._table import copy as _copy
from nvmetier._table import xxh3 as _xxh3
from nvmetier._table import xxh3_copy as _xxh3_copy
from nvmetier.crashsim import hook as _hook
from nvmetier.engine.base import (
    COMPLETION_DTYPE,
    OP_DTYPE,
    OP_READ,
    OP_WRITE,
    Completion,
    IoEngine,
    Op,
    dontdump,
    unpack_ops,
)
from nvmetier.errors import EngineClosedError

if TYPE_CHECKING:
    from nvmetier.engine.sealed import Sealing

logger = logging.getLogger(__name__)

_STOP = None
_PACKED = struct.Struct("<QqQ")  # a completion as COMPLETION_DTYPE lays it out
assert _PACKED.size == COMPLETION_DTYPE.itemsize
_HUGE = 2 << 20
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _op_error(
    kind: int, n_fds: int, buf_len: int, file_idx: int, file_off: int, buf_off: int, length: int
) -> int:
    """The io_uring engine's checks of an op, so both engines fail a bad op
    alike (a negative index would otherwise address another file or buffer
    byte): 0, or the negative errno the op completes with."""
    if kind != OP_WRITE and kind != OP_READ:
        return -errno.EINVAL
    if not 0 <= file_idx < n_fds:
        return -errno.EBADF
    if buf_off < 0 or length < 0 or buf_off + length > buf_len:
        return -errno.EFAULT
    if file_off < 0:
        return -errno.EINVAL
    return 0


# Test-only (issue 31): the planted bug the crash explorer must find.
_PUBLISH_EARLY = _hook.planted("publish-before-write")
# Whether any of it is on in this process (both are fixed at import).
_HOOKED = _PUBLISH_EARLY or _hook.recorder is not None


class _Stage:
    """One worker's staging arena: private memory advised for huge pages,
    2 MiB-aligned, at least as large as the largest op seen (worker-local)."""

    def __init__(self, sealed: bool = False) -> None:
        self.sealed = sealed
        self.map: mmap.mmap | None = None
        self.view: memoryview | None = None
        self.addr = 0
        self.size = 0

    def ensure(self, length: int) -> None:
        if length <= self.size:
            return
        self.close()
        size = (length + _HUGE - 1) // _HUGE * _HUGE
        m = mmap.mmap(-1, size + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if self.sealed:
            dontdump(m)  # a sealing worker's arena holds slot images
        base = ctypes.addressof(ctypes.c_char.from_buffer(m))
        skip = (-base) % _HUGE
        try:
            m.madvise(mmap.MADV_HUGEPAGE, skip, size)
        except (OSError, AttributeError):  # THP off: still works, in 4 KiB pages
            pass
        try:
            m.madvise(_MADV_POPULATE_WRITE, skip, size)
        except OSError:
            pass
        self.map = m
        self.view = memoryview(m)[skip : skip + size]
        self.addr = base + skip
        self.size = size

    def close(self) -> None:
        if self.view is not None:
            self.view.release()
            self.view = None
        if self.map is not None:
            self.map.close()
            self.map = None
        self.size = 0


class _RawOp(Op):
    """An op that came packed: its completion goes back packed."""


# Every ThreadEngine of this process, for the fork hook below.
_engines: weakref.WeakSet[ThreadEngine] = weakref.WeakSet()


def _close_engines_in_child() -> None:
    """``os.fork`` hook, in the child: an inherited engine has no workers
    and its fds are the parent's (the store closes them in the child, and
    their numbers may be reused): it is closed, with nothing to cancel."""
    for engine in list(_engines):
        engine._closed = True
        engine._fds = []
        engine._close_lock = threading.Lock()  # a copy may be held by a thread gone
        engine._threads = []
        engine._ops = queue.SimpleQueue()


os.register_at_fork(after_in_child=_close_engines_in_child)


class ThreadEngine(IoEngine):
    """An ``IoEngine`` backed by a pool of Python threads.

    Args:
        buffer: writable, C-contiguous memory the ops address by byte offset.
        fds: open file descriptors the ops address by index.
        n_threads: worker count (the number of ops in flight at the kernel).
        sealing: seal and open every chunk in the workers (None: plaintext).
        staging: move ops through each worker's huge-page arena (with
            ``sealing`` the arena holds the sealed slot image instead of the
            bounce slot: sealed into it, opened out of it into the row).
    """

    name = "threads"

    def __init__(
        self,
        buffer: memoryview,
        fds: Sequence[int],
        n_threads: int = 16,
        sealing: Sealing | None = None,
        *,
        staging: bool = False,
    ) -> None:
        if n_threads < 1:
            raise ValueError(f"n_threads must be >= 1, got {n_threads}")
        self._buf = memoryview(buffer).cast("B")
        self._buf_len = len(self._buf)
        self._staging = staging
        self._staged_bytes = 0  # racy sum over workers: a rate, not accounting
        self._fds = list(fds)
        self._ops: queue.SimpleQueue[Op | bytes | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[Completion] = queue.SimpleQueue()
        self._done_raw: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._closed = False
        self._logged_unexpected = False
        self._close_lock = threading.Lock()
        self._sealing = sealing
        # Each worker's bounce slot and trailer page (page-aligned: O_DIRECT).
        self._local = threading.local()
        _engines.add(self)
        self._threads = [
            threading.Thread(target=self._worker, name=f"nvmetier-io-{i}", daemon=True)
            for i in range(n_threads)
        ]
        for t in self._threads:
            t.start()

    def submit(self, ops: Sequence[Op]) -> None:
        if self._closed:
            raise EngineClosedError("the I/O engine is closed")
        for op in ops:
            self._ops.put(op)

    def submit_raw(self, ops: bytes) -> None:
        """Queue packed ops as one item; a worker unpacks them."""
        if self._closed:
            raise EngineClosedError("the I/O engine is closed")
        if len(ops) % OP_DTYPE.itemsize:
            raise ValueError(f"packed ops must be a multiple of {OP_DTYPE.itemsize} bytes")
        if ops:
            self._ops.put(bytes(ops))

    def wait_raw(self, timeout_s: float) -> bytes:
        """Packed completions of packed ops (workers pack them). A poll that
        finds nothing costs one C call (no queue.Empty raised and caught)."""
        done = self._done_raw
        if done.empty():
            if timeout_s <= 0:
                return b""
            try:
                first = done.get(timeout=timeout_s)
            except queue.Empty:
                return b""
            if done.empty():
                return first
            out = [first]
        else:
            out = []
        get = done.get_nowait
        # Only this thread takes from the queue: qsize() items are there.
        out.extend(get() for _ in range(done.qsize()))
        return b"".join(out)

    def wait_completions(self, timeout_s: float) -> list[Completion]:
        out: list[Completion] = []
        try:
            out.append(
                self._done.get(timeout=timeout_s) if timeout_s > 0 else self._done.get_nowait()
            )
        except queue.Empty:
            return out
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        for _ in self._threads:
            self._ops.put(_STOP)
        for t in self._threads:
            t.join()
        # Ops queued behind the stop markers never ran: report them cancelled.
        while True:
            try:
                op = self._ops.get_nowait()
            except queue.Empty:
                break
            if isinstance(op, bytes):
                for op_id in np.frombuffer(op, dtype=OP_DTYPE)["op_id"].tolist():
                    self._done_raw.put(_PACKED.pack(op_id, -errno.ECANCELED, 0))
            elif isinstance(op, _RawOp):
                self._done_raw.put(_PACKED.pack(op.op_id, -errno.ECANCELED, 0))
            elif op is not None:
                self._done.put(Completion(op.op_id, -errno.ECANCELED, 0))
        self._buf.release()

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {
            "engine": self.name,
            "threads": len(self._threads),
            "staging": self._staging,
            "staged_bytes": self._staged_bytes,
        }
        if self._sealing is not None:
            out["encryption"] = "aes-256-gcm"
            out["key_fingerprint"] = self._sealing.keys.fingerprint_hex
        return out

    def _worker(self) -> None:
        stage = _Stage(self._sealing is not None) if self._staging else None
        try:
            self._work(stage)
        finally:
            if stage is not None:
                stage.close()

    def _work(self, stage: _Stage | None) -> None:
        while True:
            op = self._ops.get()
            if op is None:
                return
            comp: Completion | None
            try:
                if isinstance(op, bytes):
                    # A packed batch: unpack here, off the caller's thread; run
                    # the first op and queue the rest for every worker.
                    batch = unpack_ops(op, _RawOp)
                    for rest in batch[1:]:
                        self._ops.put(rest)
                    op = batch[0]
                # Crash-state recording and planted bugs (tests only): off,
                # one module constant tested per op.
                if _HOOKED and op.kind == OP_WRITE:
                    got = self._run_hooked(op, stage)
                    if got is None:
                        continue
                    comp = got
                else:
                    comp = self._run(op, stage)
            except BaseException as exc:  # a dead worker would strand its op
                comp = self._unexpected(op, exc)
                if comp is None:
                    continue
            try:
                if isinstance(op, _RawOp):
                    self._done_raw.put(_PACKED.pack(comp.op_id, comp.result, comp.checksum))
                else:
                    self._done.put(comp)
            except BaseException as exc:  # e.g. an op_id that does not pack
                self._unexpected(op, exc)

    def _run_hooked(self, op: Op, stage: _Stage | None) -> Completion | None:
        """A write while recording (``hook.recorder``: what the files held
        before it, then after it) or with ``publish-before-write`` planted
        (None: its completion was posted already)."""
        if _PUBLISH_EARLY and self._sealing is None:
            self._publish_early(op, stage)
            return None
        rec = _hook.recorder
        if rec is not None:
            rec.checkpoint()
        comp = self._run(op, stage)
        if rec is not None:
            rec.checkpoint()
        return comp

    def _publish_early(self, op: Op, stage: _Stage | None) -> None:
        """The planted bug ``publish-before-write`` (tests only): report the
        write complete, with the checksum of the bytes it will write, then
        write them a moment later, so the table publishes the record first."""
        op_id, _kind, _file_idx, _file_off, buf_off, length, seed, want_sum = op
        view = self._buf[buf_off : buf_off + length]
        try:
            checksum = _xxh3(view, seed) if want_sum else 0
        finally:
            view.release()
        if isinstance(op, _RawOp):
            self._done_raw.put(_PACKED.pack(op_id, length, checksum))
        else:
            self._done.put(Completion(op_id, length, checksum))
        time.sleep(0.05)
        rec = _hook.recorder
        if rec is not None:
            rec.checkpoint()
        self._run(op, stage)
        if rec is not None:
            rec.checkpoint()

    def _unexpected(self, op: Op | bytes, exc: BaseException) -> Completion | None:
        """Log ``exc`` (once per engine) and return ``op``'s failed completion,
        or None when ``op`` was a packed batch that could not be unpacked (its
        ops are failed here, each by its op_id)."""
        if not self._logged_unexpected:
            self._logged_unexpected = True
            logger.error(
                "nvmetier: thread engine op failed with an unexpected %s; the op fails with "
                "EIO and the worker goes on (logged once)",
                type(exc).__name__,
                exc_info=exc,
            )
        if isinstance(op, bytes):
            try:
                ids = np.frombuffer(op[: len(op) - len(op) % OP_DTYPE.itemsize], dtype=OP_DTYPE)
                for op_id in ids["op_id"].tolist():
                    self._done_raw.put(_PACKED.pack(op_id, -errno.EIO, 0))
            except BaseException:  # nothing left to report them with
                pass
            return None
        try:
            return Completion(op.op_id, -errno.EIO, 0)
        except BaseException:
            return None

    def _run(self, op: Op, stage: _Stage | None = None) -> Completion:
        """Check ``op`` and run it: sealed, through ``stage`` (the worker's
        arena, when staging), or straight between the buffer and the file."""
        # One unpack instead of a property lookup per field use: this runs per
        # op on a Python thread that competes with vLLM's for the GIL.
        op_id, kind, file_idx, file_off, buf_off, length, seed, want_sum = op
        fds = self._fds
        bad = _op_error(kind, len(fds), self._buf_len, file_idx, file_off, buf_off, length)
        if bad:
            return Completion(op_id, bad, 0)
        end = buf_off + length
        if self._sealing is not None:
            return self._run_sealed(
                op_id, kind, fds[file_idx], file_off, buf_off, length, seed, stage, file_idx
            )
        if stage is not None and length:
            return self._run_staged(op, stage)
        view = self._buf[buf_off:end]
        try:
            checksum = 0
            if kind == OP_WRITE:
                if want_sum:
                    checksum = _xxh3(view, seed)
                n = os.pwritev(fds[file_idx], [view], file_off) if length else 0
            else:
                n = os.preadv(fds[file_idx], [view], file_off) if length else 0
                if want_sum and n == length:
                    checksum = _xxh3(view, seed)
            if n != length:
                return Completion(op_id, -errno.EIO, 0)
            return Completion(op_id, n, checksum)
        except OSError as exc:
            return Completion(op_id, -(exc.errno or errno.EIO), 0)
        finally:
            view.release()

    def _run_staged(self, op: Op, stage: _Stage) -> Completion:
        """A checked, plaintext op of some bytes through the worker's staging
        arena (``_run`` checked it; same results as the direct path)."""
        op_id, kind, file_idx, file_off, buf_off, length, seed, want_sum = op
        fds = self._fds
        end = buf_off + length
        stage.ensure(length)
        assert stage.view is not None
        tmp = stage.view[:length]
        view = self._buf[buf_off:end]
        try:
            checksum = 0
            if kind == OP_WRITE:
                # Copy and hash the copy in one pass (GIL released): the
                # bytes written are the bytes hashed.
                if want_sum:
                    checksum = _xxh3_copy(tmp, view, seed)
                else:
                    _copy(tmp, view)
                n = os.pwritev(fds[file_idx], [tmp], file_off)
            else:
                n = os.preadv(fds[file_idx], [tmp], file_off)
                if n == length:
                    # Copy out and hash the bytes the caller gets, one pass.
                    if want_sum:
                        checksum = _xxh3_copy(view, tmp, seed)
                    else:
                        _copy(view, tmp)
            if n != length:
                return Completion(op_id, -errno.EIO, 0)
            self._staged_bytes += length
            return Completion(op_id, n, checksum)
        except OSError as exc:
            return Completion(op_id, -(exc.errno or errno.EIO), 0)
        finally:
            view.release()
            tmp.release()

    def _worker_buffers(self, sealing: Sealing) -> tuple[memoryview, memoryview]:
        """This worker's bounce slot and trailer page (made at first use)."""
        local = self._local
        bufs: tuple[memoryview, memoryview] | None = getattr(local, "bufs", None)
        if bufs is None:
            trail = sealing.slot_bytes - sealing.row_bytes
            local.maps = (mmap.mmap(-1, sealing.slot_bytes), mmap.mmap(-1, trail))
            for m in local.maps:
                dontdump(m)
            bufs = (memoryview(local.maps[0]), memoryview(local.maps[1]))
            local.bufs = bufs
        return bufs

    def _run_sealed(
        self,
        op_id: int,
        kind: int,
        fd: int,
        file_off: int,
        buf_off: int,
        length: int,
        seed: int,
        stage: _Stage | None = None,
        file_idx: int = 0,
    ) -> Completion:
        sealing = self._sealing
        assert sealing is not None
        if length != sealing.row_bytes:
            return Completion(op_id, -errno.EFAULT, 0)  # a sealed slot holds one chunk
        if stage is not None:
            # The slot image lives in the worker's huge-page arena.
            stage.ensure(sealing.slot_bytes)
            assert stage.view is not None
            return self._run_sealed_in(
                op_id, kind, fd, file_off, buf_off, seed, stage.view, file_idx
            )
        bounce, trail = self._worker_buffers(sealing)
        row = self._buf[buf_off : buf_off + length]
        try:
            if kind == OP_WRITE:
                checksum = sealing.seal_into(row, seed, bounce, file_idx, file_off)
                n = os.pwritev(fd, [bounce], file_off)
                if n != sealing.slot_bytes:
                    return Completion(op_id, -errno.EIO, 0)
                return Completion(op_id, length, checksum)
            n = os.preadv(fd, [row, trail], file_off)
            if n != sealing.slot_bytes:
                return Completion(op_id, -errno.EIO, 0)
            got = sealing.open_in_place(row, trail, seed, file_idx, file_off)
            return Completion(op_id, length, got)
        except OSError as exc:
            return Completion(op_id, -(exc.errno or errno.EIO), 0)
        finally:
            row.release()

    def _run_sealed_in(
        self,
        op_id: int,
        kind: int,
        fd: int,
        file_off: int,
        buf_off: int,
        seed: int,
        arena: memoryview,
        file_idx: int = 0,
    ) -> Completion:
        """A sealed op through the arena: a write is sealed from the row into
        it and written from there; a read lands there and is opened from
        there into the row (no copy either way)."""
        sealing = self._sealing
        assert sealing is not None
        n_row, n_slot = sealing.row_bytes, sealing.slot_bytes
        image = arena[:n_slot]
        row = self._buf[buf_off : buf_off + n_row]
        try:
            if kind == OP_WRITE:
                checksum = sealing.seal_into(row, seed, image, file_idx, file_off)
                if os.pwritev(fd, [image], file_off) != n_slot:
                    return Completion(op_id, -errno.EIO, 0)
                self._staged_bytes += n_row
                return Completion(op_id, n_row, checksum)
            if os.preadv(fd, [image], file_off) != n_slot:
                return Completion(op_id, -errno.EIO, 0)
            got = sealing.open_into(image[:n_row], image[n_row:], seed, row, file_idx, file_off)
            self._staged_bytes += n_row
            return Completion(op_id, n_row, got)
        except OSError as exc:
            return Completion(op_id, -(exc.errno or errno.EIO), 0)
        finally:
            row.release()
            image.release()
