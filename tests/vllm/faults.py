"""A fault-injecting IoEngine wrapper for tests."""

from __future__ import annotations

import collections
import errno
from collections.abc import Sequence

from nvmetier.engine import Completion, IoEngine, Op


class FailingEngine(IoEngine):
    """Fails ops of ``fail_kind`` at ``(file_idx, file_offset)`` in
    ``fail_offsets`` with ``-fail_errno`` instead of running them."""

    name = "failing"

    def __init__(self, inner: IoEngine) -> None:
        self.inner = inner
        self.fail_kind: int | None = None
        self.fail_offsets: set[tuple[int, int]] = set()
        self.fail_files: set[int] = set()  # every op on these files fails (a dead drive)
        self.fail_errno = errno.EIO
        self._failed: collections.deque[Completion] = collections.deque()

    def submit(self, ops: Sequence[Op]) -> None:
        run = []
        for op in ops:
            dead = op.file_idx in self.fail_files
            if dead or (
                op.kind == self.fail_kind and (op.file_idx, op.file_offset) in self.fail_offsets
            ):
                self._failed.append(Completion(op.op_id, -self.fail_errno, 0))
            else:
                run.append(op)
        if run:
            self.inner.submit(run)

    def wait_completions(self, timeout_s: float) -> list[Completion]:
        failed = []
        while self._failed:
            failed.append(self._failed.popleft())
        if failed:
            return failed + self.inner.wait_completions(0)
        return self.inner.wait_completions(timeout_s)

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> dict[str, object]:
        return {**self.inner.describe(), "engine": "failing"}
