"""``nvmetier purge`` of a store that vLLM processes are using (issue 23).

Every sharer is a separate vLLM instance (``tests/vllm/sharer.py``: vLLM's
real orchestrator, a CPU primary and our tier); the purge is the real CLI in
its own process. Whatever happens to a sharer or to the purge, every process
sees misses for what was purged, never wrong bytes, never a stall beyond the
failure model's bounds:

- a sharer stopped holding a set mutex: the purge retries that set for
  ``BUSY_RETRY_S``, then reports it left (exit 4); once the sharer
  continues, a second purge finishes the set (exit 0);
- a sharer killed (SIGKILL) or stopped (SIGSTOP) while it stores and loads
  during the purge: the purge finishes in its bound, the survivor serves new
  chunks, nobody loads wrong bytes (the victim's journal);
- the purge itself killed at a random moment: the sharers work on, and the
  next purge finishes.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from nvmetier.purge import BUSY_RETRY_S
from tests.vllm.conftest import nvme_tier
from tests.vllm.sharer import Sharer, read_journal, wait_stopped

pytestmark = pytest.mark.timeout(300)

MODEL = "nvmetier/purge-model"
BASE = list(range(64))
# The purge's own bound: its set retries plus process start and the set walk.
PURGE_LIMIT_S = BUSY_RETRY_S + 15.0
PHASE_LIMIT_S = 5.0


def _tier(root: str) -> dict[str, Any]:
    return nvme_tier(root, capacity_bytes="128MiB")


def _purge(root: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "nvmetier.cli", "purge", root, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str, float]:
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=PURGE_LIMIT_S)
    return proc.returncode, out + err, time.monotonic() - t0


@pytest.fixture
def pair(tmp_path):
    root = str(tmp_path / "kv")
    survivor, victim = Sharer("survivor"), Sharer("victim")
    try:
        survivor.call("open", tier=_tier(root), model=MODEL)
        victim.call("open", tier=_tier(root), model=MODEL)
        assert survivor.call("store", keys=BASE)["present"] == BASE
        yield root, survivor, victim
    finally:
        if victim.proc.is_alive():
            victim.resume()
        victim.close()
        survivor.close()


def _assert_survivor_serves_new_chunks(survivor: Sharer, first: int) -> None:
    fresh = list(range(first, first + 16))
    assert survivor.call("store", keys=fresh, timeout_s=PHASE_LIMIT_S)["present"] == fresh
    got = survivor.call("promote", keys=fresh, timeout_s=PHASE_LIMIT_S)
    assert got["hit"] == fresh and not got["wrong"]


def test_purge_with_a_sharer_stopped_holding_a_set_is_bounded_and_resumable(pair) -> None:
    root, survivor, victim = pair
    held = BASE[0]
    victim.send("hold_set_then_stop", i=held)
    assert victim.proc.pid is not None
    wait_stopped(victim.proc.pid)
    code, out, secs = _finish(_purge(root, "--all"))
    assert code == 4, out
    assert "1 sets not purged" in out and "removed" in out
    assert secs < PURGE_LIMIT_S
    got = survivor.call("promote", keys=BASE, timeout_s=PHASE_LIMIT_S)
    assert got["hit"] == [] and not got["wrong"]  # purged, or its set busy: a miss
    victim.resume()
    assert victim.recv(timeout_s=PHASE_LIMIT_S) is None  # it released the mutex
    code, out, _secs = _finish(_purge(root, "--all"))
    assert code == 0, out
    got = survivor.call("promote", keys=BASE, timeout_s=PHASE_LIMIT_S)
    assert got["hit"] == [] and not got["wrong"]
    _assert_survivor_serves_new_chunks(survivor, 5000)


@pytest.mark.parametrize("fault", ["sigkill", "sigstop"])
def test_sharer_killed_or_stopped_during_a_purge(pair, tmp_path, fault) -> None:
    root, survivor, victim = pair
    journal = str(tmp_path / "journal")
    victim.send("victim", journal=journal, store_keys=list(range(1000, 1400)), load_keys=list(BASE))
    time.sleep(0.3)  # it stores and loads
    proc = _purge(root, "--all")
    time.sleep(random.Random(7).uniform(0.1, 0.3))  # while the CLI starts or purges
    if fault == "sigkill":
        victim.kill()
    else:
        victim.stop()
    code, out, _secs = _finish(proc)
    # A stop inside a set's critical section leaves that set (exit 4); else 0.
    assert code in (0, 4) if fault == "sigstop" else code == 0, out
    got = survivor.call("promote", keys=BASE, timeout_s=PHASE_LIMIT_S)
    assert not got["wrong"]
    if code == 0:
        assert got["hit"] == []  # the victim never stores BASE: all purged
    _assert_survivor_serves_new_chunks(survivor, 6000)
    if fault == "sigstop":
        victim.resume()
        time.sleep(0.2)  # it works on after the purge
        victim.kill()
        code, out, _secs = _finish(_purge(root, "--all"))
        assert code == 0, out
    assert read_journal(journal).wrong == []
    got = survivor.call("promote", keys=BASE + list(range(1000, 1400)), timeout_s=30)
    assert got["hit"] == [] and not got["wrong"]


def test_purge_killed_at_random_moments_leaves_the_store_working(pair) -> None:
    root, survivor, victim = pair
    rng = random.Random(11)
    for trial in range(5):
        keys = list(range(2000 + 100 * trial, 2000 + 100 * trial + 32))
        survivor.call("store", keys=keys, timeout_s=PHASE_LIMIT_S)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from nvmetier import purge; print('ready', flush=True); "
                "purge.purge(sys.argv[1], older_than_s=None)",
                root,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.01))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        # Both sharers work on: loads give the right bytes or a miss.
        for s in (survivor, victim):
            got = s.call("promote", keys=keys, timeout_s=PHASE_LIMIT_S)
            assert not got["wrong"]
        _assert_survivor_serves_new_chunks(survivor, 7000 + 100 * trial)
    code, out, _secs = _finish(_purge(root, "--all"))
    assert code == 0, out
    got = victim.call("promote", keys=BASE, timeout_s=PHASE_LIMIT_S)
    assert got["hit"] == [] and not got["wrong"]
