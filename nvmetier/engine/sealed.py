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
hop. ``Sealing`` owns the store's native key table (``nvmetier._crypto.Keys``:
the epochs' keys, the one nonce allocator, the trailer): the thread
engine's workers seal through it, the io_uring engine's borrow it.

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
as a checksum failure (a miss, the slot freed, ``auth_failures`` counted). A
chunk sealed under an epoch known destroyed (a purge, a retention, a full
``keys`` file: nvt_seal.h) completes with ``-EKEYREVOKED`` instead: a miss,
the slot freed too, counted in ``loads_key_destroyed``, not as corruption.

Nonces are 96 random bits per seal, under the sealing process's current
epoch key (``Sealing``). The authenticated data binds each chunk to its key
(the op's seed: XXH3-64 of the key's MAC, which only a holder of the key
file can compute), the store's layout digest, the store, the epoch and the
slot (data file and offset): native/nvt_seal.h.

Threads: ``submit``/``wait_completions`` as any engine (the scheduler
thread); ``n_threads`` workers seal, open and submit to the inner engine
(the GIL released in libcrypto); one pump thread moves the inner engine's
completions to the workers. Workers block on the bounce pool, never the
caller.
"""

from __future__ import annotations

import collections
import errno
import hmac
import logging
import mmap
import queue
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from nvmetier import crypto
from nvmetier.engine.base import OP_READ, OP_WRITE, Completion, IoEngine, Op, dontdump
from nvmetier.errors import EngineClosedError
from nvmetier.keyring import Epoch, Keyring

logger = logging.getLogger(__name__)

# The trailer after the sealed bytes of a slot is defined once, in
# native/nvt_seal.h (magic, version 2, nonce, tag, epoch, the epoch key's
# fingerprint, zero padded); sealing and opening go through that code from
# both engines. Changing it requires bumping FORMAT_VERSION.
TRAILER_BYTES = 64
TRAILER_MAGIC = b"NVTS"
TRAILER_VERSION = 2
NONCE_BLOCK = 1 << 20  # format 3's nonce reservation (kept for its importers)
_STOP = None
_TAG_HEAD = struct.Struct("<Q")


def _native() -> Any:
    return crypto._native()


def sealed_chunk_bytes(row_bytes: int) -> int:
    """Bytes a sealed chunk occupies in its slot (the chunk and its trailer)."""
    return row_bytes + TRAILER_BYTES


def checksum_of_tag(tag: bytes) -> int:
    """What the record's payload checksum holds for a sealed chunk."""
    return int(_TAG_HEAD.unpack_from(tag)[0])


def parse_trailer(data: bytes | memoryview) -> tuple[bytes, bytes, int, bytes] | None:
    """``(nonce, tag, epoch, epoch key fingerprint)`` of a trailer, or None
    if it is not one (nvt_seal.h's definition)."""
    return _native().parse_trailer(data)  # type: ignore[no-any-return]


def epoch_seconds(retention_s: float | None) -> float:
    """How long one epoch seals: an hour, or a quarter of the retention
    (at least ``EPOCH_MIN_S``), so expired chunks' keys go soon after them."""
    if not retention_s:
        return crypto.EPOCH_S
    return min(crypto.EPOCH_S, max(crypto.EPOCH_MIN_S, retention_s / 4))


