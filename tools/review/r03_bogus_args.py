"""R03: bogus arguments, each case in its own subprocess (a crash is reported
with its signal). Prints one line per case: ok / exception / CRASH."""
import os, subprocess, sys, textwrap
HERE = os.path.dirname(os.path.abspath(__file__))
PRE = "import sys; sys.path.insert(0, %r)\nfrom common import *\nimport numpy as np, struct, mmap\nimport nvmetier._table as _table\nsh = Shared(); t, fd = sh.handle()\n" % HERE
CASES = {
 "rows int32 negative": "print(t.store_ops(1, [b'a'], np.array([-1], np.int32), 10, False)[1])",
 "rows uint64 huge": "print(t.store_ops(1, [b'a'], np.array([2**63+5], np.uint64), 10, False)[1])",
 "rows uint32 2^32-1": "print(t.store_ops(1, [b'a'], np.array([2**32-1], np.uint32), 10, False)[1])",
 "rows float64": "print(t.store_ops(1, [b'a'], np.array([1.5]), 10, False))",
 "rows bool": "print(t.store_ops(1, [b'a'], np.array([True]), 10, False))",
 "rows strided": "a=np.arange(20, dtype=np.int64)[::2][:2]; print(ops_ids(t.store_ops(1, [b'a', b'b'], a, 10, False)[0]))",
 "rows 2d": "a=np.arange(4, dtype=np.int64).reshape(2,2); print(t.store_ops(1, [b'a', b'b', b'c', b'd'], a, 10, False)[1])",
 "rows big-endian": "a=np.array([1], dtype='>i8'); print(t.store_ops(1, [b'a'], a, 10, False)[1])",
 "rows wrong count": "print(t.store_ops(1, [b'a', b'b'], np.array([1], np.int64), 10, False))",
 "rows huge python int": "print(t.store_ops(1, [b'a'], [2**70], 10, False))",
 "rows 0d array": "print(t.store_ops(1, [b'a'], np.int64(3), 10, False))",
 "key str": "print(t.store_ops(1, ['a'], [1], 10, False))",
 "key bytearray": "print(t.lookup(bytearray(b'a')))",
 "key empty": "o=t.store_ops(1, [b''], [1], 10, False); print(t.complete(comp(ops_ids(o[0])[0], 4096), False)); print(t.lookup(b''))",
 "key 89": "print(t.store_ops(1, [b'x'*89], [1], 10, False)[1])",
 "key 344 lookup": "print(t.lookup(b'x'*344), t.invalidate(b'x'*344), t.contains(b'y'*100000))",
 "keys generator": "print(t.store_ops(1, (k for k in [b'a']), [1], 10, False))",
 "keys dict": "print(t.store_ops(1, {b'a':1}, [1], 10, False))",
 "keys None": "print(t.store_ops(1, None, [1], 10, False))",
 "max_ops negative": "print(t.store_ops(1, [b'a'], [1], -5, False))",
 "complete forged ids": "print(t.complete(comp(2**64-1, 4096)+comp(5000, 4096)+comp(2**32, 4096)+comp(0,4096), False))",
 "complete short buffer": "print(t.complete(b'x'*23, False))",
 "complete misaligned": "o=t.store_ops(1, [b'a'], [1], 10, False); c=b'\\0'+comp(ops_ids(o[0])[0], 4096); print(t.complete(memoryview(c)[1:], False))",
 "complete op id 2^32 + live": "o=t.store_ops(1, [b'a'], [1], 10, False); i=ops_ids(o[0])[0]; print(t.complete(comp(i + 2**32, 4096), False), t.inflight())",
 "load float slots": "print(t.load(np.array([1.0, 3e300, -1.0]), False), t.usage())",
 "load int32 slots": "print(t.load(np.array([1,2,3,4], np.int32), False))",
 "load huge slots": "print(t.load(np.array([2**62, -2**62], np.int64), False))",
 "hold_set huge": "print(t._hold_set(2**64-1))",
 "hold_set negative": "print(t._hold_set(-1))",
 "hold_set twice same thread": "print(t._hold_set(0), t._hold_set(0))",
 "release not held": "print(t._release_set(3), t.lookup(b'zz'))",
 "clock offset -2^63": "_table._set_clock_offset_ns(-2**63); print(t.lookup(b'a'), t.store_ops(1,[b'q'],[1],10,False)[3])",
 "clock offset 2^63-1": "_table._set_clock_offset_ns(2**63-1); print(t.lookup(b'a'), t.store_ops(1,[b'q'],[1],10,False)[3])",
 "Table n_paths 0": "print(_table.Table(sh.table_map, sh.index_map, fd, n_paths=0, slot_bytes=4096, row_bytes=4096, n_rows=1, lease_ns=1, watch_timeout_ns=1))",
 "Table huge slot_bytes": "u,_=None,0; tt=_table.Table(sh.table_map, sh.index_map, fd, n_paths=1, slot_bytes=2**62, row_bytes=2**62, n_rows=2**62, lease_ns=1, watch_timeout_ns=2**64-1); o=tt.store_ops(1,[b'a', b'b'],[2**62-1, 5],10,False); print(np.frombuffer(o[0], dtype=np.int64).reshape(-1,8)[:, 1:5])",
 "Table index short": "print(_table.Table(sh.table_map, mmap.mmap(-1, 100), fd, n_paths=1, slot_bytes=4096, row_bytes=4096, n_rows=1, lease_ns=1, watch_timeout_ns=1))",
 "Table readonly buffer": "print(_table.Table(bytes(sh.table_map), sh.index_map, fd, n_paths=1, slot_bytes=4096, row_bytes=4096, n_rows=1, lease_ns=1, watch_timeout_ns=1))",
 "Table bad lock_fd": "tt=_table.Table(sh.table_map, sh.index_map, -1, n_paths=1, slot_bytes=4096, row_bytes=4096, n_rows=1, lease_ns=1, watch_timeout_ns=1); print(tt.attach())",
 "bind bogus then submit": "t.bind(1, 2, 10, False, False); print(t.submit_store(1, [b'a'], [1]))",
 "bind wait returns str": "t.bind(lambda b: None, lambda to: 'zz'*13, 10, False, False); print(t.submit_store(1, [b'a'], [1]), t.poll(), t.inflight())",
 "bind wait raises": "t.bind(lambda b: None, lambda to: 1/0, 10, False, False); print(t.submit_store(1, [b'a'], [1])); print(t.poll())",
 "submit refused": "t.bind(lambda b: 1/0, lambda to: b'', 10, False, False); print(t.submit_store(1, [b'a'], [1]), t.poll(), t.usage())",
 "submit after unbind": "t.bind(None, None, 0, False, False); print(t.submit_load(1, [b'a'], [1]))",
 "skip wrong type": "t.bind(lambda b: None, lambda to: b'', 10, False, False); print(t.submit_store(1, [b'a'], [1], 'x'))",
 "detach then store": "t.detach(); o=t.store_ops(1,[b'a'],[1],10,False); print(o[3], t.usage())",
 "never attached store": "tt,_=sh.handle(attach=False); o=tt.store_ops(1,[b'a'],[1],10,False); print(o[3])",
 "attach twice": "print(t.attach(), t.attach())",
 "sharers bogus fd": "print(_table.sharers(sh.table_map, 99999))",
 "header short": "print(_table.header(b'x'*10))",
 "format tiny": "print(_table.format(bytearray(100), 8, 2))",
 "format ways 0": "print(_table.format(bytearray(10**6), 8, 0))",
 "table_bytes huge": "print(_table.table_bytes(2**32-4096, 4096))",
}
for name, body in CASES.items():
    code = PRE + textwrap.dedent(body) + "\n"
    try:
        p = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True, timeout=20)
        if p.returncode < 0:
            res = "CRASH signal %d: %s" % (-p.returncode, p.stderr.strip().splitlines()[:1])
        elif p.returncode:
            res = "exc: " + (p.stderr.strip().splitlines() or ["?"])[-1][:150]
        else:
            res = "ok: " + p.stdout.strip().replace("\n", " | ")[:200]
    except subprocess.TimeoutExpired:
        res = "HANG (timeout 20 s)"
    print("%-28s %s" % (name, res), flush=True)
