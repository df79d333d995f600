"""R05: reference/memory leaks across the submit/poll path, store_ops/load_ops/
complete, errors (bad keys, refused engine), events. Reports refcount deltas
of the key/list objects and RSS growth over N rounds."""
import os, resource, struct, sys
sys.path.insert(0, os.path.dirname(__file__))
from common import Shared, ops_ids, comp
import numpy as np

sh = Shared(n_slots=256, ways=8)
t, _ = sh.handle()
pending = []
def submit_raw(b):
    for i in range(len(b) // 56):
        op_id, = struct.unpack_from("<Q", b, i * 56)
        pending.append(comp(op_id, sh.row_bytes, 99))
def wait_raw(to):
    out = b"".join(pending); pending.clear(); return out
t.bind(submit_raw, wait_raw, 1000, True, True)
key = b"refkey-0"
keys = [key, b"refkey-1", b"x" * 100]
rows = np.array([1, 2, 3], np.int64)
def rnd(i):
    t.submit_store(i, keys, rows)
    t.poll(); t.take_events()
    t.submit_load(i, keys, rows)
    t.poll()
    t.lookup(key); t.release_leases(); t.invalidate(b"refkey-1"); t.take_events()
    o = t.store_ops(i, keys, rows, 10, True); t.complete(b"".join(comp(x, -5) for x in ops_ids(o[0])), True)
    o = t.load_ops(i, keys, rows, True); t.complete(b"".join(comp(x, sh.row_bytes, 1) for x in ops_ids(o[0])), True)
    try: t.store_ops(i, [key, 5, key], rows, 10, True)
    except TypeError: pass
    t.counters(); t.usage(); t.inflight()
for i in range(2000): rnd(i)
r0 = (sys.getrefcount(key), sys.getrefcount(keys), sys.getrefcount(rows), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
for i in range(20000): rnd(i)
r1 = (sys.getrefcount(key), sys.getrefcount(keys), sys.getrefcount(rows), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
print("refcounts key/list/rows and maxrss KiB before", r0, "after", r1, "inflight", t.inflight())
