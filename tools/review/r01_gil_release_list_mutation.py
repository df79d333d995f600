"""R01: store_ops releases the GIL (bounded wait for a set mutex held by another
process) while it holds borrowed pointers into the caller's keys list
(PySequence_Fast returns the list itself) and a key's bytes. Another Python
thread that mutates the list in that 20 ms window makes store_ops read a freed
list / freed bytes: expected a clean error or a consistent result; observed a
segfault (or a slot claimed with garbage key bytes)."""
import os, signal, sys, threading, time
sys.path.insert(0, os.path.dirname(__file__))
from common import Shared, keys_in_set

sh = Shared(n_slots=64, ways=4)
held_set = 0
pid = os.fork()
if pid == 0:  # the "stopped sharer": holds set 0's mutex
    t, _ = sh.handle()
    assert t._hold_set(held_set)
    time.sleep(30)
    os._exit(0)
time.sleep(0.3)
t, _ = sh.handle()
ks = keys_in_set(sh.n_sets, held_set, 1)
other = [k for k in keys_in_set(sh.n_sets, 1, 2000, prefix=b"o")]
for rep in range(50):
    # first key's set is held -> 20 ms GIL-released wait; later keys are fine
    keys = [ks[0]] + [bytes(x) for x in other[:400]]
    rows = list(range(1)) + [i % 64 for i in range(400)]
    def mutate():
        time.sleep(0.005)
        keys.clear()
    th = threading.Thread(target=mutate)
    th.start()
    try:
        r = t.store_ops(rep, keys, rows, 10**6, False)
    except Exception as e:
        print("exception", type(e).__name__, e)
    th.join()
    # undo claims so next iteration is similar
    _table = __import__("nvmetier._table")
os.kill(pid, signal.SIGKILL)
print("survived (no crash)")
