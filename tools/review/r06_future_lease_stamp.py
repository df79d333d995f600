"""R06: a lease end is trusted however far in the future it is. A sharer
whose CLOCK_MONOTONIC is ahead (a time namespace: `unshare --time`, CRIU
restore; simulated here with _set_clock_offset_ns in the child only) looks a
key up and dies without releasing its lease. Every other sharer then sees the
slot leased for the whole offset (here 30 days): invalidate() refuses it and
eviction skips it. Expected: a lease never protects for more than lease_ms
(the longest a grant may last) from the viewer's clock; a stamp beyond
now + max lease is treated as expired."""
import os, signal, sys, time
sys.path.insert(0, os.path.dirname(__file__))
from common import Shared, keys_in_set, ops_ids, comp
import nvmetier._table as _table

sh = Shared(n_slots=8, ways=2)
ks = keys_in_set(sh.n_sets, 0, 3)
t, _ = sh.handle(lease_ms=100)
o = t.store_ops(1, ks[:2], [0, 1], 10, False)
t.complete(b"".join(comp(i, sh.row_bytes, 1) for i in ops_ids(o[0])), False)
pid = os.fork()
if pid == 0:
    _table._set_clock_offset_ns(30 * 86400 * 10**9)
    c, _ = sh.handle(lease_ms=100)
    c.lookup(ks[0]); c.lookup(ks[1])
    os.kill(os.getpid(), signal.SIGKILL)
os.waitpid(pid, 0)
time.sleep(0.3)  # 3 x lease_ms
print("invalidate after the lease should have ended:", t.invalidate(ks[0]))
o = t.store_ops(2, [ks[2]], [2], 10, False)
print("store of a third key in the full set: failed=%s (both ways 'leased' for 30 days)" % o[1])
_table._set_clock_offset_ns(29 * 86400 * 10**9)
print("29 days later, invalidate:", t.invalidate(ks[0]))
