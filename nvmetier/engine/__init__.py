"""I/O engine selection: ``threads`` (always available) or ``uring`` (native).

Owns: the choice of engine. ``NVMETIER_ENGINE=threads|uring`` overrides the
configured ``io_engine`` (used to run the whole test suite once per engine).
Called once per store open, on the constructing thread; probing io_uring may
take a few milliseconds.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from nvmetier.engine.base import (
    COMPLETION_DTYPE,
    OP_DTYPE,
    OP_READ,
    OP_WRITE,
    Completion,
    IoEngine,
    Op,
)
from nvmetier.engine.threads import ThreadEngine
from nvmetier.errors import ConfigError, EngineUnavailableError

__all__ = [
    "COMPLETION_DTYPE",
    "OP_DTYPE",
    "OP_READ",
    "OP_WRITE",
    "Completion",
    "IoEngine",
    "Op",
    "ThreadEngine",
    "make_engine",
    "resolve_engine_name",
    "uring_status",
]

logger = logging.getLogger(__name__)

ENGINE_ENV = "NVMETIER_ENGINE"
ENGINE_NAMES = ("auto", "threads", "uring")


def uring_status() -> tuple[bool, str]:
    """Whether the io_uring engine can run here, and if not, why.

    Never raises: a missing extension, ``kernel.io_uring_disabled`` and a
    seccomp filter all come back as ``(False, reason)``.
    """
    try:
        from nvmetier.engine import uring
    except ImportError as exc:  # extension not built
        return False, f"native extension not available ({exc})"
    return uring.probe()


def resolve_engine_name(configured: str) -> tuple[str, str]:
    """Pick the engine for ``configured`` (``auto|threads|uring``).

    Returns:
        (name, reason): the engine to use and a sentence saying why.

    Raises:
        ConfigError: ``NVMETIER_ENGINE`` holds an unknown name.
        EngineUnavailableError: ``uring`` was asked for and cannot run.
    """
    forced = os.environ.get(ENGINE_ENV, "").strip()
    if forced:
        if forced not in ("threads", "uring"):
            raise ConfigError(
                f"{ENGINE_ENV}={forced!r} is not an engine; use 'threads' or 'uring', or unset it"
            )
        configured = forced
    if configured == "threads":
        return "threads", "io_engine is 'threads'" if not forced else f"{ENGINE_ENV}=threads"
    ok, why = uring_status()
    if configured == "uring":
        if not ok:
            raise EngineUnavailableError(
                f"io_engine 'uring' is unavailable on this machine: {why}; "
                "set io_engine to 'auto' or 'threads'"
            )
        return "uring", "io_engine is 'uring'" if not forced else f"{ENGINE_ENV}=uring"
    if ok:
        return "uring", "io_uring probed OK"
    return "threads", f"io_uring unusable: {why}"


def make_engine(
    name: str,
    buffer: memoryview,
    fds: Sequence[int],
    *,
    io_threads: int,
    queue_depth: int,
    register_buffers: bool = True,
    max_inflight_bytes: int = 64 << 20,
) -> IoEngine:
    """Construct the engine ``name`` (already resolved) over ``buffer`` and ``fds``."""
    if name == "threads":
        return ThreadEngine(buffer, fds, n_threads=io_threads)
    if name == "uring":
        from nvmetier.engine import uring

        return uring.UringEngine(
            buffer,
            fds,
            queue_depth=queue_depth,
            register_buffers=register_buffers,
            max_inflight_bytes=max_inflight_bytes,
        )
    raise ConfigError(f"unknown I/O engine {name!r}; use one of {ENGINE_NAMES}")
