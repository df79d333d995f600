"""Sharer processes for the multi-process tests: each one is a vLLM engine
(``SimulatedEngine``: vLLM's real tiering orchestrator, a CPU primary tier and
our NVMe tier) driven over a pipe by the test.

Owns: the child side (``serve``: a loop answering one command at a time on
its own main thread) and the parent side (``Sharer``: start, call, kill).

Processes come from a ``forkserver`` that imports this module (and so vLLM)
once: importing vLLM costs about 8 s of CPU, forking a preloaded server a few
milliseconds, so each test and each SIGKILL trial gets fresh processes.

Keys travel as integers ``i`` (``key_of(i)`` on both sides); every chunk
loaded is compared with ``payload_of(key, chunk_bytes)``, the bytes the
storing process wrote, so a wrong byte from any sharer is caught where it is
read.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import random
import signal
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from nvmetier.vllm.harness import SimulatedEngine, key_of, make_config, payload_of

CHUNK_BYTES = 16 << 10
CPU_CHUNKS = 64
BATCH = 16
OP_TIMEOUT_S = 30.0


# ---------------------------------------------------------------- child side
class _Warnings(logging.Handler):
    """Keeps every WARNING-or-worse record of nvmetier's loggers."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("nvmetier"):
            self.records.append((record.name, record.getMessage()))


