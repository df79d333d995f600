"""R04: a sharer holding a set mutex (with a WRITING slot of its own in that
set) is SIGSTOPped, then SIGKILLed. The survivor's calls on that set must be
bounded while it is stopped, and after the kill the set must be recovered
(EOWNERDEAD) and the dead writer's slot reclaimed; the survivor's store of
the same key must then succeed."""
import os, signal, sys, time
sys.path.insert(0, os.path.dirname(__file__))
from common import Shared, keys_in_set, ops_ids, comp

sh = Shared(n_slots=64, ways=4)
k = keys_in_set(sh.n_sets, 0, 2)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    t, _ = sh.handle()
    t.store_ops(1, [k[0]], [0], 10, False)  # WRITING, never completed
    t._hold_set(0)
    os.write(w, b"x")
    time.sleep(60)
    os._exit(0)
os.close(w); os.read(r, 1)
t, _ = sh.handle()
os.kill(pid, signal.SIGSTOP)
t0 = time.monotonic()
res = [t.lookup(k[1]) for _ in range(1000)]
print("stopped holder: 1000 lookups took %.3f s, counters set_lock_timeouts=%d" % (time.monotonic() - t0, t.counters()["set_lock_timeouts"]))
o = t.store_ops(2, [k[0], k[1]], [1, 2], 10, False)
print("store while stopped: failed=%s pending=%s" % (o[1], o[3]))
os.kill(pid, signal.SIGKILL); os.waitpid(pid, 0)
time.sleep(1.1)  # past SET_STALL_MS
t0 = time.monotonic()
o = t.store_ops(3, [k[0]], [1], 10, False)
dt = time.monotonic() - t0
ids = ops_ids(o[0])
print("after kill: store took %.3f s ops=%d failed=%s pending=%s counters: lock_recoveries=%d dead_reclaimed=%d" % (
    dt, len(ids), o[1], o[3], t.counters()["lock_recoveries"], t.counters()["dead_slots_reclaimed"]))
if ids:
    fin = t.complete(comp(ids[0], sh.row_bytes, 7), False)
    print("complete:", fin[0], "lookup:", t.lookup(k[0]))
