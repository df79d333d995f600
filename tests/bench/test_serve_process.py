"""ServerProcess's clean-up after a SIGKILL: the shared-memory segments a
killed process group left in /dev/shm are removed, and only those."""

from __future__ import annotations

import os
import sys
import time
from multiprocessing import shared_memory

import pytest

from nvmetier.bench.serve import ServerProcess

pytestmark = pytest.mark.timeout(120)

# A stand-in for vLLM's processes: creates a shared-memory segment (as its
# message queues do), says its name, and waits to be killed.
HOLDER = """
import sys, time
from multiprocessing import shared_memory
seg = shared_memory.SharedMemory(create=True, size=1 << 16)
print(seg.name, flush=True)
time.sleep(600)
"""


def started_holder(tmp_path) -> tuple[ServerProcess, str]:
    log = str(tmp_path / "holder.log")
    server = ServerProcess([sys.executable, "-c", HOLDER], log, port=1, model="none").start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with open(log) as f:
            name = f.read().strip()
        if name:
            return server, "/dev/shm/" + name
        time.sleep(0.05)
    server.kill()
    raise TimeoutError("the holder never created its segment")


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_a_killed_group_leaves_no_shared_memory_segment(tmp_path) -> None:
    server, path = started_holder(tmp_path)
    assert os.path.exists(path)
    server.kill()
    assert not os.path.exists(path)
    assert server.shared_memory_left() == []


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_a_segment_a_live_process_holds_is_not_removed(tmp_path) -> None:
    server, path = started_holder(tmp_path)
    ours = shared_memory.SharedMemory(create=True, size=1 << 16)  # live: this process
    try:
        server.kill()
        assert not os.path.exists(path)
        assert os.path.exists("/dev/shm/" + ours.name)
    finally:
        ours.close()
        ours.unlink()
