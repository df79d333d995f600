"""The table's poll and the io_uring engine's completion hint
(native/nvt_job_complete.c nvt_collect): a poll skips the engine call while
the hooked engine's ``done_hint`` reads none. That hint is the hook's engine's:
a Table whose ``wait_raw`` is another engine's must still take that engine's
completions (every job finishes), as it did before the skip.
"""

from __future__ import annotations

import mmap
import time

import numpy as np
import pytest

from nvmetier.engine import make_engine
from tests.integration.helpers import ROW, fill_rows, key, make_store

pytestmark = pytest.mark.timeout(60)


def _uring_or_skip(store) -> None:
    if getattr(store.engine, "native_apply_hook", None) is None:
        pytest.skip("needs the io_uring engine")


def test_a_table_polling_another_engine_than_its_hook_finishes_every_job(tmp_path) -> None:
    buf = memoryview(mmap.mmap(-1, ROW * 8))  # page-aligned, for O_DIRECT
    store = make_store(str(tmp_path / "kv"), buf, engine="uring")
    other = None
    try:
        _uring_or_skip(store)
        # The hook stays the store's engine's; submit and wait go to another
        # engine over the same files and buffer.
        other = make_engine(
            "uring", buf, store.files.data_fds, io_threads=1, queue_depth=32, register_buffers=False
        )
        table = store._table
        table.bind(
            other.native_submit_raw,
            other.native_wait_raw,
            64,
            False,
            False,
            store.engine.native_apply_hook,
        )
        keys = [key(i) for i in range(4)]
        fill_rows(buf, keys, range(4))
        assert table.submit_store(1, keys, np.arange(4, dtype=np.int64)) is None
        done = []
        deadline = time.monotonic() + 10
        while not done and time.monotonic() < deadline:
            done = table.poll()
            time.sleep(0.001)
        assert done, "the other engine's completions were never taken"
        assert done[0][0] == 1 and done[0][1], done
    finally:
        if other is not None:
            store._table.bind(None, None, 0, False, False)
            other.close()
        store.close()
