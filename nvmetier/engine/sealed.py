"""Encryption at rest (AES-256-GCM): ``Sealing``, what the I/O engines need
to seal and open chunks in their own threads, and ``SealingEngine``, the
same over any ``IoEngine`` that cannot.

The store gives a ``Sealing`` to the io_uring engine (nvt_engine_seal.c seals in
its worker threads before preparing the write and opens after the read,
before publishing the completion) or to the thread engine (the same in its
Python workers, libcrypto with the GIL released). With staging the slot
image is a span of the worker's huge-page arena: sealed into it from the
row, read into it whole and opened from it into the row; without, a write
goes through a bounce slot and a load reads the row plus the trailer page and
opens the row in place. No copy beyond the seal and the open, no thread
hop. ``Sealing`` owns the nonce reservations: the thread engine's workers
take nonces from it; for the io_uring engine a refill
thread (``nvmetier-nonce``) keeps a reserved range spare in the engine.

SealingEngine (below) remains for any other inner engine:

Owns: a bounce region (page-aligned, ``n_bounce`` slots), the crypto worker
threads (``nvmetier-seal-*``) and the inner engine, which moves bytes
between the bounce region and the data files (the io_uring engine or the
thread engine, built over the bounce region instead of the primary).

An op from the table addresses a primary row (``length`` = the chunk) and a
slot. A store seals the row into a bounce slot (the primary's bytes are only
read: vLLM keeps using them) followed by a trailer, and the inner engine
writes the whole sealed slot; a load has the inner engine read the sealed
slot into a bounce slot, then opens it into the primary row. The trailer
(``TRAILER_BYTES``, inside the slot) holds the nonce, the tag and the key
fingerprint. The completion's checksum is the tag's first 8 bytes: the table
writes it into the record at the store's commit and compares it at every
load, so a record only ever serves the sealing it was written for; a tag that
does not verify completes the load with ``-EBADMSG``, which the table treats
as a checksum failure (a miss, the slot freed, ``auth_failures`` counted).

Nonces come from the store's durable counter (``crypto.NonceSource``),
reserved in blocks of ``NONCE_BLOCK`` by the worker that runs out (an fsync
on an engine thread, never on vLLM's). The authenticated data binds each
chunk to its key (the op's seed: XXH3-64 of the key's MAC, which only a
holder of the key file can compute) and to the store's layout digest.

Threads: ``submit``/``wait_completions`` as any engine (the scheduler
thread); ``n_threads`` workers seal, open and submit to the inner engine
(the GIL released in libcrypto); one pump thread moves the inner engine's
completions to the workers. Workers block on the bounce pool and on nonce
reservations, never the caller.
"""

from __future__ import annotations

import collections
import errno
import logging
import mmap
import queue
import struct
import threading
from collections.abc import Callable, Sequence

from nvmetier import crypto
from nvmetier.engine.base import OP_READ, OP_WRITE, Completion, IoEngine, Op
from nvmetier.errors import EngineClosedError

logger = logging.getLogger(__name__)

# The trailer after the sealed bytes of a slot: magic, version, nonce, tag,
# key fingerprint, zero padded. Changing it requires bumping FORMAT_VERSION.
TRAILER_BYTES = 64
TRAILER_MAGIC = b"NVTS"
_TRAILER = struct.Struct("<4sI12s16s8s")
assert _TRAILER.size <= TRAILER_BYTES
NONCE_BLOCK = 1 << 20
_STOP = None
_TAG_HEAD = struct.Struct("<Q")


def sealed_chunk_bytes(row_bytes: int) -> int:
    """Bytes a sealed chunk occupies in its slot (the chunk and its trailer)."""
    return row_bytes + TRAILER_BYTES


def checksum_of_tag(tag: bytes) -> int:
    """What the record's payload checksum holds for a sealed chunk."""
    return int(_TAG_HEAD.unpack_from(tag)[0])


def parse_trailer(data: bytes | memoryview) -> tuple[bytes, bytes, bytes] | None:
    """``(nonce, tag, key fingerprint)`` of a trailer, or None if it is not one."""
    magic, version, nonce, tag, fingerprint = _TRAILER.unpack_from(data)
    if magic != TRAILER_MAGIC or version != 1:
        return None
    return nonce, tag, fingerprint


def chunk_aad(seed: int, layout_digest: int) -> bytes:
    """The authenticated data of a chunk: its key's fingerprint in the table
    (the op's seed, a hash of the key's MAC) and the layout digest."""
    return struct.pack("<QQ", seed, layout_digest)