class Sealing:
    """What an engine needs to seal chunks in its own threads: the store's
    key table (native, shared by both engines: ``nvmetier._crypto.Keys``),
    and the epochs behind it.

    Args:
        keys: the store's unwrapped secrets (``crypto.StoreKeys``).
        keyring: the store's ``keys`` file.
        layout_digest: the store's layout identity digest (bound into the tag).
        row_bytes: bytes of one chunk (every op's length).
        slot_bytes: bytes of one slot (the sealed chunk, its trailer, padding).
        retention_s: this process's retention (None: none): epochs whose
            sealing window ended longer ago are destroyed.
        keys_generation, bump_keys: the shared table's counter of keyring
            changes (None: a store no other process shares).
        keys_counter: ``(buffer, offset)`` of that counter (a u32 in the
            table's mapping) for the native table to watch: a trailer's
            epoch newer than the table, with no epoch announced since the
            table was read, never existed (a miss, counted) rather than one
            to reload for (None: only this process makes epochs).

    Epochs: ``start`` creates this process's first epoch (a fresh random
    key, durable before any seal); a housekeeping thread (``nvmetier-keys``)
    rotates to a new one before the window (``epoch_seconds``) or
    ``EPOCH_ROTATE_SEALS`` seals run out, destroys epochs past the
    retention, and reloads the table when another process changed the
    keyring (a purge that destroyed this process's epoch makes it rotate at
    once). ``close`` ends the epoch's window (destroys it if it sealed
    nothing).

    Threads: ``seal_into``/``open_into`` on engine threads (the GIL
    released in libcrypto); ``poke`` from the scheduler thread (never
    blocks); the rest where the store opens and closes.
    """

    def __init__(
        self,
        keys: crypto.StoreKeys,
        keyring: Keyring,
        layout_digest: int,
        *,
        row_bytes: int,
        slot_bytes: int,
        retention_s: float | None = None,
        keys_generation: Callable[[], int] | None = None,
        bump_keys: Callable[[], int] | None = None,
        keys_counter: tuple[Any, int] | None = None,
    ) -> None:
        if slot_bytes < sealed_chunk_bytes(row_bytes):
            raise ValueError("slot_bytes has no room for the sealed chunk's trailer")
        self.keys = keys
        self.keyring = keyring
        self.layout_digest = layout_digest
        self.row_bytes = row_bytes
        self.slot_bytes = slot_bytes
        self.retention_s = retention_s
        self.epoch_s = epoch_seconds(retention_s)
        self.nonces = crypto.NonceSource()
        self.native = _native().Keys(keyring.store_id, layout_digest)
        if keys_counter is not None:
            self.native.watch(*keys_counter)
        self._generation = keys_generation or (lambda: 0)
        self._bump = bump_keys or (lambda: 0)
        self._seen = -1
        self._lock = threading.Lock()  # epochs and reloads: one at a time
        self._current: Epoch | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._logged = False
        self.rotations = 0

    # ------------------------------------------------------------ epochs
    def start(self) -> None:
        """The first epoch and the key table, then the housekeeping thread.
        Blocks on the keyring's fsync."""
        with self._lock:
            self._sweep_locked()
            self._rotate_locked()
        self._thread = threading.Thread(target=self._loop, name="nvmetier-keys", daemon=True)
        self._thread.start()

    @property
    def epoch(self) -> int | None:
        """The epoch this process seals under (None: none yet)."""
        cur = self._current
        return None if cur is None else cur.epoch

    def _reload_locked(self) -> bool:
        """Load every live epoch into the native table. False when this
        process's own epoch is gone (destroyed by a purge): rotate."""
        self._seen = self._generation()
        live, top, destroyed = self.keyring.load_table(self.keys)
        cur = self._current
        # Its own epoch by number *and* key: a `keys` file put back from an
        # older copy may name this number with another opener's new key, and
        # sealing under it would put two processes on one key (each counting
        # only its own seals against the per-key bound): rotate instead.
        mine = cur is not None and any(
            e.epoch == cur.epoch
            and e.key is not None
            and hmac.compare_digest(crypto.epoch_fingerprint(e.key), cur.fingerprint)
            for e in live
        )
        self.native.set(
            [(e.epoch, e.key, e.fingerprint) for e in live],
            cur.epoch if (cur is not None and mine) else -1,
            cur.seal_until_ns if (cur is not None and mine) else 0,
            crypto.EPOCH_MAX_SEALS,
            top,
            self._seen & 0xFFFFFFFF,  # read before the keys file (nvt_seal.h: nvt_keys_open)
            # Known destroyed (with every epoch the table held and no longer
            # does): a chunk under one opens as EKEYREVOKED, a miss that is
            # not counted as an authentication failure.
            destroyed,
        )
        for e in live:
            if isinstance(e.key, bytearray):
                crypto._wipe(e.key)  # now only in the native table
            e.key = None
        return mine

    def _rotate_locked(self) -> None:
        self.native.hold(True)  # a seal that finds no epoch meanwhile waits for this one
        try:
            self._rotate_held_locked()
        finally:
            self.native.hold(False)

    def _rotate_held_locked(self) -> None:
        new, _room = self.keyring.new_epoch(self.keys, self.epoch_s)
        old = self._current
        self._current = new
        if isinstance(new.key, bytearray):
            crypto._wipe(new.key)  # the reload below loads it from its wrapping
        new.key = None
        self._bump()
        self._reload_locked()
        if old is not None:
            self.keyring.retire(old.epoch, destroy=False)
        self.rotations += 1

    def _sweep_locked(self) -> list[int]:
        """Destroy the epochs whose sealing window ended past the retention:
        every chunk sealed under them is older than it."""
        if not self.retention_s:
            return []
        cutoff = time.time_ns() - int(self.retention_s * 1e9)
        cur = self._current
        gone = self.keyring.destroy_where(
            lambda e: e.seal_until_ns < cutoff and (cur is None or e.epoch != cur.epoch)
        )
        if gone:
            self._bump()
        return gone

    def housekeep(self) -> None:
        """One round of the housekeeping thread (tests call it directly)."""
        with self._lock:
            changed = self._sweep_locked() or self._generation() != self._seen
            if changed:
                # A reload that finds this process's epoch destroyed (a purge)
                # leaves the table without a sealing epoch until the rotation:
                # seals meanwhile wait for it (nvt_keys_hold), never fail.
                self.native.hold(True)
                try:
                    if not self._reload_locked():
                        self._rotate_locked()
                        return
                finally:
                    self.native.hold(False)
            cur = self._current
            margin = min(60.0, self.epoch_s / 4)
            if (
                cur is None
                or time.time_ns() >= cur.seal_until_ns - int(margin * 1e9)
                or self.native.seals() >= crypto.EPOCH_ROTATE_SEALS
            ):
                self._rotate_locked()

    def _loop(self) -> None:
        tick = min(1.0, self.epoch_s / 4)
        while not self._stop.is_set():
            self._wake.wait(tick)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.housekeep()
            except Exception as exc:  # sealed writes fail (EAGAIN) until it works
                if not self._logged:
                    self._logged = True
                    logger.error(
                        "nvmetier: the sealed store's key housekeeping failed (%s); sealed "
                        "writes fail once the current epoch ends (logged once)",
                        exc,
                    )

    def poke(self) -> None:
        """Scheduler thread: if another process changed the keyring, have
        the housekeeping thread reload (never blocks)."""
        if self._generation() != self._seen:
            self._wake.set()

    def close(self) -> None:
        """Stop the thread; end this process's epoch (destroyed if it sealed
        nothing). Call after the engine closed."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            cur = self._current
            if cur is not None:
                try:
                    self.keyring.retire(cur.epoch, destroy=self.native.seals() == 0)
                    self._bump()
                except OSError as exc:
                    logger.warning("nvmetier: could not retire key epoch %d: %s", cur.epoch, exc)
            self._current = None
        self.native.watch(None)  # the table's mapping may go now (the engine is closed)

    # ------------------------------------------------------------- seals
    def native_config(self) -> tuple[object, int, int]:
        """The io_uring engine's ``sealing`` argument."""
        return (self.native.capsule(), self.row_bytes, self.slot_bytes)

    def seal_into(
        self, row: memoryview, seed: int, slot: memoryview, file_idx: int = 0, file_off: int = 0
    ) -> int:
        """Seal ``row`` (only read) into ``slot`` (``slot_bytes``): the sealed
        chunk, the trailer, zeros. Returns the completion's checksum (the
        tag's head). The GIL is released while the bytes are processed.

        Raises:
            OSError: EAGAIN when no epoch may seal (the rotation is late).
        """
        return self.native.seal(seed, file_idx, file_off, row, slot)  # type: ignore[no-any-return]

    def open_in_place(
        self,
        row: memoryview,
        trailer: memoryview | bytes,
        seed: int,
        file_idx: int = 0,
        file_off: int = 0,
    ) -> int:
        """Open the sealed ``row`` in place with its ``trailer``: the
        completion's checksum (the tag's head).

        Raises:
            OSError: EBADMSG (``row`` then holds no plaintext), EKEYREVOKED,
                ENOKEY (as ``open_into``).
        """
        return self.open_into(row, trailer, seed, None, file_idx, file_off)

    def open_into(
        self,
        sealed: memoryview,
        trailer: memoryview | bytes,
        seed: int,
        dst: memoryview | None,
        file_idx: int = 0,
        file_off: int = 0,
    ) -> int:
        """Open ``sealed`` (``row_bytes``) with its ``trailer`` into ``dst``
        (None: in place): the checksum.

        Raises:
            OSError: EBADMSG when the trailer or the tag does not verify or
                the epoch never existed (``dst`` then holds zeros where a
                decryption was tried, its earlier bytes otherwise: never an
                unauthenticated plaintext);
                EKEYREVOKED when the epoch is known destroyed (the keys file
                says so, or this table held it: ``dst`` untouched); ENOKEY
                for an epoch not loaded yet.
        """
        got = self.native.open(
            seed, file_idx, file_off, trailer, sealed, sealed if dst is None else dst
        )
        return int(got)


