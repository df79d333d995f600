"""What the crash-state recorder costs when it is off (issue 31).

Off, each file-changing call site does ``rec = hook.recorder`` and one
``is not None`` test; the only one on a hot path is the thread engine's,
once per op, and it tests a module constant fixed at import (``_HOOKED``).
This measures, in CPU time (``time.process_time``, repeated, best of N),
that test against a 64 KiB buffered ``pwrite`` of the same process (the
cheapest op the engine runs).

    PYTHONPATH=. python tools/crashsim_overhead.py
"""

from __future__ import annotations

import os
import tempfile
import time

from nvmetier.crashsim import hook
from nvmetier.engine import threads
from nvmetier.engine.base import OP_WRITE, Op


def _best(fn, n: int, repeat: int = 7) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        fn(n)
        best = min(best, time.process_time() - t0)
    return best / n


def main() -> None:
    assert hook.recorder is None, "run without NVMETIER_CRASHSIM_RECORD"
    op = Op(1, OP_WRITE, 0, 0, 0, 65536, 0, True)

    def checks(n: int) -> None:
        for _ in range(n):
            # The thread engine's per-op test (engine/threads.py, _work).
            if threads._HOOKED and op.kind == OP_WRITE:
                raise AssertionError("hooked")

    def empty(n: int) -> None:
        for _ in range(n):
            pass

    check_s = _best(checks, 1_000_000) - _best(empty, 1_000_000)
    buf = os.urandom(65536)
    with tempfile.TemporaryFile() as f:
        fd = f.fileno()

        def writes(n: int) -> None:
            for i in range(n):
                os.pwrite(fd, buf, (i % 64) * 65536)

        write_s = _best(writes, 2000)
    print(f"hook check per write op (off): {check_s * 1e9:.1f} ns")
    print(f"64 KiB buffered pwrite:        {write_s * 1e9:.0f} ns")
    print(f"overhead: {100 * check_s / write_s:.3f} % of the cheapest write op")
    print(f"load average: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
