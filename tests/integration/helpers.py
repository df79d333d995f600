"""Helpers shared by the integration tests (no vLLM)."""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from nvmetier.config import TierConfig
from nvmetier.engine.base import Completion, IoEngine, Op
from nvmetier.store import BlockStore, JobOutcome

ROW = 65536
IDENTITY = {"model_name": "itest", "chunk_bytes": ROW}


def make_store(
    root: str | Sequence[str],
    buffer: memoryview,
    *,
    engine: str | None = None,
    engine_wrapper: Any = None,
    **overrides: Any,
) -> BlockStore:
    """A store of 64 KiB rows; ``overrides`` are config keys."""
    identity = overrides.pop("identity", IDENTITY)
    raw: dict[str, Any] = {"root_dir": root, "capacity_bytes": "16MiB", "ways": 8}
    raw.update(overrides)
    return BlockStore(
        TierConfig.from_dict(raw),
        store_name="store",
        identity=identity,
        buffer=buffer,
        row_bytes=ROW,
        engine=engine,
        engine_wrapper=engine_wrapper,
    )


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") * 4 + b"\0\0\0\0"


def payload(k: bytes, n: int = ROW) -> bytes:
    rng = np.random.default_rng(int.from_bytes(k[:8], "little"))
    return rng.integers(0, 1 << 63, size=n // 8, dtype=np.uint64).tobytes()


def fill_rows(buffer: memoryview, keys: Sequence[bytes], rows: Sequence[int]) -> None:
    for k, r in zip(keys, rows, strict=True):
        buffer[r * ROW : (r + 1) * ROW] = payload(k)


def run(store: BlockStore, timeout_s: float = 30.0) -> list[JobOutcome]:
    assert store.wait_idle(timeout_s)
    return store.poll()


def store_keys(
    store: BlockStore,
    buffer: memoryview,
    keys: Sequence[bytes],
    job_id: int = 1,
    first_row: int = 0,
):
    rows = list(range(first_row, first_row + len(keys)))
    fill_rows(buffer, keys, rows)
    store.submit_store(job_id, keys, rows)
    return run(store)


def load_keys(store: BlockStore, buffer: memoryview, keys: Sequence[bytes], job_id: int = 2):
    rows = list(range(len(keys)))
    buffer[: len(keys) * ROW] = bytes(len(keys) * ROW)
    store.submit_load(job_id, keys, rows)
    (outcome,) = run(store)
    good = [
        k for k, r in zip(keys, rows, strict=True) if buffer[r * ROW : (r + 1) * ROW] == payload(k)
    ]
    return outcome, good


def disk_usage_bytes(root: str) -> int:
    """Allocated bytes of every file and directory below ``root`` (what ``du``
    counts for the store; ``root`` itself is the user's directory)."""
    total = 0
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            total += os.stat(os.path.join(d, name)).st_blocks * 512
    return total


def make_sealing(
    store_dir,
    row_bytes: int,
    slot_bytes: int,
    *,
    key: bytes | None = None,
    digest: int = 42,
    retention_s: float | None = None,
):
    """A started ``Sealing`` over a keyring in ``store_dir`` (created with
    ``key``, default a fixed one), as a store builds it."""
    from nvmetier import crypto
    from nvmetier.engine.sealed import Sealing

    operator = crypto.KeySet(key or bytes(range(32)))
    ring = crypto.Keyring.open(str(store_dir), create=True, operator=operator)
    sealing = Sealing(
        ring.store_keys(operator),
        ring,
        digest,
        row_bytes=row_bytes,
        slot_bytes=slot_bytes,
        retention_s=retention_s,
    )
    sealing.start()
    return sealing


class HeldOps(IoEngine):
    """Wraps an engine; while ``hold`` is set, keeps the ops of one ``kind``
    (``OP_WRITE``: a store's write in flight; ``OP_READ``: a load in flight,
    not yet read nor opened) until ``release()``, for as long as the test
    wants. Other ops run at once."""

    def __init__(self, inner: IoEngine, kind: int) -> None:
        self.inner = inner
        self.kind = kind
        self.name = f"held-{inner.name}"
        self.hold = False
        self._held: collections.deque[Op] = collections.deque()
        self._lock = threading.Lock()

    def submit(self, ops: Sequence[Op]) -> None:
        run_now = []
        with self._lock:
            for op in ops:
                (self._held if self.hold and op.kind == self.kind else run_now).append(op)
        if run_now:
            self.inner.submit(run_now)

    def release(self) -> None:
        with self._lock:
            ops, self.hold = list(self._held), False
            self._held.clear()
        if ops:
            self.inner.submit(ops)

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def wait_completions(self, timeout_s: float) -> list[Completion]:
        return self.inner.wait_completions(timeout_s)

    def close(self) -> None:
        self.release()
        self.inner.close()

    def describe(self) -> dict[str, object]:
        return {**self.inner.describe(), "engine": self.name}