class Sealing:
    """What an engine needs to seal chunks in its own threads.

    Args:
        keys: the operator key's subkeys.
        layout_digest: the store's layout identity digest (bound into the tag).
        nonces: the store's nonce counter (reserved ``nonce_block`` at a time).
        row_bytes: bytes of one chunk (every op's length).
        slot_bytes: bytes of one slot (the sealed chunk, its trailer, padding).
        nonce_block: counters reserved at a time (an fsync each).

    Threads: any; ``nonce`` takes a lock and, once per block, blocks in an
    fsync (an engine thread's, never vLLM's).
    """

    def __init__(
        self,
        keys: crypto.KeySet,
        layout_digest: int,
        nonces: crypto.NonceSource,
        *,
        row_bytes: int,
        slot_bytes: int,
        nonce_block: int = NONCE_BLOCK,
    ) -> None:
        if slot_bytes < sealed_chunk_bytes(row_bytes):
            raise ValueError("slot_bytes has no room for the sealed chunk's trailer")
        self.keys = keys
        self.layout_digest = layout_digest
        self.nonces = nonces
        self.row_bytes = row_bytes
        self.slot_bytes = slot_bytes
        self.nonce_block = nonce_block
        self._lock = threading.Lock()
        self._next = self._end = 0

    def native_config(self) -> tuple[bytes, bytes, int, int, int, int]:
        """The io_uring engine's ``sealing`` argument."""
        return (
            self.keys.seal_key,
            self.keys.fingerprint,
            self.nonces.prefix,
            self.layout_digest,
            self.row_bytes,
            self.slot_bytes,
        )

    def nonce(self) -> bytes:
        """A nonce never used before with this key (reserving a block, with
        its fsync, when this process's block is used up)."""
        with self._lock:
            if self._next == self._end:
                start = self.nonces.reserve(self.nonce_block)
                self._next, self._end = start, start + self.nonce_block
            n = self._next
            self._next += 1
        return self.nonces.nonce(n)

    def seal_into(self, row: memoryview, seed: int, slot: memoryview) -> int:
        """Seal ``row`` (only read) into ``slot`` (``slot_bytes``): the sealed
        chunk, the trailer, zeros. Returns the completion's checksum (the
        tag's head). The GIL is released while the bytes are processed."""
        nonce = self.nonce()
        n = self.row_bytes
        tag = crypto.seal(
            self.keys.seal_key, nonce, chunk_aad(seed, self.layout_digest), row, slot[:n]
        )
        trailer = _TRAILER.pack(TRAILER_MAGIC, 1, nonce, tag, self.keys.fingerprint)
        slot[n : n + len(trailer)] = trailer
        slot[n + len(trailer) :] = bytes(len(slot) - n - len(trailer))
        return checksum_of_tag(tag)

    def open_in_place(self, row: memoryview, trailer: memoryview | bytes, seed: int) -> int | None:
        """Open the sealed ``row`` in place with its ``trailer``: the
        completion's checksum (the tag's head), or None when the trailer or
        the tag does not verify (``row`` then holds garbage)."""
        return self.open_into(row, trailer, seed, None)

    def open_into(
        self,
        sealed: memoryview,
        trailer: memoryview | bytes,
        seed: int,
        dst: memoryview | None,
    ) -> int | None:
        """Open ``sealed`` (``row_bytes``) with its ``trailer`` into ``dst``
        (None: in place): the checksum, or None when the trailer or the tag
        does not verify (``dst`` then holds garbage, or is untouched when
        the trailer itself is bad)."""
        parsed = parse_trailer(trailer)
        if parsed is None:
            return None
        nonce, tag, _fingerprint = parsed
        ok = crypto.open_sealed(
            self.keys.seal_key, nonce, chunk_aad(seed, self.layout_digest), sealed, tag, dst
        )
        return checksum_of_tag(tag) if ok else None