class SealingEngine(IoEngine):
    """An ``IoEngine`` that seals chunks on their way to disk and opens them
    on their way back.

    Args:
        primary: the primary region the table's ops address.
        row_bytes: bytes of one chunk (one primary row).
        slot_bytes: bytes of one slot (the sealed chunk and trailer, aligned).
        sealing: the store's key table and epochs (``Sealing``, started).
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
        sealing: Sealing,
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
        self._sealing = sealing
        self._bounce_map = mmap.mmap(-1, n_bounce * slot_bytes)
        dontdump(self._bounce_map)
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
            "key_fingerprint": self._sealing.keys.fingerprint_hex,
        }

    # -------------------------------------------------------------- workers
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
            row = self._primary[buf_off : buf_off + length]
            try:
                checksum = self._sealing.seal_into(
                    row, seed, self._bounce[at : at + self._slot], file_idx, file_off
                )
            finally:
                row.release()
            tag = checksum.to_bytes(8, "little")
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
            row = self._primary[op.buf_offset : op.buf_offset + self._row]
            try:
                got = self._sealing.open_into(
                    self._bounce[at : at + self._row],
                    self._bounce[at + self._row : at + self._slot],
                    op.seed,
                    row,
                    op.file_idx,
                    op.file_offset,
                )
            except OSError as exc:
                self._done.put(Completion(op.op_id, -(exc.errno or errno.EIO), 0))
            else:
                self._done.put(Completion(op.op_id, self._row, got))
            finally:
                row.release()
        finally:
            self._release_bounce(b, restart)

    def _pump_loop(self) -> None:
        while not self._pump_stop.is_set():
            for c in self.inner.wait_completions(0.05):
                self._work.put((1, c))
