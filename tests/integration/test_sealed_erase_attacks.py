"""Erasure attacks on sealed stores the earlier reviews left out: chunks
that left the table before a purge (invalidated by vLLM, evicted, expired)
but whose sealed image is still on disk. The attacker holds the store's
files after the purge and the key file (``recover`` of test_sealed_keys.py).
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("nvmetier._crypto")

from nvmetier import purge
from tests.integration.helpers import ROW, key, load_keys, payload, store_keys
from tests.integration.test_sealed_keys import chunks_of, new_key, recover, sealed

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("online", [True, False], ids=["online", "offline"])
def test_purge_older_than_erases_chunks_invalidated_before_it(tmp_path, buffer, online) -> None:
    """A chunk vLLM invalidated (its record gone, its slot free but not
    written again) is older than the cutoff like the others: the purge must
    erase it too, though its epoch lives on for newer chunks."""
    kf = new_key(tmp_path)
    root = tmp_path / "kv"
    old, new = [key(i) for i in range(8)], [key(100 + i) for i in range(8)]
    s = sealed(root, buffer, kf)
    store_keys(s, buffer, old)
    gone = old[:3]
    for k in gone:
        assert s.invalidate(k)
    time.sleep(1.2)
    rows_new = list(range(8, 16))
    for k, r in zip(new, rows_new, strict=True):
        buffer[r * ROW : (r + 1) * ROW] = payload(k)
    s.submit_store(3, new, rows_new)
    assert s.wait_idle(30)
    s.poll()
    if not online:
        s.close()
    (r,) = purge.purge(str(root), older_than_s=1.0)
    assert r.error is None and r.epochs_destroyed == 0
    assert recover(root / "store", kf, chunks_of(old)) == []
    if online:
        s.close()
    s = sealed(root, buffer, kf)
    assert load_keys(s, buffer, new, job_id=4)[1] == new
    s.close()
