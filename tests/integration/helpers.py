"""Helpers shared by the integration tests (no vLLM)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from nvmetier.config import TierConfig
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


def store_keys(store: BlockStore, buffer: memoryview, keys: Sequence[bytes], job_id: int = 1):
    rows = list(range(len(keys)))
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
