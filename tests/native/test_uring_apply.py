"""The io_uring engine's workers apply the slot side of each completion
(native/nvt_job_worker.c, installed by ``Table.bind``'s ``apply_hook``).

A store's chunk is READY for every sharer once its worker published the
completion, before vLLM's thread polls; the poll then only accounts for it.
What the worker leaves (a corrupt load, a store the engine cancelled at close)
is applied by the poll as before. Close with ops in flight removes the hook
only after the workers are gone, and leaves a store that reopens with every
chunk either there and intact or absent.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from nvmetier.engine import uring
from nvmetier.files import DATA_NAME
from nvmetier.store import BlockStore
from tests.fault.faultkit import (
    IDENTITY,
    ROW,
    STORE_NAME,
    config,
    flip_bit,
    key,
    live_records,
    load_keys,
    new_buffer,
    payload,
    read_superblock,
    store_dir,
    wait_jobs,
)

_OK, _WHY = uring.probe()
if not _OK:
    pytest.skip(f"io_uring is unusable here: {_WHY}", allow_module_level=True)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def buf() -> Iterator[memoryview]:
    b = new_buffer()
    yield b
    b.release()


def _fill(buf: memoryview, keys: list[bytes], first_row: int = 0) -> list[int]:
    rows = list(range(first_row, first_row + len(keys)))
    for k, r in zip(keys, rows, strict=True):
        buf[r * ROW : (r + 1) * ROW] = payload(k)
    return rows


def _uring(root: str, buf: memoryview, **overrides: Any) -> BlockStore:
    """A store on the io_uring engine, whatever NVMETIER_ENGINE says."""
    return BlockStore(
        config(root, **overrides),
        store_name=STORE_NAME,
        identity=IDENTITY,
        buffer=buf,
        row_bytes=ROW,
        engine="uring",
    )


def _until(cond, timeout_s: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.002)
    return False


def test_a_stored_chunk_is_there_for_every_sharer_before_the_scheduler_thread_polls(
    tmp_path, buf
) -> None:
    root = str(tmp_path / "kv")
    store = _uring(root, buf)
    other = _uring(root, new_buffer())  # another sharer of the same store
    try:
        keys = [key(i) for i in range(8)]
        store.submit_store(1, keys, _fill(buf, keys))
        # No poll on `store`: only its engine's workers can have published these.
        assert _until(lambda: all(other.lookup(k) for k in keys))
        assert store.stats()["ops_written"] == 0  # accounted for by the poll only
        (outcome,) = wait_jobs(store)
        assert outcome.success and store.stats()["ops_written"] == 8
        assert store.stats()["bytes_written"] == 8 * ROW
        got, good, bad = load_keys(store, buf, keys)
        assert got.success and good == keys and bad == []
        assert store.stats()["ops_read"] == 8 and store.stats()["checksum_failures"] == 0
    finally:
        other.close()
        store.close()


def test_a_corrupt_chunk_is_left_by_the_worker_and_freed_by_the_poll(tmp_path, buf) -> None:
    root = str(tmp_path / "kv")
    store = _uring(root, buf)
    keys = [key(i) for i in range(4)]
    store.submit_store(1, keys, _fill(buf, keys))
    assert wait_jobs(store)[0].success
    store.close()
    rec = live_records(store_dir(root))[0]
    sb = read_superblock(store_dir(root))
    _, offset = sb.slot_location(rec.slot)
    flip_bit(os.path.join(store_dir(root), DATA_NAME), offset + 100, 3)
    store = _uring(root, buf)
    try:
        outcome, good, bad = load_keys(store, buf, keys)
        assert not outcome.success and bad == []
        assert sorted(good) == sorted(k for k in keys if k != rec.key)
        assert store.stats()["checksum_failures"] == 1
        assert not store.lookup(rec.key)  # freed, never served again
    finally:
        store.close()


def test_close_with_stores_in_flight_leaves_each_chunk_whole_or_absent(tmp_path, buf) -> None:
    """close() drains the job, stops the engine (its workers joined), then
    unbinds the table: every chunk written is there, whole."""
    root = str(tmp_path / "kv")
    for trial in range(3):
        store = _uring(root, buf)
        keys = [key(i, trial) for i in range(32)]
        store.submit_store(1, keys, _fill(buf, keys))
        store.close()
        store = _uring(root, buf)
        try:
            assert all(store.lookup(k) for k in keys)
            outcome, good, bad = load_keys(store, buf, keys)
            assert outcome.success and good == keys and bad == []
        finally:
            store.close()


def test_an_engine_stopped_with_stores_queued_leaves_each_chunk_whole_or_absent(
    tmp_path, buf
) -> None:
    """The engine stops with writes still queued (cancelled: the poll frees
    their slots) and in its rings (completed and applied by their worker);
    the reopened store serves what landed, intact, and nothing else. The
    engine is stopped once its workers completed a first write (a submit
    wakes one idle worker, which wakes the other: on a busy machine neither
    may have run yet right after the submit); a trial whose writes all landed
    or none proves nothing of the mix, so trials run until one is mixed (every
    trial is checked)."""
    mixed = 0
    for trial in range(20):
        root = str(tmp_path / f"kv{trial}")
        store = _uring(root, buf, queue_depth=2)
        keys = [key(i, trial) for i in range(64)]
        store.submit_store(1, keys[:32], _fill(buf, keys[:32]))
        store.submit_store(2, keys[32:], _fill(buf, keys[32:], first_row=32))
        deadline = time.monotonic() + 2.0
        while not sum(w["ops"] for w in store.engine.worker_stats()):
            assert time.monotonic() < deadline, "no write completed within 2 s"
        store.engine.close()
        outcomes = wait_jobs(store, 2)
        assert {o.job_id for o in outcomes} == {1, 2}
        job_keys = {1: keys[:32], 2: keys[32:]}
        stored = [
            k
            for o in outcomes
            for k in (job_keys[o.job_id] if o.successful_keys is None else o.successful_keys)
        ]
        store.close()
        store = _uring(root, buf)
        try:
            present = [k for k in keys if store.lookup(k)]
            assert sorted(present) == sorted(stored)
            outcome, good, bad = load_keys(store, buf, present)
            assert outcome.success and good == present and bad == []
        finally:
            store.close()
        mixed += 0 < len(stored) < len(keys)
        if mixed:
            break
    assert mixed, "every trial's writes all landed or none: the mix was never exercised"


def test_stores_and_loads_racing_over_a_small_table_never_serve_wrong_bytes(tmp_path, buf) -> None:
    """Workers applying completions while the scheduler thread claims, evicts
    and leases in the same few sets (TSan runs this): every load reported
    successful has its key's bytes, and a chunk stored is found or evicted."""
    root = str(tmp_path / "kv")
    store = _uring(root, buf, capacity_bytes="2MiB", ways=4)  # 32 slots
    served = 0
    try:
        for rnd in range(6):
            keys = [key(i, rnd) for i in range(24)]
            store.submit_store(10 * rnd, keys[:12], _fill(buf, keys[:12]))
            store.submit_store(10 * rnd + 1, keys[12:], _fill(buf, keys[12:], first_row=12))
            wait_jobs(store, 2)
            old = [key(i, rnd - 1) for i in range(24)] if rnd else keys
            outcome, good, bad = load_keys(store, buf, old, job_id=10 * rnd + 2)
            assert bad == [] and outcome.job_id == 10 * rnd + 2
            served += len(good)
        stats = store.stats()
        assert served > 0 and stats["ops_read"] == served and stats["checksum_failures"] == 0
    finally:
        store.close()


