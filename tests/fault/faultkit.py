"""Helpers of the fault suite: deterministic keys and payloads, a store
factory, an I/O engine that fails chosen ops, bit flips and directory
snapshots. No vLLM.

Also imported as a top-level module by ``kill_writer.py`` (run as a script),
so it must not use relative imports.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import mmap
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from nvmetier import format as fmt
from nvmetier.config import TierConfig
from nvmetier.engine import Completion, IoEngine, Op
from nvmetier.files import INDEX_NAME, SUPERBLOCK_NAME
from nvmetier.store import BlockStore, JobOutcome

ROW = 64 << 10
ROWS = 64
STORE_NAME = "fault-store"
IDENTITY: dict[str, Any] = {"model_name": "fault/test", "chunk_bytes": ROW, "dtype": "fp16"}


def key(i: int, trial: int = 0) -> bytes:
    """A deterministic 36-byte key (``trial`` separates independent runs)."""
    return hashlib.blake2b(f"{trial}:{i}".encode(), digest_size=32).digest() + b"\0\0\0\0"


def payload(k: bytes, n: int = ROW) -> bytes:
    """Deterministic chunk bytes of key ``k`` (SHAKE-128 stream of the key)."""
    return hashlib.shake_128(k).digest(n)


def config(root: str | Sequence[str], **overrides: Any) -> TierConfig:
    raw: dict[str, Any] = {"root_dir": root, "capacity_bytes": "16MiB", "ways": 16}
    raw.update(overrides)
    return TierConfig.from_dict(raw)


def new_buffer(rows: int = ROWS) -> memoryview:
    """A page-aligned primary region of ``rows`` rows."""
    return memoryview(mmap.mmap(-1, rows * ROW))


def open_store(
    root: str | Sequence[str],
    buffer: memoryview,
    *,
    identity: dict[str, Any] | None = None,
    engine_wrapper: Any = None,
    **overrides: Any,
) -> BlockStore:
    return BlockStore(
        config(root, **overrides),
        store_name=STORE_NAME,
        identity=IDENTITY if identity is None else identity,
        buffer=buffer,
        row_bytes=ROW,
        engine_wrapper=engine_wrapper,
    )


def wait_jobs(store: BlockStore, n: int = 1, timeout_s: float = 30.0) -> list[JobOutcome]:
    """Poll until ``n`` jobs finished (blocking; tests only)."""
    out: list[JobOutcome] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n:
        out.extend(store.poll())
        if len(out) >= n:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{n - len(out)} job(s) still running after {timeout_s}s")
        time.sleep(0.0005)
    return out


def store_keys(
    store: BlockStore, buffer: memoryview, keys: Sequence[bytes], job_id: int = 1
) -> JobOutcome:
    """Write ``keys`` (rows 0..n-1) and wait for the job."""
    rows = list(range(len(keys)))
    for k, r in zip(keys, rows, strict=True):
        buffer[r * ROW : (r + 1) * ROW] = payload(k)
    store.submit_store(job_id, keys, rows)
    (outcome,) = wait_jobs(store)
    return outcome


def load_keys(
    store: BlockStore, buffer: memoryview, keys: Sequence[bytes], job_id: int = 2
) -> tuple[JobOutcome, list[bytes], list[bytes]]:
    """Load ``keys`` into rows 0..n-1 (after zeroing them).

    Returns:
        (outcome, keys reported successful, keys reported successful whose
        bytes are NOT their payload — must always be empty).
    """
    rows = list(range(len(keys)))
    for r in rows:
        buffer[r * ROW : (r + 1) * ROW] = bytes(ROW)
    store.submit_load(job_id, keys, rows)
    (outcome,) = wait_jobs(store)
    ok = list(keys) if outcome.success else list(outcome.successful_keys or [])
    wrong = [
        k
        for k in ok
        if bytes(buffer[keys.index(k) * ROW : (keys.index(k) + 1) * ROW]) != payload(k)
    ]
    return outcome, ok, wrong


# ------------------------------------------------------------------ faults
class FaultyEngine(IoEngine):
    """Wraps an engine; fails the ops of chosen keys and kinds with
    ``-errno`` instead of running them.

    Ops are matched by their checksum seed, which the store derives from the
    key (``format.key_seed``), so a test names keys, not slots or rows.
    Thread-safe: ``submit`` runs on the scheduler and completion threads.
    """

    def __init__(self, inner: IoEngine) -> None:
        self.inner = inner
        self.name = f"faulty-{inner.name}"
        self._rules: dict[tuple[int, int | None], int] = {}
        self._failed: collections.deque[Completion] = collections.deque()
        self._lock = threading.Lock()
        self.injected = 0

    def fail(self, kind: int, err: int, keys: Iterable[bytes] | None = None) -> None:
        """Fail ops of ``kind`` for ``keys`` (every key when None) with ``-err``."""
        with self._lock:
            if keys is None:
                self._rules[(kind, None)] = err
            for k in keys or ():
                self._rules[(kind, fmt.key_seed(k))] = err

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def submit(self, ops: Sequence[Op]) -> None:
        run: list[Op] = []
        with self._lock:
            for op in ops:
                err = self._rules.get((op.kind, op.seed)) or self._rules.get((op.kind, None))
                if err:
                    self._failed.append(Completion(op.op_id, -err, 0))
                    self.injected += 1
                else:
                    run.append(op)
        if run:
            self.inner.submit(run)

    def _take_failed(self) -> list[Completion]:
        with self._lock:
            out = list(self._failed)
            self._failed.clear()
        return out

    def wait_completions(self, timeout_s: float) -> list[Completion]:
        deadline = time.monotonic() + timeout_s
        while True:
            failed = self._take_failed()
            if failed:
                return failed + self.inner.wait_completions(0)
            left = deadline - time.monotonic()
            got = self.inner.wait_completions(max(0.0, min(left, 0.005)))
            if got or left <= 0:
                return got + self._take_failed()

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> dict[str, object]:
        return {**self.inner.describe(), "engine": self.name}


# ------------------------------------------------------------- disk helpers
def store_dir(root: str) -> str:
    return os.path.join(root, STORE_NAME)


def read_superblock(sdir: str) -> fmt.Superblock:
    with open(os.path.join(sdir, SUPERBLOCK_NAME), "rb") as f:
        return fmt.unpack_superblock(f.read())


def live_records(sdir: str) -> list[fmt.Record]:
    """The verifying records of a closed store, parsed with the format module."""
    sb = read_superblock(sdir)
    with open(os.path.join(sdir, INDEX_NAME), "rb") as f:
        raw = f.read(sb.index_bytes)
    out = []
    for slot in range(sb.n_slots):
        try:
            rec = fmt.unpack_record(
                raw[slot * fmt.RECORD_BYTES : (slot + 1) * fmt.RECORD_BYTES], slot
            )
        except fmt.RecordError:
            continue
        if rec is not None:
            out.append(rec)
    return out


def flip_bit(path: str, offset: int, bit: int) -> None:
    """Invert bit ``bit`` of the byte at ``offset`` of ``path`` (in place)."""
    fd = os.open(path, os.O_RDWR)
    try:
        (byte,) = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte ^ (1 << bit)]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclasses.dataclass(frozen=True)
class Entry:
    kind: str  # "dir" or "file"
    mode: int
    size: int
    sha256: str


def snapshot(root: str) -> dict[str, Entry]:
    """Every path under ``root`` with its type, mode, size and content hash."""
    out: dict[str, Entry] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            p = os.path.join(dirpath, d)
            st = os.stat(p)
            out[os.path.relpath(p, root)] = Entry("dir", st.st_mode, 0, "")
        for name in filenames:
            p = os.path.join(dirpath, name)
            st = os.stat(p)
            out[os.path.relpath(p, root)] = Entry("file", st.st_mode, st.st_size, _sha256(p))
    return out


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def chunks(seq: Sequence[bytes], n: int) -> Iterator[list[bytes]]:
    for i in range(0, len(seq), n):
        yield list(seq[i : i + n])
