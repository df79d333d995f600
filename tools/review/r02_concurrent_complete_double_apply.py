"""R02: two threads apply the same completion while the op's set mutex is held
by another process for ~8 ms. apply_one checks ops[oi].in_use *before*
nvt_set_lock, which releases the GIL; both threads pass the check, then both
apply and op_release() the op: its index lands twice on the free list (one
write past the free list's end once every op is free) and the next two op
allocations return the same op_info. Expected: the second apply is a no-op
(stale completion). Observed: two ops of different keys with the same op id."""
import os, signal, sys, threading, time
sys.path.insert(0, os.path.dirname(__file__))
from common import Shared, keys_in_set, ops_ids, comp

sh = Shared(n_slots=64, ways=4)
r_fd, w_fd = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(w_fd)
    t, _ = sh.handle()
    while True:
        if os.read(r_fd, 1) == b"":
            os._exit(0)
        t._hold_set(0)
        time.sleep(0.008)
        t._release_set(0)
t, _ = sh.handle()
k0 = keys_in_set(sh.n_sets, 0, 1)[0]
ops, failed, ev, pending = t.store_ops(1, [k0], [0], 100, False)
oid = ops_ids(ops)[0]
c = comp(oid, sh.row_bytes, 123)
os.write(w_fd, b"x"); time.sleep(0.002)   # child now holds set 0 for 8 ms
res = []
ths = [threading.Thread(target=lambda: res.append(t.complete(c, False))) for _ in range(2)]
[th.start() for th in ths]; [th.join() for th in ths]
print("finished lists:", [r[0] for r in res])
a = ops_ids(t.store_ops(2, keys_in_set(sh.n_sets, 1, 1), [1], 100, False)[0])
b = ops_ids(t.store_ops(3, keys_in_set(sh.n_sets, 2, 1), [2], 100, False)[0])
print("op ids of two new stores:", a, b, "inflight:", t.inflight())
os.close(w_fd); os.waitpid(pid, 0)
print("DOUBLE APPLY" if a == b else "ok")