_KILLED_WRITER = """
import os, signal, sys, time
from tests.fault.faultkit import IDENTITY, ROW, STORE_NAME, config, key, new_buffer, payload
from nvmetier.store import BlockStore
buf = new_buffer()
store = BlockStore(config(sys.argv[1]), store_name=STORE_NAME, identity=IDENTITY, buffer=buf,
                   row_bytes=ROW, engine="uring")
keys = [key(i, 7) for i in range(int(sys.argv[2]))]
for r, k in enumerate(keys):
    buf[r * ROW : (r + 1) * ROW] = payload(k)
store.submit_store(1, keys, list(range(len(keys))))
# Take the completions from the engine without applying them (no poll, no
# table call that could hold a set the worker tries): each was seen by its
# worker's hook before it could be taken.
taken, deadline = 0, time.monotonic() + 20
while taken < len(keys) and time.monotonic() < deadline:
    taken += len(store.engine.wait_raw(0.1)) // 24
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_chunks_published_by_a_sharer_killed_before_its_poll_count_as_ready(tmp_path, buf) -> None:
    """A sharer SIGKILLed after its workers published its writes but before
    its scheduler thread polled: the chunks are READY for the others, and the
    shared ready gauge counts them (it stayed short by each, until the last
    closer's sweep, when the gauge was only added to at the poll)."""
    import subprocess
    import sys

    root = str(tmp_path / "kv")
    other = _uring(root, buf)
    try:
        n = 12
        proc = subprocess.run(
            [sys.executable, "-c", _KILLED_WRITER, root, str(n)],
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
            timeout=60,
        )
        assert proc.returncode == -9
        present = [k for k in (key(i, 7) for i in range(n)) if other.contains(k)]
        # Published by the dead sharer's workers (one whose set was busy at
        # that instant was left to a poll that never came: reclaimed).
        assert present
        assert other.stats()["slots_ready"] == len(present)
        outcome, good, bad = load_keys(other, buf, present)
        assert outcome.success and good == present and bad == []
    finally:
        other.close()


def test_a_table_freed_while_its_engine_completes_its_ops_is_never_touched_after(tmp_path) -> None:
    """The Table goes (garbage, never unbound) with writes in flight: its
    dealloc removes the hook, waiting for a worker inside it, so the workers
    that complete those writes afterwards never read the freed Table (ASan
    runs this: scripts/sanitize.sh)."""
    import gc
    import mmap

    from nvmetier.engine.uring import UringEngine
    from tests.unit.test_table_model import N_ROWS, N_SLOTS, ROW_BYTES, Shared

    path = str(tmp_path / "data")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, N_SLOTS * ROW_BYTES)
    primary = memoryview(mmap.mmap(-1, N_ROWS * ROW_BYTES))
    eng = UringEngine(primary, [fd], queue_depth=2, workers=2)
    try:
        for trial in range(20):
            shared = Shared()  # a fresh table: the last one's slots stay WRITING
            table, _ = shared.handle()
            table.bind(eng.submit_raw, eng.native_wait_raw, 64, True, False, eng.native_apply_hook)
            keys = [b"freed-%d-%d" % (trial, i) for i in range(6)]
            assert table.submit_store(trial, keys, list(range(len(keys)))) is None
            n_ops, _jobs = table.inflight()
            assert n_ops > 0
            del table
            gc.collect()
            taken, deadline = 0, time.monotonic() + 10
            while taken < n_ops and time.monotonic() < deadline:
                taken += len(eng.wait_raw(0.1)) // 24
            assert taken == n_ops
            shared.close()
    finally:
        eng.close()
        primary.release()
        os.close(fd)
