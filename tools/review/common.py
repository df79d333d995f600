"""Helpers for the review reproducers: one table + index mapping (anonymous,
MAP_SHARED, so forked children share it) and handles with their own lock fd."""
import mmap, os, struct, tempfile
import nvmetier._table as _table

REC = 128
OP = _table.OP_BYTES
COMP = _table.COMPLETION_BYTES


class Shared:
    def __init__(self, n_slots=64, ways=4, rows=64, row_bytes=4096):
        self.n_slots, self.ways, self.rows, self.row_bytes = n_slots, ways, rows, row_bytes
        self.table_map = mmap.mmap(-1, _table.table_bytes(n_slots, ways))
        self.index_map = mmap.mmap(-1, n_slots * REC)
        _table.format(self.table_map, n_slots, ways)
        fd, self.lock_path = tempfile.mkstemp(prefix="nvt-review-", suffix=".lock")
        os.close(fd)

    def handle(self, attach=True, fd=None, lease_ms=1000, watch_ms=2000):
        if fd is None:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CLOEXEC)
        t = _table.Table(self.table_map, self.index_map, fd, n_paths=1, slot_bytes=self.row_bytes,
                         row_bytes=self.row_bytes, n_rows=self.rows, lease_ns=lease_ms * 1_000_000,
                         watch_timeout_ns=watch_ms * 1_000_000)
        if attach:
            t.attach()
        return t, fd

    @property
    def n_sets(self):
        return self.n_slots // self.ways


def ops_ids(ops):
    return [struct.unpack_from("<Q", ops, i * OP)[0] for i in range(len(ops) // OP)]


def comp(op_id, result, checksum=0):
    return struct.pack("<QqQ", op_id, result, checksum)


def keys_in_set(n_sets, set_no, count, prefix=b"k"):
    import xxhash
    out, i = [], 0
    while len(out) < count:
        k = prefix + b"-%d" % i
        if xxhash.xxh3_64_intdigest(k) % n_sets == set_no:
            out.append(k)
        i += 1
    return out
