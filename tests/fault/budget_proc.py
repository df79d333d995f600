"""A store process for the root budget's fault tests (run as a script):
``python budget_proc.py ROOT MODEL BUDGET MODE [MIN_CAPACITY]``.

Opens model ``MODEL``'s store under ROOT with ``root_budget_bytes=BUDGET``
(``capacity_bytes`` 16 MiB, 64 KiB chunks), stores keys ``MODEL*1000 ..
+7`` and loads them back, checking every byte (``bad`` if one differs).

MODE:
- ``create``: then closes; prints ``ok <capacity bytes> <stores removed>``;
- ``hold``: prints the same, then waits for stdin to close before closing;
- ``kill-create``: SIGKILLs itself in the middle of the creation (right
  after the data file is preallocated, before the index and superblock);
- ``kill-remove``: SIGKILLs itself in the middle of a removal to make room
  (a store renamed aside, part of its files deleted).
Errors print ``err <ExceptionType> <message>``.
"""

from __future__ import annotations

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from faultkit import ROW, config, key, new_buffer, payload

from nvmetier import files, reclaim
from nvmetier.errors import NvmeTierError
from nvmetier.store import BlockStore


def main() -> int:
    root, model, limit, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    floor = int(sys.argv[5]) if len(sys.argv) > 5 else None
    if mode == "kill-create":
        real = files.StoreFiles._preallocate

        def prealloc(path: str, size: int, mapped: bool = False) -> None:
            real(path, size, mapped)
            os.kill(os.getpid(), signal.SIGKILL)

        files.StoreFiles._preallocate = staticmethod(prealloc)  # type: ignore[method-assign]
    if mode == "kill-remove":

        def rmtree(path: str, ignore_errors: bool = False) -> None:
            names = sorted(os.listdir(path))
            os.unlink(os.path.join(path, names[0]))  # one file gone, the rest left
            os.kill(os.getpid(), signal.SIGKILL)

        reclaim.shutil = type("S", (), {"rmtree": staticmethod(rmtree)})  # type: ignore[assignment]
    buf = new_buffer(16)
    over = {"root_budget_bytes": limit, "ways": 8}
    if floor is not None:
        over["min_capacity_bytes"] = floor
    try:
        store = BlockStore(
            config(root, **over),
            store_name=f"model-{model}",
            identity={"model_name": f"model-{model}", "chunk_bytes": ROW},
            buffer=buf,
            row_bytes=ROW,
        )
    except NvmeTierError as exc:
        print(f"err {type(exc).__name__} {exc}", flush=True)
        return 1
    keys = [key(model * 1000 + i) for i in range(8)]
    for r, k in enumerate(keys):
        buf[r * ROW : (r + 1) * ROW] = payload(k)
    store.submit_store(1, keys, list(range(8)))
    store.wait_idle(30)
    store.poll()
    buf[: 8 * ROW] = bytes(8 * ROW)
    store.submit_load(2, keys, list(range(8)))
    store.wait_idle(30)
    store.poll()
    for r, k in enumerate(keys):
        if buf[r * ROW : (r + 1) * ROW] != payload(k):
            print("bad", flush=True)
            return 2
    cap = store.sb.n_slots * store.sb.slot_bytes
    print(f"ok {cap} {store.stats()['stores_removed_for_budget']}", flush=True)
    if mode == "hold":
        sys.stdin.read()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
