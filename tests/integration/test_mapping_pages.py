"""The table and index mappings ask for 2 MiB pages (``MADV_HUGEPAGE``): a
lookup, lease, load or touch reads one set and one record per key, in random
places; with 4 KiB pages each is a TLB miss, which on a VM costs a nested
page walk (docs/bench.md, "Where a key's time goes")."""

from __future__ import annotations

import mmap
import os

import pytest

from nvmetier.config import TierConfig
from nvmetier.store import BlockStore

pytestmark = pytest.mark.skipif(
    not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform"
)


def _vm_flags(path: str) -> list[str]:
    """The VmFlags of every mapping of ``path`` in this process."""
    out = []
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if line.rstrip().endswith(path):
            for follow in lines[i + 1 :]:
                if follow.startswith("VmFlags:"):
                    out.append(follow)
                    break
    return out


def test_the_table_and_index_mappings_ask_for_huge_pages(tmp_path) -> None:
    buf = memoryview(mmap.mmap(-1, 16 * 4096))
    cfg = TierConfig.from_dict(
        {"root_dir": str(tmp_path), "capacity_bytes": 64 << 20, "o_direct": False}
    )
    store = BlockStore(cfg, store_name="s", identity={"t": 1}, buffer=buf, row_bytes=4096)
    try:
        for name in ("table", "index"):
            path = os.path.join(str(tmp_path), "s", name)
            flags = _vm_flags(path)
            assert flags, f"{path} is not mapped"
            if not any(" hg" in f for f in flags):
                with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
                    if "[never]" in f.read():
                        pytest.skip("transparent huge pages are off on this machine")
            assert all(" hg" in f for f in flags), flags
    finally:
        store.close()
        buf.release()