class _Child:
    """Command handlers of one sharer process (its main thread only)."""

    def __init__(self) -> None:
        self.eng: SimulatedEngine | None = None
        self.warnings = _Warnings()
        logging.getLogger().addHandler(self.warnings)

    # ------------------------------------------------------------ setup
    def init_seed(self, algo: str, pythonhashseed: str | None) -> str:
        """What vLLM's engine core does (``EngineCore.__init__``, after the
        scheduler and so the tiers are built): ``init_none_hash`` with the
        prefix-caching hash function. ``pythonhashseed=None`` unsets
        ``PYTHONHASHSEED``, so xxhash/xxhash_cbor get a random seed."""
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_none_hash_seed, init_none_hash

        if pythonhashseed is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = pythonhashseed
        init_none_hash(get_hash_fn_by_name(algo))
        return get_none_hash_seed()

    def open(self, tier: dict[str, Any], **config_kw: Any) -> None:
        config_kw.setdefault("chunk_bytes", CHUNK_BYTES)
        config_kw.setdefault("cpu_chunks", CPU_CHUNKS)
        self.eng = SimulatedEngine(make_config([tier], **config_kw))

    def close(self) -> None:
        eng, self.eng = self.eng, None
        if eng is not None:
            eng.shutdown()

    # ------------------------------------------------------------ work
    @property
    def _eng(self) -> SimulatedEngine:
        assert self.eng is not None, "open first"
        return self.eng

    def stats(self) -> dict[str, int]:
        return dict(self._eng.tiers[0].store.stats())

    def logged_warnings(self) -> list[tuple[str, str]]:
        return list(self.warnings.records)

    def store(
        self, keys: Sequence[int], batch: int = BATCH, start_at: float | None = None
    ) -> dict[str, Any]:
        """Store ``keys`` through the orchestrator and wait for every store job.

        Returns ``present``: the keys the tier holds once its store jobs
        finished, and ``max_op_s``: the slowest batch.
        """
        _sleep_until(start_at)
        eng = self._eng
        max_op_s = 0.0
        present: list[int] = []
        for part in _chunks(list(keys), batch):
            t0 = time.monotonic()
            eng.store_all([key_of(i) for i in part], batch=batch)
            max_op_s = max(max_op_s, time.monotonic() - t0)
            present.extend(self._present(part))
        return {"present": present, "max_op_s": max_op_s}

    def _present(self, keys: Sequence[int]) -> list[int]:
        contains = self._eng.tiers[0].store.contains
        return [i for i in keys if contains(key_of(i))]

    def promote(
        self, keys: Sequence[int], batch: int = BATCH, start_at: float | None = None
    ) -> dict[str, Any]:
        """Promote ``keys`` from the tier (the primary is emptied first) and
        compare every HIT with the bytes its writer stored.

        Returns ``hit``, ``miss``, ``wrong`` (HITs with wrong bytes) and
        ``max_op_s`` (the slowest lookup-to-loaded batch).
        """
        _sleep_until(start_at)
        out: dict[str, Any] = {"hit": [], "miss": [], "wrong": [], "max_op_s": 0.0}
        self._eng.reset_primary()
        for part in _chunks(list(keys), batch):
            t0 = time.monotonic()
            hit, miss, wrong = self._promote_batch(part)
            out["max_op_s"] = max(out["max_op_s"], time.monotonic() - t0)
            out["hit"] += hit
            out["miss"] += miss
            out["wrong"] += wrong
        return out

    def _promote_batch(self, part: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
        from vllm.v1.kv_offload.base import LookupResult

        eng = self._eng
        results = eng.promote([key_of(i) for i in part], timeout_s=OP_TIMEOUT_S)
        hit = [i for i in part if results[key_of(i)] is LookupResult.HIT]
        miss = [i for i in part if results[key_of(i)] is not LookupResult.HIT]
        wrong: list[int] = []
        if hit:
            rows = eng.read_primary([key_of(i) for i in hit])
            wrong = [
                i
                for i, row in zip(hit, rows, strict=True)
                if not np.array_equal(row, payload_of(key_of(i), eng.chunk_bytes))
            ]
        eng.reset_primary()
        return hit, miss, wrong

    def mixed(
        self,
        store_keys: Sequence[int],
        load_keys: Sequence[int],
        batch: int = 8,
        seed: int = 0,
        start_at: float | None = None,
    ) -> dict[str, Any]:
        """Alternate: store a batch of ``store_keys``, promote a random batch
        of ``load_keys`` (keys of every writer, stored or not yet)."""
        _sleep_until(start_at)
        rng = random.Random(seed)
        out: dict[str, Any] = {"hit": 0, "miss": 0, "wrong": [], "max_op_s": 0.0}
        self._eng.reset_primary()
        for part in _chunks(list(store_keys), batch):
            t0 = time.monotonic()
            self._eng.store_all([key_of(i) for i in part], batch=batch)
            hit, miss, wrong = self._promote_batch(rng.sample(list(load_keys), batch))
            out["max_op_s"] = max(out["max_op_s"], time.monotonic() - t0)
            out["hit"] += len(hit)
            out["miss"] += len(miss)
            out["wrong"] += wrong
        return out

    def churn(
        self,
        duration_s: float,
        store_keys: Sequence[int],
        load_keys: Sequence[int],
        journal: str | None = None,
        batch: int = 4,
    ) -> dict[str, Any]:
        """For ``duration_s``: store the next batch of ``store_keys`` (until
        they run out), then promote a random batch of ``load_keys`` and of the
        keys another process journaled in ``journal`` so far.

        Returns ``stored`` (keys present once their jobs finished), ``wrong``,
        ``journaled_missed`` (journaled keys that were a MISS), ``ops`` and
        ``max_op_s``.
        """
        rng = random.Random(int(duration_s * 1e6))
        todo = list(store_keys)
        out: dict[str, Any] = {
            "stored": [],
            "wrong": [],
            "journaled_missed": [],
            "ops": 0,
            "max_op_s": 0.0,
        }
        deadline = time.monotonic() + duration_s
        self._eng.reset_primary()
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            if todo:
                part, todo = todo[:batch], todo[batch:]
                self._eng.store_all([key_of(i) for i in part], batch=batch)
                out["stored"] += self._present(part)
            journaled = read_journal(journal).stored if journal else []
            pool = list(load_keys) + out["stored"]
            picks = rng.sample(pool, min(batch, len(pool))) if pool else []
            recent = [i for i in journaled[-batch:] if i not in picks]
            _hit, miss, wrong = self._promote_batch(picks + recent)
            out["wrong"] += wrong
            out["journaled_missed"] += [
                i for i in recent if i in miss and i not in out["journaled_missed"]
            ]
            out["max_op_s"] = max(out["max_op_s"], time.monotonic() - t0)
            out["ops"] += 1
        return out

    def _set_of(self, i: int) -> int:
        import xxhash

        sb = self._eng.tiers[0].store.sb
        return int(xxhash.xxh3_64_intdigest(key_of(i), 0) % (sb.n_slots // sb.ways))

    def same_set_keys(self, i: int, n: int, start: int) -> list[int]:
        """``n`` keys from ``start`` on that land in ``i``'s set of the table."""
        target, out, j = self._set_of(i), [], start
        while len(out) < n:
            if self._set_of(j) == target:
                out.append(j)
            j += 1
        return out

    def hold_set_then_stop(self, i: int) -> None:
        """A sharer stopped inside a critical section: take the mutex of
        ``i``'s set (the table's test-only hook), SIGSTOP this process, and
        once continued (SIGCONT) release the mutex."""
        table = self._eng.tiers[0].store._table
        set_idx = self._set_of(i)
        assert table._hold_set(set_idx)
        os.kill(os.getpid(), signal.SIGSTOP)
        table._release_set(set_idx)

    def victim(
        self,
        journal: str,
        store_keys: Sequence[int],
        load_keys: Sequence[int],
        batch: int = 2,
    ) -> None:
        """Until killed: store ``batch`` keys, journal them, promote a batch;
        once ``store_keys`` run out, only promote.

        Journal lines (appended with one ``write`` each, so a SIGKILL never
        loses a line it finished): ``B i j`` before keys ``i..j-1`` are
        stored; ``S i`` once ``i``'s store job finished and the tier holds
        it; ``W i`` when this process loaded wrong bytes for ``i``.
        """
        rng = random.Random(len(store_keys))
        fd = os.open(journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        todo = list(store_keys)
        stored: list[int] = []
        self._eng.reset_primary()
        while True:
            if todo:
                part, todo = todo[:batch], todo[batch:]
                os.write(fd, f"B {part[0]} {part[-1] + 1}\n".encode())
                self._eng.store_all([key_of(i) for i in part], batch=batch)
                done = self._present(part)
                stored += done
                os.write(fd, "".join(f"S {i}\n" for i in done).encode())
            pool = list(load_keys) + stored
            _hit, _miss, wrong = self._promote_batch(rng.sample(pool, min(4, len(pool))))
            if wrong:
                os.write(fd, "".join(f"W {i}\n" for i in wrong).encode())


def serve(conn: Connection) -> None:
    """The sharer's main loop: ``(command, kwargs)`` in, one reply out.

    Replies are ``("ok", value)`` or ``("error", type, message, traceback)``;
    ``("exit", {})`` shuts the engine down and ends the process.
    """
    child = _Child()
    while True:
        try:
            cmd, kw = conn.recv()
        except EOFError:
            break
        if cmd == "exit":
            child.close()
            conn.send(("ok", None))
            break
        try:
            conn.send(("ok", getattr(child, cmd)(**kw)))
        except BaseException as exc:
            kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
            conn.send(("error", kind, str(exc), traceback.format_exc()))


def _sleep_until(start_at: float | None) -> None:
    """A barrier: ``time.monotonic`` is one clock for every process on Linux."""
    if start_at is not None:
        time.sleep(max(0.0, start_at - time.monotonic()))


def _chunks(items: list[int], n: int) -> Iterator[list[int]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


# ---------------------------------------------------------------- journal
class Journal:
    """What a victim's journal says (a torn last line is ignored)."""

    def __init__(self) -> None:
        self.submitted: list[int] = []
        self.stored: list[int] = []
        self.wrong: list[int] = []


def read_journal(path: str | None) -> Journal:
    out = Journal()
    if path is None or not os.path.exists(path):
        return out
    with open(path, "rb") as f:
        text = f.read().decode()
    for line in text.split("\n")[:-1]:
        tag, *values = line.split()
        if tag == "B":
            out.submitted.extend(range(int(values[0]), int(values[1])))
        elif tag == "S":
            out.stored.append(int(values[0]))
        elif tag == "W":
            out.wrong.append(int(values[0]))
    return out


# ---------------------------------------------------------------- parent side
class RemoteError(AssertionError):
    """A command raised in a sharer; ``kind`` is the exception's full name."""

    def __init__(self, name: str, kind: str, message: str, tb: str) -> None:
        super().__init__(f"sharer {name}: {kind}: {message}\n--- sharer traceback ---\n{tb}")
        self.kind = kind
        self.message = message


class StallError(AssertionError):
    """A sharer did not answer in time (stalled, or died)."""


def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    # Has effect until the server starts (once per test session).
    ctx.set_forkserver_preload([__name__])
    return ctx


class Sharer:
    """A sharer process, seen from the test."""

    def __init__(self, name: str) -> None:
        ctx = _context()
        self.name = name
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child_conn,), name=name, daemon=True)
        self.proc.start()
        child_conn.close()
        # vLLM's CPU primary of each engine this sharer opens: a killed sharer
        # cannot remove it, so the test does (a SIGKILLed vLLM leaves it too).
        self.shm_paths: list[str] = []

    def send(self, cmd: str, **kw: Any) -> None:
        if cmd == "open":
            engine_id = kw.setdefault("engine_id", f"nvmetier-test-{uuid.uuid4().hex[:12]}")
            self.shm_paths.append(f"/dev/shm/vllm_offload_{engine_id}.mmap")
        self.conn.send((cmd, kw))

    def _remove_shm(self) -> None:
        """Remove the primaries of a process that is gone."""
        if self.proc.is_alive():
            return
        for path in self.shm_paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.shm_paths = []

    def recv(self, timeout_s: float = OP_TIMEOUT_S) -> Any:
        if not self.conn.poll(timeout_s):
            alive = "alive" if self.proc.is_alive() else f"exit code {self.proc.exitcode}"
            raise StallError(f"sharer {self.name} did not answer within {timeout_s}s ({alive})")
        try:
            reply = self.conn.recv()
        except EOFError:
            raise StallError(f"sharer {self.name} died (exit code {self.proc.exitcode})") from None
        if reply[0] == "error":
            raise RemoteError(self.name, *reply[1:])
        return reply[1]

    def call(self, cmd: str, timeout_s: float = OP_TIMEOUT_S, **kw: Any) -> Any:
        self.send(cmd, **kw)
        return self.recv(timeout_s)

    def stop(self) -> None:
        """SIGSTOP, and wait until the process is stopped (it keeps every
        lock it holds: stopped is not dead)."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        wait_stopped(self.proc.pid)

    def resume(self) -> None:
        """SIGCONT."""
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL (no cleanup of any kind runs in the sharer)."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)
        self._remove_shm()

    def exit(self, timeout_s: float = OP_TIMEOUT_S) -> None:
        """Shut the engine down cleanly and end the process."""
        if self.proc.is_alive():
            self.call("exit", timeout_s=timeout_s)
        self.proc.join(timeout_s)

    def close(self) -> None:
        """End the process whatever state it is in (test teardown)."""
        try:
            if self.proc.is_alive():
                self.exit(timeout_s=10)
        except (AssertionError, OSError):
            pass
        self.kill()
        self.conn.close()


def wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Until ``pid`` is in the stopped state (``T`` in /proc/pid/stat)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.001)
    raise StallError(f"process {pid} did not stop within {timeout_s}s")


def call_all(
    sharers: Sequence[Sharer], cmd: str, timeout_s: float = OP_TIMEOUT_S, **kw: Any
) -> list[Any]:
    """Send ``cmd`` to every sharer, then collect every reply (in order)."""
    for s in sharers:
        s.send(cmd, **kw)
    return [s.recv(timeout_s) for s in sharers]


def call_each(
    sharers: Sequence[Sharer],
    cmd: str,
    kwargs: Callable[[int], dict[str, Any]],
    timeout_s: float = OP_TIMEOUT_S,
) -> list[Any]:
    """Like ``call_all``, with per-sharer arguments ``kwargs(i)``."""
    for i, s in enumerate(sharers):
        s.send(cmd, **kwargs(i))
    return [s.recv(timeout_s) for s in sharers]


def disk_bytes(root: str) -> int:
    """Bytes allocated on disk under ``root`` (``du``: blocks, not sizes)."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def files_under(root: str) -> list[str]:
    """Every file under ``root``, relative to it (sorted)."""
    out = []
    for dirpath, _dirs, files in os.walk(root):
        out.extend(os.path.relpath(os.path.join(dirpath, f), root) for f in files)
    return sorted(out)
