"""Names and small helpers every benchmark level shares.

Owns: the unit and option constants (``GB``, ``PCTS``, ``LEVELS``,
``RW_MODES``), chunk-size formatting and parsing, the ``--rw`` phase plan,
file preallocation and offset patterns, ``--tier-option`` parsing (the
``vllm`` and ``trace`` levels), and the ``forkserver`` that replica
processes come from. No threads; ``_prealloc`` blocks on ``posix_fallocate``.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from nvmetier.bench.machine import drop_caches
from nvmetier.config import parse_size

LEVELS = ("engine", "tier", "vllm", "reopen", "trace", "serve")


RW_MODES = ("read", "write", "randread", "randwrite", "rw")


PCTS = (50.0, 90.0, 99.0, 99.9)


GB = 1e9


def forkserver_context(preload: Sequence[str]) -> Any:
    """A ``forkserver`` multiprocessing context, its server started now with
    ``preload`` imported, and without the current directory on its path.

    Python 3.11 starts the server with ``python -c``, which puts the current
    directory first on ``sys.path`` (the parent's path is passed but not
    applied): run from a directory holding nvmetier's source tree, the
    server and every process it forks would import that tree, which has no
    compiled extensions, instead of the installed package. The server is
    started with ``PYTHONSAFEPATH=1`` (``-P``) so it imports what the parent
    imports. (A server already running is kept as it is.)
    """
    import multiprocessing
    from multiprocessing import forkserver

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    old = os.environ.get("PYTHONSAFEPATH")
    os.environ["PYTHONSAFEPATH"] = "1"
    try:
        forkserver.ensure_running()
    finally:
        if old is None:
            del os.environ["PYTHONSAFEPATH"]
        else:
            os.environ["PYTHONSAFEPATH"] = old
    return ctx


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


def parse_tier_options(items: Sequence[str]) -> dict[str, Any]:
    """``["ways=8", "sharing=process"]`` -> tier config keys; a value is read
    as JSON when it is JSON (numbers, booleans), else kept as a string."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--tier-option {item!r}: use KEY=VALUE")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out
