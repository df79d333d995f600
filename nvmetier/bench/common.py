"""Names and small helpers every benchmark level shares.

Owns: the unit and option constants (``GB``, ``PCTS``, ``LEVELS``,
``RW_MODES``), chunk-size formatting and parsing, the ``--rw`` phase plan,
file preallocation and offset patterns. No threads; ``_prealloc`` blocks on
``posix_fallocate``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import numpy as np

from nvmetier.bench.machine import drop_caches
from nvmetier.config import parse_size

LEVELS = ("engine", "tier", "vllm", "reopen", "trace")


RW_MODES = ("read", "write", "randread", "randwrite", "rw")


PCTS = (50.0, 90.0, 99.0, 99.9)


GB = 1e9


def _offsets(n: int, bs: int, rand: bool, seed: int) -> np.ndarray:
    idx = np.arange(n, dtype=np.int64)
    if rand:
        np.random.default_rng(seed).shuffle(idx)
    return idx * bs


def _prealloc(path: str, size: int) -> None:
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


def _phases(rw: str) -> list[tuple[str, bool]]:
    """``(phase, timed)`` in order for an ``--rw`` mode."""
    if rw in ("write", "randwrite"):
        return [("write", True)]
    if rw in ("read", "randread"):
        return [("write", False), ("read", True)]
    return [("write", True), ("read", True)]


def _note_drop(args: argparse.Namespace, log: Callable) -> None:
    if args.no_drop_caches:
        return
    ok, why = drop_caches()
    if not ok and why not in args._notes:
        args._notes.append(why)
        log("note: " + why)


def _bs(bs: int) -> str:
    if bs % (1 << 20) == 0:
        return f"{bs >> 20}MiB"
    return f"{bs >> 10}KiB" if bs % 1024 == 0 else f"{bs}B"


def _parse_bs_list(value: str) -> list[int]:
    return [parse_size(v.strip(), "--bs") for v in value.split(",") if v.strip()]