class SealingEngine(IoEngine):
    """An ``IoEngine`` that seals chunks on their way to disk and opens them
    on their way back.

    Args:
        primary: the primary region the table's ops address.
        row_bytes: bytes of one chunk (one primary row).
        slot_bytes: bytes of one slot (the sealed chunk and trailer, aligned).
        keys: the operator key's subkeys.
        layout_digest: the store's layout identity digest (bound into the tag).
        nonces: the store's nonce counter.
        make_inner: builds the inner engine over the bounce region it is given.
        n_bounce: slots of bounce memory (the ops in flight at the drives).
        n_threads: crypto workers.
    """

    def __init__(
        self,
        primary: memoryview,
        *,
        row_bytes: int,
        slot_bytes: int,
        keys: crypto.KeySet,
        layout_digest: int,
        nonces: crypto.NonceSource,
        make_inner: Callable[[memoryview], IoEngine],
        n_bounce: int = 32,
        n_threads: int = 2,
    ) -> None:
        if slot_bytes < sealed_chunk_bytes(row_bytes):
            raise ValueError("slot_bytes has no room for the sealed chunk's trailer")
        self.name = "sealed"
        self._primary = memoryview(primary).cast("B")
        self._row = row_bytes
        self._slot = slot_bytes
        self._keys = keys
        self._digest = layout_digest
        self._nonces = nonces
        self._nonce_lock = threading.Lock()
        self._nonce_next = self._nonce_end = 0
        self._bounce_map = mmap.mmap(-1, n_bounce * slot_bytes)
        self._bounce = memoryview(self._bounce_map)
        # Free bounce slots, and ops waiting for one (never a blocked worker:
        # the workers also finish the ops that free the slots).
        self._free = list(range(n_bounce))
        self._waiting: collections.deque[Op] = collections.deque()
        self._free_lock = threading.Lock()
        self.inner = make_inner(self._bounce)
        self.name = f"sealed-{self.inner.name}"
        self._work: queue.SimpleQueue[tuple[int, object] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[Completion] = queue.SimpleQueue()
        # inner op id -> (the table's op, bounce slot, write tag)
        self._inflight: dict[int, tuple[Op, int, bytes]] = {}
        self._inflight_lock = threading.Lock()
        self._next_id = 0
        self._closed = False
        self._pump_stop = threading.Event()
        self._logged_error = False
        self._workers = [
            threading.Thread(target=self._worker, name=f"nvmetier-seal-{i}", daemon=True)
            for i in range(n_threads)
        ]
        self._pump = threading.Thread(
            target=self._pump_loop, name="nvmetier-seal-pump", daemon=True
        )
        for t in self._workers:
            t.start()
        self._pump.start()

    # ------------------------------------------------------------- interface
    def submit(self, ops: Sequence[Op]) -> None:
        if self._closed:
            raise EngineClosedError("the I/O engine is closed")
        for op in ops:
            self._work.put((0, op))

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
        if self._closed:
            return
        self._closed = True
        for _ in self._workers:
            self._work.put(_STOP)
        for t in self._workers:
            t.join()
        # The inner engine cancels what it has queued and finishes what is
        # running (a half-done write leaves a slot no tag opens, never wrong
        # bytes); everything left is then finished here, on this thread.
        self.inner.close()
        self._pump_stop.set()
        self._pump.join()
        left: list[tuple[int, object] | None] = []
        while True:
            try:
                left.append(self._work.get_nowait())
            except queue.Empty:
                break
        for item in left:
            if item is not None and item[0] == 1:
                assert isinstance(item[1], Completion)
                self._finish(item[1], restart=False)
        for c in self.inner.wait_completions(0):
            self._finish(c, restart=False)
        cancelled = [item[1] for item in left if item is not None and item[0] == 0]
        cancelled += list(self._waiting)
        with self._inflight_lock:
            cancelled += [op for op, _b, _tag in self._inflight.values()]
            self._inflight.clear()
        for op in cancelled:
            assert isinstance(op, Op)
            self._done.put(Completion(op.op_id, -errno.ECANCELED, 0))
        self._primary.release()
        self._bounce.release()
        self._bounce_map.close()

    def describe(self) -> dict[str, object]:
        return {
            **self.inner.describe(),
            "engine": self.name,
            "encryption": "aes-256-gcm",
            "key_fingerprint": self._keys.fingerprint_hex,
        }

    # -------------------------------------------------------------- workers
    def _nonce(self) -> bytes:
        with self._nonce_lock:
            if self._nonce_next == self._nonce_end:
                start = self._nonces.reserve(NONCE_BLOCK)  # fsync: an engine thread may block
                self._nonce_next, self._nonce_end = start, start + NONCE_BLOCK
            n = self._nonce_next
            self._nonce_next += 1
        return self._nonces.nonce(n)

    def _worker(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            kind, payload = item
            try:
                if kind == 0:
                    assert isinstance(payload, Op)
                    self._start(payload)
                else:
                    assert isinstance(payload, Completion)
                    self._finish(payload)
            except BaseException as exc:  # a dead worker would strand its op
                self._fail(payload, exc)

    def _fail(self, payload: object, exc: BaseException) -> None:
        if not self._logged_error:
            self._logged_error = True
            logger.error(
                "nvmetier: sealing engine op failed with an unexpected %s; the op fails "
                "with EIO (logged once)",
                type(exc).__name__,
                exc_info=exc,
            )
        if isinstance(payload, Op):
            self._done.put(Completion(payload.op_id, -errno.EIO, 0))
        elif isinstance(payload, Completion):
            with self._inflight_lock:
                entry = self._inflight.pop(payload.op_id, None)
            if entry is not None:
                self._release_bounce(entry[1])
                self._done.put(Completion(entry[0].op_id, -errno.EIO, 0))

    def _start(self, op: Op) -> None:
        op_id, kind, _fi, _fo, buf_off, length, _seed, _want_sum = op
        if kind not in (OP_READ, OP_WRITE):
            self._done.put(Completion(op_id, -errno.EINVAL, 0))
            return
        if length != self._row or buf_off < 0 or buf_off + length > len(self._primary):
            self._done.put(Completion(op_id, -errno.EFAULT, 0))
            return
        with self._free_lock:
            if not self._free:  # every bounce slot in flight: started when one frees
                self._waiting.append(op)
                return
            b = self._free.pop()
        try:
            self._start_in(op, b)
        except BaseException:
            # The op fails (EIO, in _fail); its bounce slot must not leak.
            self._release_bounce(b)
            raise

    def _start_in(self, op: Op, b: int) -> None:
        op_id, kind, file_idx, file_off, buf_off, length, seed, _want_sum = op
        at = b * self._slot
        tag = b""
        if kind == OP_WRITE:
            nonce = self._nonce()
            row = self._primary[buf_off : buf_off + length]
            try:
                tag = crypto.seal(
                    self._keys.seal_key,
                    nonce,
                    chunk_aad(seed, self._digest),
                    row,
                    self._bounce[at : at + length],
                )
            finally:
                row.release()
            trailer = _TRAILER.pack(TRAILER_MAGIC, 1, nonce, tag, self._keys.fingerprint)
            end = at + self._slot
            self._bounce[at + length : at + length + len(trailer)] = trailer
            self._bounce[at + length + len(trailer) : end] = bytes(end - at - length - len(trailer))
        with self._inflight_lock:
            inner_id = self._next_id
            self._next_id += 1
            self._inflight[inner_id] = (op, b, tag)
        try:
            self.inner.submit([Op(inner_id, kind, file_idx, file_off, at, self._slot, 0, False)])
        except BaseException as exc:
            with self._inflight_lock:
                self._inflight.pop(inner_id, None)
            if not isinstance(exc, EngineClosedError):
                raise  # _start frees the bounce slot, _fail fails the op
            self._release_bounce(b)
            self._done.put(Completion(op_id, -errno.ECANCELED, 0))

    def _release_bounce(self, b: int, restart: bool = True) -> None:
        with self._free_lock:
            self._free.append(b)
            waiting = self._waiting.popleft() if restart and self._waiting else None
        if waiting is not None:
            self._work.put((0, waiting))

    def _finish(self, c: Completion, restart: bool = True) -> None:
        with self._inflight_lock:
            entry = self._inflight.pop(c.op_id, None)
        if entry is None:
            return
        op, b, tag = entry
        try:
            if c.result != self._slot:
                result = c.result if c.result < 0 else -errno.EIO
                self._done.put(Completion(op.op_id, result, 0))
                return
            if op.kind == OP_WRITE:
                self._done.put(Completion(op.op_id, self._row, checksum_of_tag(tag)))
                return
            at = b * self._slot
            parsed = parse_trailer(self._bounce[at + self._row : at + self._slot])
            ok = False
            if parsed is not None:
                nonce, read_tag, _fingerprint = parsed
                row = self._primary[op.buf_offset : op.buf_offset + self._row]
                try:
                    ok = crypto.open_sealed(
                        self._keys.seal_key,
                        nonce,
                        chunk_aad(op.seed, self._digest),
                        self._bounce[at : at + self._row],
                        read_tag,
                        dst=row,
                    )
                finally:
                    row.release()
            if ok:
                assert parsed is not None
                self._done.put(Completion(op.op_id, self._row, checksum_of_tag(parsed[1])))
            else:
                self._done.put(Completion(op.op_id, -errno.EBADMSG, 0))
        finally:
            self._release_bounce(b, restart)

    def _pump_loop(self) -> None:
        while not self._pump_stop.is_set():
            for c in self.inner.wait_completions(0.05):
                self._work.put((1, c))
