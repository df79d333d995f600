"""Private memory an open costs per stored slot (issue 15, item 11).

The table and the index are shared file mappings (RssFile/RssShmem); what an
open must not leave behind is private memory (RssAnon) per stored slot. Each
open is measured in a fresh process that first raised glibc's mmap threshold
with one big free, as any long-running vLLM process has: there the rebuild's
temporaries come from the heap, which glibc keeps unless trimmed.
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from nvmetier import format as fmt
from nvmetier.files import INDEX_NAME, StoreFiles

pytestmark = pytest.mark.timeout(120)

ROW = 4096
SLOTS = 262_144
BOUND_BYTES_PER_SLOT = 24
IDENTITY = {"model_name": "memory-test", "chunk_bytes": ROW}

CHILD = r"""
import json, re, sys
import numpy
import nvmetier._table, nvmetier.recovery
from nvmetier.files import StoreFiles

def rss_anon():
    with open("/proc/self/status") as f:
        return int(re.search(r"RssAnon:\s+(\d+)", f.read()).group(1)) * 1024

big = numpy.ones((16 << 20) // 8)  # one big free raises glibc's mmap threshold
del big
before = rss_anon()
f = StoreFiles.open([sys.argv[1]], "store", capacity_bytes=int(sys.argv[2]), chunk_bytes=4096,
                    ways=8, identity=json.loads(sys.argv[3]), o_direct=False, sharing="process")
after = rss_anon()
print(json.dumps({"delta": after - before, "ready": f.table.usage()[1]}))
f.close()
"""


def make_store(root: str, capacity: int, fill: bool) -> None:
    f = StoreFiles.open(
        [root],
        "store",
        capacity_bytes=capacity,
        chunk_bytes=ROW,
        ways=8,
        identity=IDENTITY,
        o_direct=False,
        sharing="process",
    )
    n, ways = f.sb.n_slots, f.sb.ways
    f.close()
    if not fill:
        return
    n_sets = n // ways
    used = np.zeros(n_sets, dtype=np.int64)
    now = time.time_ns()
    with open(os.path.join(root, "store", INDEX_NAME), "r+b") as fh:
        index = mmap.mmap(fh.fileno(), 0)
        i = placed = 0
        while placed < n * 0.95:
            k = i.to_bytes(8, "little") * 4
            s = fmt.set_of(k, n_sets)
            i += 1
            if used[s] < ways:
                slot = s * ways + int(used[s])
                used[s] += 1
                placed += 1
                index[slot * 128 : (slot + 1) * 128] = fmt.pack_record(slot, k, 0, now - i)
        index.close()


def open_in_child(root: str, capacity: int) -> dict[str, int]:
    run = subprocess.run(
        [sys.executable, "-c", CHILD, root, str(capacity), json.dumps(IDENTITY)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(run.stdout)  # type: ignore[no-any-return]


def test_an_open_keeps_at_most_24_bytes_of_private_memory_per_stored_slot(tmp_path) -> None:
    capacity = SLOTS * (ROW + 128 + 40) + (8 << 20)
    empty, full = str(tmp_path / "empty"), str(tmp_path / "full")
    make_store(empty, capacity, fill=False)
    make_store(full, capacity, fill=True)
    e = min(open_in_child(empty, capacity)["delta"] for _ in range(2))
    runs = [open_in_child(full, capacity) for _ in range(2)]
    ready = runs[0]["ready"]
    assert ready >= SLOTS * 0.9
    per_slot = (min(r["delta"] for r in runs) - e) / ready
    assert per_slot <= BOUND_BYTES_PER_SLOT, f"{per_slot:.1f} B per slot at {ready} slots"
