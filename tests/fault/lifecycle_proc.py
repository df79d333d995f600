"""A store process for the open/close/remove tests, driven line by line:
``python lifecycle_proc.py`` reads commands on stdin and answers one line
each (``ok ...`` or ``err <ExceptionType> <message>``).

Commands:

- ``open ROOT PERSIST``: open the fault suite's store under ROOT (sharing
  ``node``; PERSIST ``0`` makes it ephemeral: the last closer removes it);
- ``store I N``: store keys ``I .. I+N-1``; answers how many are present;
- ``has I N``: how many of keys ``I .. I+N-1`` are hits;
- ``open_private ROOT``: reclaim the private stores of dead processes under
  ROOT, then open a private store (as a random-seed vLLM process does);
  answers ``ok <pid> <store name> <stores reclaimed>``;
- ``close``: close the store;
- ``slow_remove S``: from now on every directory removal first answers
  ``removing`` and sleeps S seconds (a closer descheduled while it removes);
- ``loop_open ROOT PERSIST N``: open and close the store N times; answers
  ``ok <StoreLockedError count> <closes that left the superblock not clean>``;
- ``exit``.

Also imports ``faultkit`` as a top-level module (run as a script).
"""

from __future__ import annotations

import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from faultkit import IDENTITY, ROW, ROWS, STORE_NAME, config, key, new_buffer, open_store, payload

from nvmetier import format as fmt
from nvmetier.errors import StoreLockedError
from nvmetier.files import SUPERBLOCK_NAME, private_store_name, reclaim_private_stores
from nvmetier.store import BlockStore

# A store name as vLLM's adapter makes them: <model>_<12 hex digits of digest>.
PRIVATE_BASE = "fault-model_0123456789ab"


def main() -> None:
    buf = new_buffer(ROWS)
    store = None
    root = ""
    persist = True
    job = 0
    for line in sys.stdin:
        cmd, *args = line.split()
        try:
            if cmd == "open":
                root, persist = args[0], args[1] == "1"
                store = open_store(root, buf, persist=persist)
                answer = "ok"
            elif cmd == "open_private":
                root, persist = args[0], False
                reclaimed = reclaim_private_stores([root])
                name = private_store_name(PRIVATE_BASE)
                store = BlockStore(
                    config(root, sharing="process", persist=False),
                    store_name=name,
                    identity=IDENTITY,
                    buffer=buf,
                    row_bytes=ROW,
                )
                answer = f"ok {os.getpid()} {name} {len(reclaimed)}"
            elif cmd == "store":
                assert store is not None
                first, n = int(args[0]), int(args[1])
                keys = [key(first + i) for i in range(n)]
                for i, k in enumerate(keys):
                    buf[i * len(payload(k)) : (i + 1) * len(payload(k))] = payload(k)
                job += 1
                store.submit_store(job, keys, list(range(n)))
                assert store.wait_idle(30.0)
                store.poll()
                answer = f"ok {sum(store.contains(k) for k in keys)}"
            elif cmd == "has":
                assert store is not None
                first, n = int(args[0]), int(args[1])
                answer = f"ok {sum(store.contains(key(first + i)) for i in range(n))}"
            elif cmd == "close":
                assert store is not None
                store.close()
                store = None
                answer = "ok"
            elif cmd == "slow_remove":
                _slow_remove(float(args[0]))
                answer = "ok"
            elif cmd == "loop_open":
                answer = "ok " + _loop_open(args[0], args[1] == "1", int(args[2]), buf)
            elif cmd == "exit":
                return
            else:
                answer = f"err ValueError unknown command {cmd}"
        except Exception as exc:  # the test reads the answer
            answer = f"err {type(exc).__name__} {exc}".replace("\n", " ")
        print(answer, flush=True)


def _slow_remove(delay_s: float) -> None:
    real = shutil.rmtree

    def rmtree(path, *a, **kw):  # type: ignore[no-untyped-def]
        print("removing", flush=True)
        time.sleep(delay_s)
        return real(path, *a, **kw)

    shutil.rmtree = rmtree  # type: ignore[assignment]


def _loop_open(root: str, persist: bool, n: int, buf: memoryview) -> str:
    locked = unclean = 0
    sb_path = os.path.join(root, STORE_NAME, SUPERBLOCK_NAME)
    for _ in range(n):
        try:
            store = open_store(root, buf, persist=persist)
        except StoreLockedError:
            locked += 1
            continue
        store.close()
        if not persist:
            continue  # removed by its last close
        with open(sb_path, "rb") as f:
            if not fmt.unpack_superblock(f.read()).clean:
                unclean += 1
    return f"{locked} {unclean}"


if __name__ == "__main__":
    main()
