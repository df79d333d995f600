"""R12 (passes): a write completion whose set is held by a stopped sharer is
deferred, abandoned past the watch timeout (the job fails the key), and
applied jobless once the holder resumes: the slot ends READY, no op or job
leaks, no WRITING slot stays."""
import os, signal, sys, time
sys.path.insert(0, os.path.dirname(__file__))
from common import Shared, keys_in_set, ops_ids, comp
import nvmetier._table as _table

sh = Shared(n_slots=64, ways=4)
k = keys_in_set(sh.n_sets, 0, 1)[0]
t, _ = sh.handle(watch_ms=200)
o = t.store_ops(1, [k], [0], 10, False)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    c, _ = sh.handle()
    c._hold_set(0); os.write(w, b"x"); time.sleep(5); c._release_set(0); time.sleep(30); os._exit(0)
os.read(r, 1)
os.kill(pid, signal.SIGSTOP)
fin = t.complete(comp(ops_ids(o[0])[0], sh.row_bytes, 3), False)
print("while held: finished=%s inflight=%s" % (fin[0], t.inflight()))
time.sleep(0.25)
fin = t.complete(b"", False)
print("past the deadline: finished=%s inflight=%s" % (fin[0], t.inflight()))
os.kill(pid, signal.SIGCONT); time.sleep(5.3)
fin = t.complete(b"", False)
print("after release: finished=%s inflight=%s contains=%s usage=%s counters=%s" % (
    fin[0], t.inflight(), t.contains(k), t.usage(), {x: t.counters()[x] for x in ("completions_deferred", "completions_abandoned", "set_lock_timeouts")}))
os.kill(pid, signal.SIGKILL); os.waitpid(pid, 0)
