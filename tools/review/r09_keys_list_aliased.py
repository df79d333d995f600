"""R09: submit_store keeps the caller's keys *list itself* (PySequence_Fast
returns a list unchanged) until poll() builds successful_keys from it. A
caller that reuses or edits its list after submit gets successful_keys naming
keys that were never stored (and loses the ones that were). Expected: the job
snapshots its keys at submit (PySequence_Tuple)."""
import os, struct, sys
sys.path.insert(0, os.path.dirname(__file__))
from common import Shared, comp

sh = Shared()
t, _ = sh.handle()
pending = []
def submit_raw(b):
    for i in range(len(b) // 56):
        pending.append(comp(struct.unpack_from("<Q", b, i * 56)[0], sh.row_bytes, 9))
def wait_raw(to):
    out = b"".join(pending); pending.clear(); return out
t.bind(submit_raw, wait_raw, 100, False, False)
keys = [b"stored-1", b"k" * 100]                 # the second key fails (too long)
t.submit_store(1, keys, [1, 2])
keys[:] = [b"never-stored", b"also-never"]          # the caller reuses its list
job = t.poll()[0]
print("success=%s successful_keys=%s" % (job[1], job[2]))
print("contains(never-stored) =", t.contains(b"never-stored"))
