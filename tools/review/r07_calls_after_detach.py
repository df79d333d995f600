"""R07: a Table keeps claiming slots after detach() (or before attach()): its
WRITING slots name registry entry 0 with a stale/zero incarnation, so any
sharer (here a second handle) treats the writer as dead and reclaims the slot
200 ms later while the write is still in flight; the writer's completion then
fails. Expected: store_ops/load_ops/submit_* raise (or drop) when the handle is
not attached."""
import os, sys, time
sys.path.insert(0, os.path.dirname(__file__))
from common import Shared, keys_in_set, ops_ids, comp
import nvmetier._table as _table

sh = Shared(n_slots=8, ways=1)
ks = keys_in_set(sh.n_sets, 0, 2)
a, _ = sh.handle()
a.detach()
o = a.store_ops(1, [ks[0]], [0], 10, False)
print("store_ops after detach accepted: ops=%d" % len(ops_ids(o[0])))
b, _ = sh.handle()
_table._set_clock_offset_ns(300 * 10**6)
o2 = b.store_ops(2, [ks[1]], [1], 10, False)  # full 1-way set: reclaims a's "dead" slot
print("other sharer claimed the same slot: ops=%d dead_slots_reclaimed=%d" % (len(ops_ids(o2[0])), b.counters()["dead_slots_reclaimed"]))
fin = a.complete(comp(ops_ids(o[0])[0], sh.row_bytes, 5), False)
print("detached writer's completion:", fin[0])
