"""R11: a Table used in a forked child keeps the parent's registry identity
(index, incarnation) and its OFD lock (the child shares the parent's lock
file description). A child that claims a slot and dies leaves a WRITING slot
that no sharer can ever reclaim while the parent lives: the parent sees it as
its own, the others see the OFD lock held. Every store of that key by anyone
then waits its watch timeout and fails, for the parent's whole lifetime.
Expected: a Table refuses use in a process other than the one that attached
(getpid() check), or the child re-attaches as a sharer of its own."""
import os, signal, sys, time
sys.path.insert(0, os.path.dirname(__file__))
from common import Shared, keys_in_set, ops_ids, comp
import nvmetier._table as _table

sh = Shared(n_slots=64, ways=4)
parent, _ = sh.handle(watch_ms=300)
k = b"orphaned-key"
pid = os.fork()
if pid == 0:
    parent.store_ops(1, [k], [0], 10, False)  # the child claims: WRITING, owner = the parent's identity
    os.kill(os.getpid(), signal.SIGKILL)
os.waitpid(pid, 0)
other, _ = sh.handle(watch_ms=300)
time.sleep(0.3)
for who, t in (("parent", parent), ("other sharer", other)):
    o = t.store_ops(2, [k], [1], 10, False)
    deadline = time.monotonic() + 1.0
    fin = []
    while not fin and time.monotonic() < deadline:
        time.sleep(0.05)
        fin = t.complete(b"", False)[0]
    print("%s: store of the key: ops=%d pending=%d -> %s" % (who, len(ops_ids(o[0])), o[3], fin))
print("sweep by the other sharer reclaims:", other.sweep())
