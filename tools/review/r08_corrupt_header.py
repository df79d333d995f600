"""R08: every byte of the table header (first 256 bytes) set to 0x00, 0xFF, 0x80,
one at a time; then Table() must either refuse (ValueError) or work; and the
header()/sharers() readers must not crash. Runs all in one process (a crash
shows as a signal)."""
import os, sys
sys.path.insert(0, os.path.dirname(__file__))
from common import Shared
import nvmetier._table as _table
sh = Shared(n_slots=64, ways=4)
orig = bytes(sh.table_map[:256])
fd = os.open(sh.lock_path, os.O_RDWR)
refused = worked = 0
for i in range(256):
    for v in (0, 0xFF, 0x80, 0x01):
        if orig[i] == v:
            continue
        sh.table_map[i] = v
        _table.header(sh.table_map)
        try:
            t = _table.Table(sh.table_map, sh.index_map, fd, n_paths=1, slot_bytes=4096, row_bytes=4096,
                             n_rows=64, lease_ns=10**9, watch_timeout_ns=10**9)
            t.lookup(b"x"); t.store_ops(1, [b"a%d" % i], [1], 10, False); t.sweep()
            worked += 1
        except ValueError:
            refused += 1
        sh.table_map[i] = orig[i]
print("header byte corruptions: refused=%d accepted=%d (no crash)" % (refused, worked))
