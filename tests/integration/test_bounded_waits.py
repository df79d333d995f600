"""Nothing waits without bound on another sharer (issue 15, item 1): a store
of a key another sharer is writing, and close(), end within their bounds when
that writer has stopped. Two BlockStores of one process share one store (each
is its own sharer: its own lock file description); the "stopped" one has an
engine that takes ops and never completes them."""

from __future__ import annotations

import logging
import mmap
from collections.abc import Iterator
from typing import Any

import pytest

import nvmetier.store as store_mod
from nvmetier.engine import IoEngine

from .helpers import ROW, fill_rows, key, load_keys, make_store, run


class _Stopped(IoEngine):
    """Takes every op and never completes one (its process is stopped)."""

    def __init__(self, inner: IoEngine) -> None:
        self.inner = inner
        self.name = inner.name
        self.taken = 0

    def submit(self, ops: Any) -> None:
        self.taken += len(ops)

    def wait_completions(self, timeout_s: float) -> Any:
        return []

    def submit_raw(self, ops: bytes) -> None:
        self.taken += 1

    def wait_raw(self, timeout_s: float) -> bytes:
        return b""

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> dict[str, object]:
        return self.inner.describe()


@pytest.fixture(params=["threads", "uring"])
def engine(request) -> str:
    if request.param == "uring":
        from nvmetier.engine import uring

        ok, why = uring.probe()
        if not ok:
            pytest.skip(f"io_uring unavailable: {why}")
    return str(request.param)


@pytest.fixture
def other_buffer() -> Iterator[memoryview]:
    mm = mmap.mmap(-1, 64 * ROW)
    view = memoryview(mm)
    yield view
    view.release()
    mm.close()


def test_a_store_waiting_for_a_stopped_writer_fails_within_its_bound(
    tmp_path, buffer, other_buffer, engine, monkeypatch, caplog
) -> None:
    monkeypatch.setattr(store_mod, "WATCH_TIMEOUT_S", 0.3)
    monkeypatch.setattr(store_mod, "CLOSE_DRAIN_S", 0.3)
    stopped = make_store(str(tmp_path), other_buffer, engine=engine, engine_wrapper=_Stopped)
    live = make_store(str(tmp_path), buffer, engine=engine)
    try:
        keys = [key(i) for i in range(3)]
        fill_rows(other_buffer, keys[:1], [0])
        stopped.submit_store(1, keys[:1], [0])  # WRITING, and never completes
        fill_rows(buffer, keys, range(3))
        live.submit_store(2, keys, [0, 1, 2])
        (outcome,) = run(live, timeout_s=5.0)
        assert not outcome.success
        assert outcome.successful_keys == keys[1:]  # the watched key is not reported stored
        stats = live.stats()
        assert stats["stores_dropped_watch_timeout"] == 1
        assert stats["jobs_in_flight"] == 0
        loaded, good = load_keys(live, buffer, keys[1:], job_id=3)
        assert loaded.success and good == keys[1:]
    finally:
        with caplog.at_level(logging.WARNING, logger="nvmetier.store"):
            stopped.close()  # bounded: its op never completes
        assert "close gave up" in " ".join(r.getMessage() for r in caplog.records)
        live.close()


def test_close_drains_for_a_bounded_time_then_warns_what_it_dropped(
    tmp_path, buffer, engine, monkeypatch, caplog
) -> None:
    monkeypatch.setattr(store_mod, "CLOSE_DRAIN_S", 0.2)
    store = make_store(str(tmp_path), buffer, engine=engine, engine_wrapper=_Stopped)
    keys = [key(i) for i in range(2)]
    fill_rows(buffer, keys, [0, 1])
    store.submit_store(1, keys, [0, 1])
    with caplog.at_level(logging.WARNING, logger="nvmetier.store"):
        store.close()
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "close gave up after 0.2s waiting for 1 jobs in flight (2 ops outstanding" in text
    reopened = make_store(str(tmp_path), buffer, engine=engine)
    try:
        assert not any(reopened.contains(k) for k in keys)  # dropped, never half-stored
    finally:
        reopened.close()
