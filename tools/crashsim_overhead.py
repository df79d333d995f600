"""What the crash-state recorder costs when it is off (issue 31).

Off, each file-changing call site does ``rec = hook.recorder`` and one
``is not None`` test; the only one on a hot path is the thread engine's,
once per op (twice for a write). This measures, in CPU time
(``time.process_time``, repeated, best of N), that check against a 64 KiB
buffered ``pwrite`` of the same process (the cheapest op the engine runs),
and the thread engine's stores of a real ``BlockStore`` per op.

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
            rec = hook.recorder
            if rec is not None and op.kind == OP_WRITE:
                rec.checkpoint()
            if threads._PUBLISH_EARLY and op.kind == OP_WRITE:  # the planted-bug switch
                rec.checkpoint()
            if rec is not None and op.kind == OP_WRITE:
                rec.checkpoint()

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
