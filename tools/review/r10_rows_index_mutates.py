"""R10: rows given as a list: rows_arg reads it with PySequence_Fast (the list
itself) and calls PyLong_AsLongLong on each item, which runs the item's
__index__ (any Python code). An __index__ that empties the list makes the next
PySequence_Fast_GET_ITEM read past the list's storage: a segfault. Same for
touch(keys) across a GIL-released set wait. Expected: TypeError/ValueError, or
a result computed on a snapshot."""
import os, sys
sys.path.insert(0, os.path.dirname(__file__))
from common import Shared

sh = Shared()
t, _ = sh.handle()
rows = []
class Evil:
    def __index__(self):
        rows.clear()
        return 1
rows.extend([Evil()] + [2] * 1000)
keys = [b"k%d" % i for i in range(1001)]
print("failed:", len(t.store_ops(1, keys, rows, 10, False)[1] or []))
print("no crash")
