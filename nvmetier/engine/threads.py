"""Thread-pool I/O engine: ``os.preadv``/``os.pwritev`` on worker threads.

Owns: ``n_threads`` daemon worker threads and one op queue. The files and
the buffer are borrowed (the store opens and closes them).

Threads: workers block in the syscalls with the GIL released; the checksum is
computed by python-xxhash on the worker. ``submit`` only enqueues. Completions
go to a ``queue.SimpleQueue`` that ``wait_completions`` drains. Packed ops
(``submit_raw``) are enqueued as one item and unpacked by a worker, and their
completions are packed by the workers, so the caller's thread pays per job,
not per op.
"""

from __future__ import annotations

import errno
import os
import queue
import struct
import threading
from collections.abc import Sequence

import numpy as np
import xxhash

from nvmetier.engine.base import (
    COMPLETION_DTYPE,
    OP_DTYPE,
    OP_WRITE,
    Completion,
    IoEngine,
    Op,
    unpack_ops,
)
from nvmetier.errors import EngineClosedError

_STOP = None
_PACKED = struct.Struct("<QqQ")  # a completion as COMPLETION_DTYPE lays it out
assert _PACKED.size == COMPLETION_DTYPE.itemsize


class _RawOp(Op):
    """An op that came packed: its completion goes back packed."""


class ThreadEngine(IoEngine):
    """An ``IoEngine`` backed by a pool of Python threads.

    Args:
        buffer: writable, C-contiguous memory the ops address by byte offset.
        fds: open file descriptors the ops address by index.
        n_threads: worker count (the number of ops in flight at the kernel).
    """

    name = "threads"

    def __init__(self, buffer: memoryview, fds: Sequence[int], n_threads: int = 16) -> None:
        if n_threads < 1:
            raise ValueError(f"n_threads must be >= 1, got {n_threads}")
        self._buf = memoryview(buffer).cast("B")
        self._fds = list(fds)
        self._ops: queue.SimpleQueue[Op | bytes | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[Completion] = queue.SimpleQueue()
        self._done_raw: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._closed = False
        self._close_lock = threading.Lock()
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
        return {"engine": self.name, "threads": len(self._threads)}

    def _worker(self) -> None:
        while True:
            op = self._ops.get()
            if op is None:
                return
            if isinstance(op, bytes):
                # A packed batch: unpack here, off the caller's thread; run the
                # first op and queue the rest for every worker.
                batch = unpack_ops(op, _RawOp)
                for rest in batch[1:]:
                    self._ops.put(rest)
                op = batch[0]
            comp = self._run(op)
            if isinstance(op, _RawOp):
                self._done_raw.put(_PACKED.pack(comp.op_id, comp.result, comp.checksum))
            else:
                self._done.put(comp)

    def _run(self, op: Op) -> Completion:
        view = self._buf[op.buf_offset : op.buf_offset + op.length]
        try:
            if len(view) != op.length:
                return Completion(op.op_id, -errno.EFAULT, 0)
            fd = self._fds[op.file_idx]
            checksum = 0
            if op.kind == OP_WRITE:
                if op.checksum:
                    checksum = xxhash.xxh3_64_intdigest(view, op.seed)
                n = os.pwritev(fd, [view], op.file_offset)
            else:
                n = os.preadv(fd, [view], op.file_offset)
                if op.checksum and n == op.length:
                    checksum = xxhash.xxh3_64_intdigest(view, op.seed)
            if n != op.length:
                return Completion(op.op_id, -errno.EIO, 0)
            return Completion(op.op_id, n, checksum)
        except OSError as exc:
            return Completion(op.op_id, -(exc.errno or errno.EIO), 0)
        finally:
            view.release()
