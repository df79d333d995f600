"""The recorded workloads: a store's life (create, fill, evict, reopen,
clean close), its deaths (``kill -9`` mid-job), its neighbours (two
sharers, a live purge) and its variants (retention, sealed stores).

Owns: ``WORKLOADS`` (name -> ``Workload``) and ``record`` (run one in a child
process with the recorder on, so every process of the run records). Adding
a workload is one function of a ``Ctx`` and one line in ``WORKLOADS`` (or
only the line: an existing function under another configuration).
Called by tests and by ``python -m nvmetier.crashsim record``; blocks.

Every process of a run records into the same recording (``hook``), so a
workload's children are started with ``Ctx.spawn`` (same environment).
The oracle is noted before each store (``Ctx.put``): the key and the
SHA-256 of the bytes, and after each purge the keys it removed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

ROW = 16 << 10
ROWS = 16
STORE_NAME = "crash-store"
IDENTITY: dict[str, Any] = {"model_name": "crash/model", "chunk_bytes": ROW, "dtype": "fp16"}
CONFIG: dict[str, Any] = {
    "capacity_bytes": "640KiB",  # 36 slots of 16 KiB, 4 ways: evictions come soon
    "ways": 4,
    "io_engine": "threads",
    "io_threads": 2,
}


def key(i: int) -> bytes:
    return hashlib.blake2b(f"k{i}".encode(), digest_size=32).digest() + b"\0\0\0\0"


def payload(k: bytes, version: int = 0) -> bytes:
    return hashlib.shake_128(k + version.to_bytes(4, "little")).digest(ROW)


def roots_of(base: str, spec: dict[str, Any]) -> str | list[str]:
    """The ``root_dir`` of a run (or of a state) under ``base``."""
    roots = [os.path.join(base, r) for r in spec.get("roots", ["kv"])]
    return roots[0] if len(roots) == 1 else roots


class Ctx:
    """One process's view of a recorded run under ``base`` (stores in
    ``base/kv``)."""

    def __init__(self, base: str, spec: dict[str, Any]) -> None:
        from nvmetier.crashsim import hook

        self.base = base
        self.spec = spec
        self.rec = hook.recorder
        self.buf = mmap.mmap(-1, ROWS * ROW)
        self._job = 0

    def open(self, **overrides: Any) -> Any:
        from nvmetier.config import TierConfig
        from nvmetier.store import BlockStore

        cfg = {**self.spec["config"], "root_dir": roots_of(self.base, self.spec), **overrides}
        if self.spec.get("key_file"):
            cfg["encryption"] = {"key_file": self.spec["key_file"]}
        s = BlockStore(
            TierConfig.from_dict(cfg),
            store_name=STORE_NAME,
            identity=IDENTITY,
            buffer=memoryview(self.buf),
            row_bytes=ROW,
        )
        self.rec.checkpoint()
        return s

    def put(self, store: Any, keys: Sequence[bytes], version: int = 0) -> bool:
        """Store ``keys`` (one job), noting the oracle first; True when all landed."""
        for i, k in enumerate(keys):
            data = payload(k, version)
            self.buf[i * ROW : (i + 1) * ROW] = data
            self.rec.note("stored", key=k.hex(), digest=hashlib.sha256(data).hexdigest())
        self._job += 1
        store.submit_store(self._job, list(keys), list(range(len(keys))))
        done = self.wait(store)
        return all(o.success for o in done)

    def wait(self, store: Any) -> list[Any]:
        out: list[Any] = []
        deadline = time.monotonic() + 30
        while not out and time.monotonic() < deadline:
            store.wait_completions(0.01)
            out = store.poll()
            self.rec.checkpoint()
        return out

    def load(self, store: Any, keys: Sequence[bytes]) -> None:
        self._job += 1
        store.submit_load(self._job, list(keys), list(range(len(keys))))
        self.wait(store)

    def close(self, store: Any) -> None:
        store.close()
        self.rec.checkpoint()

    def purged(self, keys: Sequence[bytes]) -> None:
        self.rec.note("purged", keys=[k.hex() for k in keys])

    def spawn(self, step: str, *args: str) -> subprocess.Popen[bytes]:
        """Run ``STEPS[step]`` in a child process of the run (recording too)."""
        return subprocess.Popen(
            [sys.executable, "-m", "nvmetier.crashsim", "_step", self.base, step, *args],
            stdout=subprocess.PIPE,
        )


def _keys(first: int, n: int) -> list[bytes]:
    return [key(i) for i in range(first, first + n)]


# ------------------------------------------------------------------ workloads
def w_create(c: Ctx) -> None:
    c.close(c.open())


def w_fill(c: Ctx) -> None:
    s = c.open()
    for b in range(3):
        c.put(s, _keys(4 * b, 4))
    c.close(s)


def w_evict(c: Ctx) -> None:
    s = c.open()
    for b in range(6):  # 48 keys into 36 slots of 4-way sets
        c.put(s, _keys(8 * b, 8))
    c.load(s, _keys(0, 8))
    c.close(s)


def w_reopen(c: Ctx) -> None:
    s = c.open()
    c.put(s, _keys(0, 6))
    c.close(s)
    s = c.open()
    c.load(s, _keys(0, 6))
    c.put(s, _keys(6, 6))
    c.close(s)


def w_kill9(c: Ctx) -> None:
    """A writer killed mid-job, then the restart that recovers its store."""
    child = c.spawn("writer")
    assert child.stdout is not None
    for _ in range(3):
        child.stdout.readline()
    child.kill()
    child.wait()
    c.rec.checkpoint()
    s = c.open()
    c.put(s, _keys(100, 4))
    c.close(s)


def w_sharers(c: Ctx) -> None:
    s = c.open()
    c.put(s, _keys(0, 4))
    child = c.spawn("sharer")
    assert child.stdout is not None
    child.stdout.readline()  # attached
    c.put(s, _keys(4, 4))
    child.wait()
    c.put(s, _keys(8, 4))
    c.close(s)


def w_retention(c: Ctx) -> None:
    s = c.open(retention=1)
    c.put(s, _keys(0, 4))
    c.close(s)
    time.sleep(1.1)
    s = c.open(retention=1)
    c.load(s, _keys(0, 4))  # expired: misses, their slots reused
    c.put(s, _keys(0, 2), version=1)
    c.close(s)


def _purge_live(c: Ctx, mode: str) -> None:
    from nvmetier import purge

    s = c.open(enable_kv_events=True)
    old = _keys(0, 6)
    c.put(s, old)
    if mode == "older":
        time.sleep(0.6)
    new = _keys(6, 4)
    c.put(s, new)
    sdir = os.path.join(c.base, "kv", STORE_NAME)
    if mode == "all":
        purge.purge_store(sdir, older_than_s=None)
        c.purged(old + new)
    elif mode == "older":
        purge.purge_store(sdir, older_than_s=0.5)
        c.purged(old)
    else:
        purge.purge(
            os.path.join(c.base, "kv"), older_than_s=None, model=str(IDENTITY["model_name"])
        )
        c.purged(old + new)
    c.rec.checkpoint()
    s.take_events()
    c.put(s, _keys(20, 4))
    c.close(s)


def w_purge_all(c: Ctx) -> None:
    _purge_live(c, "all")


def w_purge_older(c: Ctx) -> None:
    _purge_live(c, "older")


def w_purge_model(c: Ctx) -> None:
    _purge_live(c, "model")


def w_fsck_repair(c: Ctx) -> None:
    """A writer killed mid-job, ``nvmetier fsck --repair``, then a restart."""
    from nvmetier import fsck

    child = c.spawn("writer")
    assert child.stdout is not None
    for _ in range(2):
        child.stdout.readline()
    child.kill()
    child.wait()
    c.rec.checkpoint()
    fsck.check_store(os.path.join(c.base, "kv", STORE_NAME), deep=True, repair=True)
    c.rec.checkpoint()
    s = c.open()
    c.load(s, _keys(0, 8))
    c.put(s, _keys(100, 4))
    c.close(s)


def w_purge_offline(c: Ctx) -> None:
    """A purge with no process attached (records zeroed directly), then a restart."""
    from nvmetier import purge

    s = c.open()
    c.put(s, _keys(0, 6))
    c.close(s)
    purge.purge_store(os.path.join(c.base, "kv", STORE_NAME), older_than_s=None)
    c.purged(_keys(0, 6))
    s = c.open()
    c.load(s, _keys(0, 6))
    c.put(s, _keys(6, 4))
    c.close(s)


def w_sealed_older(c: Ctx) -> None:
    """A sealed store's live ``purge --older-than``: the removed slots'
    nonces and tags overwritten, old epochs destroyed."""
    from nvmetier import purge

    s = c.open()
    c.put(s, _keys(0, 4))
    time.sleep(0.6)
    c.put(s, _keys(4, 4))
    purge.purge_store(os.path.join(c.base, "kv", STORE_NAME), older_than_s=0.5)
    c.purged(_keys(0, 4))
    c.put(s, _keys(8, 2))
    c.close(s)


def w_sealed_rotate(c: Ctx) -> None:
    """A sealed store that moves to new epoch keys while it runs (a 4 s
    retention: a 1 s sealing window), then restarts."""
    s = c.open(retention=4)
    for b in range(3):
        c.put(s, _keys(4 * b, 4))
        time.sleep(0.7)
    c.close(s)
    s = c.open(retention=4)
    c.load(s, _keys(0, 12))
    c.close(s)


def w_budget(c: Ctx) -> None:
    """Stores under a root budget (recorded with the root at the first
    open), one made smaller than asked, then reopened."""
    s = c.open()
    c.put(s, _keys(0, 6))
    c.close(s)
    s = c.open()
    c.load(s, _keys(0, 6))
    c.put(s, _keys(6, 4))
    c.close(s)


def w_sealed(c: Ctx) -> None:
    from nvmetier import purge

    s = c.open()
    c.put(s, _keys(0, 4))
    c.close(s)
    s = c.open()
    c.put(s, _keys(4, 4))
    purge.purge_store(os.path.join(c.base, "kv", STORE_NAME), older_than_s=None)
    c.purged(_keys(0, 8))
    c.put(s, _keys(8, 4))
    c.close(s)


# Steps run in children of a workload (Ctx.spawn).
def s_writer(c: Ctx) -> None:
    s = c.open()
    i = 0
    while True:
        c.put(s, _keys(8 * i, 8))
        print(i, flush=True)
        i += 1


def s_sharer(c: Ctx) -> None:
    s = c.open()
    print("attached", flush=True)
    c.put(s, _keys(50, 4))
    c.load(s, _keys(0, 4))
    c.close(s)


@dataclasses.dataclass(frozen=True)
class Workload:
    """A recorded workload: its function and how its store is configured."""

    fn: Callable[[Ctx], None]
    sealed: bool = False  # encryption on (a fresh key file per recording)
    roots: tuple[str, ...] = ("kv",)  # root_dir entries under the run's base
    config: tuple[tuple[str, Any], ...] = ()  # over CONFIG

    @property
    def needs_uring(self) -> bool:
        return dict(self.config).get("io_engine") == "uring"


_URING = (("io_engine", "uring"),)
WORKLOADS: dict[str, Workload] = {
    "create": Workload(w_create),
    "fill": Workload(w_fill),
    "fill_uring": Workload(w_fill, config=_URING),
    "evict": Workload(w_evict),
    "reopen": Workload(w_reopen),
    "two_drives": Workload(w_reopen, roots=("kv", "kv2")),
    "kill9": Workload(w_kill9),
    "kill9_uring": Workload(w_kill9, config=_URING),
    "fsck_repair": Workload(w_fsck_repair),
    "sharers": Workload(w_sharers),
    "retention": Workload(w_retention),
    "purge_all": Workload(w_purge_all),
    "purge_older": Workload(w_purge_older),
    "purge_model": Workload(w_purge_model),
    "purge_offline": Workload(w_purge_offline),
    "sealed": Workload(w_sealed, sealed=True),
    "sealed_older": Workload(w_sealed_older, sealed=True),
    "sealed_kill9": Workload(w_kill9, sealed=True),
    "sealed_sharers": Workload(w_sharers, sealed=True),
    "sealed_rotate": Workload(w_sealed_rotate, sealed=True),
    # A root budget of 1 MiB: the 640 KiB store fits; under one of 3 MiB a
    # store asked 4 MiB is made smaller (its "shrunk" note) and reopened.
    "budget": Workload(w_budget, config=(("root_budget_bytes", "1MiB"),)),
    "budget_shrunk": Workload(
        w_budget,
        config=(
            ("root_budget_bytes", "3MiB"),
            ("capacity_bytes", "4MiB"),
            ("min_capacity_bytes", "512KiB"),
        ),
    ),
}
STEPS: dict[str, Callable[[Ctx], None]] = {"writer": s_writer, "sharer": s_sharer}


def spec_of(base: str) -> dict[str, Any]:
    with open(os.path.join(base, "spec.json")) as f:
        spec: dict[str, Any] = json.load(f)
    return spec


def record(name: str, out_dir: str, plant: Sequence[str] = (), timeout_s: float = 120) -> str:
    """Record workload ``name`` into ``out_dir`` (made here): its run lives
    in ``out_dir/run``, the recording in ``out_dir/rec``. Returns ``rec``.

    Raises:
        KeyError: no such workload.
        RuntimeError: the workload failed (its stderr in the message).
    """
    w = WORKLOADS[name]
    base = os.path.join(out_dir, "run")
    rec = os.path.join(out_dir, "rec")
    for r in w.roots:
        os.makedirs(os.path.join(base, r))
    os.makedirs(rec)
    key_file = None
    if w.sealed:
        key_file = os.path.join(out_dir, "key")
        with open(key_file, "wb") as f:
            f.write(os.urandom(32))
        os.chmod(key_file, 0o600)
    spec = {
        "workload": name,
        "store_name": STORE_NAME,
        "identity": IDENTITY,
        "row_bytes": ROW,
        "config": {**CONFIG, **dict(w.config)},
        "roots": list(w.roots),
        "key_file": key_file,
        "plant": list(plant),
    }
    for where in (base, rec):
        with open(os.path.join(where, "spec.json"), "w") as f:
            json.dump(spec, f)
    from nvmetier.crashsim import hook

    env = {**os.environ, hook.RECORD_ENV: f"{rec}:{base}", hook.PLANT_ENV: ",".join(plant)}
    env.pop("NVMETIER_ENGINE", None)
    # The children import this very checkout, wherever they are started from.
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "nvmetier.crashsim", "_run", base, name],
        env=env,
        capture_output=True,
        timeout=timeout_s,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"workload {name} failed: {proc.stderr.decode()[-3000:]}")
    return rec


def run_in_child(base: str, name: str, step: bool) -> None:
    """The child side of ``record``/``Ctx.spawn``."""
    c = Ctx(base, spec_of(base))
    if c.rec is None:
        raise RuntimeError("run without a recorder: use record()")
    (STEPS[name] if step else WORKLOADS[name].fn)(c)
    c.rec.checkpoint()
