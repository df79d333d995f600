"""Trace files of the ``trace`` level (the Mooncake format): reading one
(``read_trace``), routing its requests to replicas (``route``) and pacing
them (``due_offsets_s``, ``paced``).

The trace format is the one released with the Mooncake paper (FAST'25): one
JSON object per line with ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids``, the ids of prefix-chained blocks of
``--trace-block-tokens`` tokens (512 in the published traces). Equal ids mean
equal prefixes, so a block id is a vLLM chunk key.

Owns: no state. Pure functions but ``read_trace`` (which reads the file) and
``paced`` (which calls the caller's ``idle`` until each request is due); any
thread, blocking only there.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import itertools
import json
import lzma
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

import numpy as np

ROUTES = ("round-robin", "random", "affinity")


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the file and line."""


# ------------------------------------------------------------------ the trace
@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it arrives and which prefix blocks it has."""

    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self, block_tokens: int) -> list[int]:
        """Prompt tokens of each block: full blocks, then the remainder (the
        last block of a prompt is usually partial)."""
        n = self.input_length
        return [max(0, min(block_tokens, n - j * block_tokens)) for j in range(len(self.hash_ids))]


def _open_text(path: str) -> IO[str]:
    if path.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    if path.endswith(".xz"):
        return io.TextIOWrapper(lzma.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def _int_field(obj: dict[str, Any], name: str, where: str) -> int:
    v = obj.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TraceError(f"{where}: {name!r} must be an integer >= 0, not {v!r}")
    return v


def parse_line(text: str, where: str) -> TraceRequest | None:
    """One trace line -> a request; ``None`` for a blank line.

    Raises:
        TraceError: naming ``where`` (``path:line``) and what is wrong.
    """
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise TraceError(f"{where}: not a JSON object ({exc})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: not a JSON object but {type(obj).__name__}")
    ts = obj.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not ts >= 0:
        raise TraceError(f"{where}: 'timestamp' must be a number of ms >= 0, not {ts!r}")
    input_length = _int_field(obj, "input_length", where)
    output_length = _int_field(obj, "output_length", where) if "output_length" in obj else 0
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids
    ):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers >= 0")
    line = int(where.rsplit(":", 1)[1]) if ":" in where else 0
    return TraceRequest(line, float(ts), input_length, output_length, tuple(ids))


def read_trace(path: str, limit: int = 0) -> tuple[list[TraceRequest], list[str]]:
    """Read a Mooncake-format trace (``.gz``/``.xz`` are decompressed).

    Blank lines are skipped. Requests are returned in timestamp order (a stable
    sort: equal timestamps keep file order), with notes on what was done.

    Args:
        path: the JSONL file.
        limit: keep only the first ``limit`` requests of the file (0: all).

    Raises:
        TraceError: a bad line (with its number), or a trace without requests.
        OSError: the file cannot be read.
    """
    out: list[TraceRequest] = []
    with _open_text(path) as f:
        for lineno, text in enumerate(f, 1):
            req = parse_line(text, f"{path}:{lineno}")
            if req is None:
                continue
            out.append(req)
            if limit and len(out) >= limit:
                break
    if not out:
        raise TraceError(f"{path}: no requests (empty, or only blank lines)")
    notes = []
    unsorted = sum(b.timestamp_ms < a.timestamp_ms for a, b in itertools.pairwise(out))
    if unsorted:
        out.sort(key=lambda r: r.timestamp_ms)
        notes.append(f"{path}: {unsorted} requests were out of timestamp order; replayed sorted")
    return out, notes


# ------------------------------------------------------------------- routing
def _affinity_hash(ids: Sequence[int], n: int) -> int:
    import xxhash

    raw = b"".join(int(i).to_bytes(8, "little") for i in ids[:n])
    return int(xxhash.xxh3_64_intdigest(raw))


def route(
    requests: Sequence[TraceRequest],
    replicas: int,
    policy: str,
    *,
    seed: int = 0,
    affinity_blocks: int = 2,
) -> list[int]:
    """The replica of each request.

    ``round-robin``: in arrival order. ``random``: uniform, seeded.
    ``affinity``: a hash of the first ``affinity_blocks`` block ids, as a
    cache-aware router sends requests with one prefix to one replica (the
    published traces start nearly every request with the same system-prompt
    block, so one block would send everything to one replica).
    """
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    if policy == "round-robin":
        return [i % replicas for i in range(len(requests))]
    if policy == "random":
        rng = np.random.default_rng(seed)
        return [int(x) for x in rng.integers(0, replicas, size=len(requests))]
    if policy == "affinity":
        if affinity_blocks < 1:
            raise ValueError("affinity_blocks must be >= 1")
        return [_affinity_hash(r.hash_ids, affinity_blocks) % replicas for r in requests]
    raise ValueError(f"unknown route {policy!r}; use one of {', '.join(ROUTES)}")


# -------------------------------------------------------------------- pacing
def due_offsets_s(requests: Sequence[TraceRequest], speedup: float) -> list[float]:
    """Seconds after the replay's start at which each request is due: its
    timestamp relative to the first request's, divided by ``speedup``."""
    if not speedup > 0:
        raise ValueError("speedup must be > 0")
    if not requests:
        return []
    t0 = requests[0].timestamp_ms
    return [(r.timestamp_ms - t0) / 1000.0 / speedup for r in requests]


def paced(
    offsets_s: Sequence[float],
    start_s: float,
    clock: Callable[[], float],
    idle: Callable[[float], None],
) -> Iterator[tuple[int, float]]:
    """Yield ``(index, lag_s)`` for each offset once it is due.

    Before a request is due, ``idle(seconds_left)`` is called (the replica steps
    its engine and sleeps at most that long) until ``clock()`` reaches it. A
    request that is already late (the replica is busy) is yielded at once; its
    lag says by how much the replay fell behind the trace.
    """
    for i, off in enumerate(offsets_s):
        due = start_s + off
        now = clock()
        while now < due:
            idle(due - now)
            now = clock()
        yield i, now - due
