"""The I/O engine interface: positioned reads and writes between one memory
buffer (the primary tier's region) and a set of open files.

Owns: nothing but the mechanics of moving bytes. It knows no keys, slots or
jobs. An *op* moves ``length`` bytes between ``buffer[buf_offset:]`` and
``files[file_idx]`` at ``file_offset``; every op also yields an XXH3-64
checksum of the bytes moved (seeded by ``seed``), computed by the engine off the
caller's thread, so the store never touches chunk bytes itself.

Threads: ``submit`` and ``wait_completions`` are called by one thread at a
time, the store's caller (vLLM's scheduler thread). ``submit`` never blocks (it
only enqueues); ``wait_completions(0)`` only polls, and a positive timeout
blocks up to ``timeout_s`` (``wait_idle``/``close`` use it). ``close`` is
called once, after the last op completed or after ``wait_idle``.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import NamedTuple

OP_READ = 0
OP_WRITE = 1


class Op(NamedTuple):
    """One positioned read or write (a NamedTuple: cheap on the hot path).

    Attributes:
        op_id: caller's identifier, echoed in the completion.
        kind: OP_READ (file -> buffer) or OP_WRITE (buffer -> file).
        file_idx: index into the engine's file list.
        file_offset: byte offset in the file (aligned for O_DIRECT).
        buf_offset: byte offset in the engine's buffer.
        length: bytes to move.
        seed: XXH3-64 seed for the checksum of the moved bytes.
        checksum: False skips the checksum (the completion's is then 0): a
            load whose bytes nobody will verify need not be read by the CPU.
    """

    op_id: int
    kind: int
    file_idx: int
    file_offset: int
    buf_offset: int
    length: int
    seed: int = 0
    checksum: bool = True


class Completion(NamedTuple):
    """The outcome of one op.

    Attributes:
        op_id: the op's identifier.
        result: bytes moved (== length on success), or ``-errno`` on failure.
            A short transfer is reported as ``-EIO`` by every engine.
        checksum: XXH3-64 (with the op's seed) of the bytes moved; 0 on failure
            or when the op asked for no checksum.
    """

    op_id: int
    result: int
    checksum: int


class IoEngine(abc.ABC):
    """Moves bytes for ops; see the module docstring for the thread rules."""

    name: str = "abstract"

    @abc.abstractmethod
    def submit(self, ops: Sequence[Op]) -> None:
        """Queue ops for execution. Never blocks on I/O.

        Raises:
            EngineClosedError: after ``close``.
        """

    @abc.abstractmethod
    def wait_completions(self, timeout_s: float) -> list[Completion]:
        """Return completed ops, waiting up to ``timeout_s`` for the first one.

        Returns an empty list on timeout. Only one thread may call this.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the engine's threads and release its resources.

        Ops still queued are completed with ``-ECANCELED``; ops already
        running finish first (a half-done transfer would corrupt data).
        Completions remain available from ``wait_completions``. Idempotent.
        """

    def describe(self) -> dict[str, object]:
        """Facts for ``config_info`` and ``nvmetier info``."""
        return {"engine": self.name}


def xxh3_seeded(data: memoryview | bytes, seed: int) -> int:
    """XXH3-64 of ``data`` with ``seed``, the checksum every engine computes."""
    import xxhash

    return xxhash.xxh3_64_intdigest(data, seed)
