"""Thread-pool I/O engine: ``os.preadv``/``os.pwritev`` on worker threads.

Owns: ``n_threads`` daemon worker threads and one op queue. The files and
the buffer are borrowed (the store opens and closes them).

Threads: workers block in the syscalls with the GIL released; the checksum is
computed by python-xxhash on the worker. ``submit`` only enqueues. Completions
go to a ``queue.SimpleQueue`` that ``wait_completions`` drains.
"""

from __future__ import annotations

import errno
import os
import queue
import threading
from collections.abc import Sequence

import xxhash

from nvmetier.engine.base import OP_WRITE, Completion, IoEngine, Op
from nvmetier.errors import EngineClosedError

_STOP = None


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
        self._ops: queue.SimpleQueue[Op | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[Completion] = queue.SimpleQueue()
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
            if op is not None:
                self._done.put(Completion(op.op_id, -errno.ECANCELED, 0))
        self._buf.release()

    def describe(self) -> dict[str, object]:
        return {"engine": self.name, "threads": len(self._threads)}

    def _worker(self) -> None:
        while True:
            op = self._ops.get()
            if op is None:
                return
            self._done.put(self._run(op))

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
