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
import mmap
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from nvmetier.memory import advise

OP_READ = 0
OP_WRITE = 1

# Packed ops and completions (``submit_raw``/``wait_raw``): the C layouts of
# nvt_op and nvt_completion in native/nvt_engine.h, which the native table
# produces and consumes. Changing them requires changing that header.
OP_DTYPE = np.dtype(
    [
        ("op_id", "<u8"),
        ("file_offset", "<i8"),
        ("buf_offset", "<i8"),
        ("length", "<i8"),
        ("file_idx", "<i8"),
        ("seed", "<u8"),
        ("kind", "<i4"),
        ("checksum", "<i4"),
    ]
)
COMPLETION_DTYPE = np.dtype([("op_id", "<u8"), ("result", "<i8"), ("checksum", "<u8")])
assert OP_DTYPE.itemsize == 56 and COMPLETION_DTYPE.itemsize == 24


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


def unpack_ops(ops: bytes, cls: type[Op] = Op) -> list[Op]:
    """Packed ops (``OP_DTYPE``) as ``cls`` tuples (``Op`` or a subclass)."""
    return [
        cls(op_id, kind, file_idx, file_off, buf_off, length, seed, bool(checksum))
        for op_id, file_off, buf_off, length, file_idx, seed, kind, checksum in (
            np.frombuffer(ops, dtype=OP_DTYPE).tolist()
        )
    ]


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

    def submit_raw(self, ops: bytes) -> None:
        """Queue packed ops (``OP_DTYPE`` records, as the native table makes
        them). Never blocks on I/O. This default converts them to ``Op`` and
        calls ``submit`` (engines and test wrappers that only implement the
        object interface keep working); the io_uring engine takes the bytes
        as they are.

        Raises:
            EngineClosedError: after ``close``.
        """
        self.submit(unpack_ops(ops))

    def wait_raw(self, timeout_s: float) -> bytes:
        """``wait_completions`` as packed ``COMPLETION_DTYPE`` records."""
        comps = self.wait_completions(timeout_s)
        if not comps:
            return b""
        arr = np.empty(len(comps), dtype=COMPLETION_DTYPE)
        arr["op_id"] = [c.op_id for c in comps]
        arr["result"] = [c.result for c in comps]
        arr["checksum"] = [c.checksum for c in comps]
        return arr.tobytes()

    def describe(self) -> dict[str, object]:
        """Facts for ``config_info`` and ``nvmetier info``."""
        return {"engine": self.name}


def xxh3_seeded(data: memoryview | bytes, seed: int) -> int:
    """XXH3-64 of ``data`` with ``seed``, the checksum every engine computes."""
    import xxhash

    return xxhash.xxh3_64_intdigest(data, seed)


def dontdump(m: mmap.mmap) -> None:
    """Keep a mapping that holds sealed slot images or keys out of core
    dumps (``MADV_DONTDUMP``; best effort where the kernel lacks it)."""
    advise(m, "MADV_DONTDUMP")
