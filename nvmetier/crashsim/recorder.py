"""The recorder: every change a run makes to the files under one root, in
one global order, from every process of the run.

Owns: a recording directory (``log``, one JSON line per operation, appended
with ``O_APPEND`` under an ``flock``, so the line order is the global order
across processes; ``blobs/``, the bytes of each write, named by their
SHA-256; ``snap/``, the last recorded image of each diffed file).

What is recorded, and how:

- The mapped index and the data files change without a system call of ours
  (the native table writes records into a shared mapping; the io_uring
  engine writes data from its own thread). They are *diffed*: before every
  operation appended, each ``index`` and then each ``data`` file under the
  root is compared page by page (4 KiB) with its last image and every
  changed run of pages is appended as a ``write``; the writes of one diff
  are one instant (no crash point between them: their order within it is
  not known). The thread engine calls ``checkpoint``
  before and after each data write, so a record written before its data
  write completed is recorded before that write.
- Small files (``superblock.tmp``, the purge log, ``keys``) are recorded at
  their writes (``write``, ``write_fd``), as are ``create``, ``truncate``
  (and ``fallocate``), ``rename``, ``link``, ``unlink``, ``fsync`` (and
  ``msync``, the same for a file) and ``fsync_dir``.
- ``note`` adds what the workload knows (the oracle: the bytes stored under
  each key, the keys a purge removed) at its place in the order.

Called by any thread of any process of a recorded run (``hook.recorder``);
blocks for the diff and one append (a small store: a few hundred KiB read).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import threading
from typing import Any

import numpy as np

PAGE = 4096
DIFFED_NAMES = ("index", "data")
LOG_NAME = "log"


def blob_name(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Recorder:
    """Appends operations on files under ``root`` to the recording in ``dir``.

    Paths outside ``root`` are ignored (a store's tests write elsewhere too).
    """

    def __init__(self, rec_dir: str, root: str) -> None:
        self.dir = os.path.abspath(rec_dir)
        self.root = os.path.realpath(root)
        for sub in ("blobs", "snap"):
            os.makedirs(os.path.join(self.dir, sub), exist_ok=True)
        self._fd = os.open(
            os.path.join(self.dir, LOG_NAME),
            os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
            0o600,
        )
        self._lock = threading.Lock()
        self._pid = os.getpid()

    @classmethod
    def from_env(cls, value: str) -> Recorder:
        """``DIR:ROOT`` (``hook.RECORD_ENV``)."""
        rec_dir, sep, root = value.partition(":")
        if not sep or not rec_dir or not root:
            raise RuntimeError(f"NVMETIER_CRASHSIM_RECORD={value!r}: want DIR:ROOT")
        return cls(rec_dir, root)

    # ------------------------------------------------------------ paths
    def rel(self, path: str) -> str | None:
        """``path`` relative to the root, or None when outside it."""
        full = os.path.realpath(path)
        if full == self.root:
            return "."
        if not full.startswith(self.root + os.sep):
            return None
        return os.path.relpath(full, self.root)

    def rel_fd(self, fd: int) -> str | None:
        try:
            return self.rel(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            return None

    # ------------------------------------------------------------ core
    def _blob(self, data: bytes) -> str:
        name = blob_name(data)
        path = os.path.join(self.dir, "blobs", name)
        if not os.path.exists(path):
            tmp = f"{path}.{os.getpid()}.{threading.get_ident()}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        return name

    def _diffed_files(self) -> list[str]:
        """Every diffed file, the indexes first: a record is written only
        after its data write completed, so data read after the index holds
        the bytes of every record that index image shows (an image of the
        pair that a running store really passed through)."""
        out: list[str] = []
        for top, _dirs, names in os.walk(self.root):
            out.extend(os.path.join(top, n) for n in names if n in DIFFED_NAMES)
        return sorted(out, key=lambda p: (DIFFED_NAMES.index(os.path.basename(p)), p))

    def _diff_locked(self, images: list[tuple[str, bytes]]) -> list[dict[str, Any]]:
        """``write`` entries for every page of a diffed file that changed
        since its last image; the new images go to ``images`` (``(snap
        path, bytes)``), saved once the entries are in the log: a process
        killed in between leaves them for the next diff to record again."""
        out: list[dict[str, Any]] = []
        for path in self._diffed_files():
            rel = os.path.relpath(path, self.root)
            snap = os.path.join(self.dir, "snap", rel.replace(os.sep, "%"))
            try:
                with open(path, "rb") as f:
                    now = f.read()
            except OSError:
                continue
            try:
                with open(snap, "rb") as f:
                    old = f.read()
            except FileNotFoundError:
                old = b""
            if now == old:
                continue
            n = -(-max(len(now), len(old)) // PAGE) * PAGE
            a = np.zeros(n, np.uint8)
            b = np.zeros(n, np.uint8)
            a[: len(now)] = np.frombuffer(now, np.uint8)
            b[: len(old)] = np.frombuffer(old, np.uint8)
            changed = (a.reshape(-1, PAGE) != b.reshape(-1, PAGE)).any(axis=1)
            pages = np.flatnonzero(changed).tolist()
            runs: list[list[int]] = []
            for p in pages:
                if runs and runs[-1][1] == p:
                    runs[-1][1] = p + 1
                else:
                    runs.append([p, p + 1])
            for first, end in runs:
                lo, hi = first * PAGE, min(end * PAGE, len(now))
                if hi > lo:
                    blob = self._blob(now[lo:hi])
                    out.append({"op": "write", "path": rel, "off": lo, "blob": blob, "diff": 1})
            images.append((snap, now))
        return out

    def _append(self, entry: dict[str, Any] | None) -> None:
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                images: list[tuple[str, bytes]] = []
                entries = self._diff_locked(images)
                # One diff is one instant: no crash point falls inside it
                # (``more`` marks the entries a later one of it follows).
                for e in entries[:-1]:
                    e["more"] = 1
                if entry is not None:
                    entries.append(entry)
                pid = os.getpid()
                lines = "".join(json.dumps({**e, "pid": pid}) + "\n" for e in entries)
                data = lines.encode()
                while data:
                    data = data[os.write(self._fd, data) :]
                for snap, now in images:
                    tmp = f"{snap}.tmp"
                    with open(tmp, "wb") as f:
                        f.write(now)
                    os.replace(tmp, snap)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    # ------------------------------------------------------------ operations
    def checkpoint(self) -> None:
        """Record what the diffed files changed since the last operation."""
        self._append(None)

    def write(self, path: str, offset: int, data: bytes) -> None:
        rel = self.rel(path)
        if rel is not None:
            self._append({"op": "write", "path": rel, "off": offset, "blob": self._blob(data)})

    def write_fd(self, fd: int, offset: int, data: bytes) -> None:
        rel = self.rel_fd(fd)
        if rel is not None:
            self._append({"op": "write", "path": rel, "off": offset, "blob": self._blob(data)})

    def create(self, path: str) -> None:
        """A file created, or truncated to 0 when it existed (``O_TRUNC``)."""
        rel = self.rel(path)
        if rel is not None:
            self._append({"op": "create", "path": rel})

    def truncate(self, path: str, size: int) -> None:
        """``ftruncate`` or ``fallocate`` to ``size`` bytes."""
        rel = self.rel(path)
        if rel is not None:
            self._append({"op": "truncate", "path": rel, "size": size})

    def fsync(self, path: str) -> None:
        """``fsync``/``fdatasync`` of a file, or ``msync`` of its mapping."""
        rel = self.rel(path)
        if rel is not None:
            self._append({"op": "fsync", "path": rel})

    def fsync_fd(self, fd: int) -> None:
        rel = self.rel_fd(fd)
        if rel is not None:
            self._append({"op": "fsync", "path": rel})

    def fsync_dir(self, path: str) -> None:
        rel = self.rel(path)
        if rel is not None:
            self._append({"op": "fsync_dir", "path": rel})

    def rename(self, src: str, dst: str) -> None:
        a, b = self.rel(src), self.rel(dst)
        if a is not None and b is not None:
            self._append({"op": "rename", "path": a, "dst": b})

    def link(self, src: str, dst: str) -> None:
        a, b = self.rel(src), self.rel(dst)
        if a is not None and b is not None:
            self._append({"op": "link", "path": a, "dst": b})

    def unlink(self, path: str) -> None:
        rel = self.rel(path)
        if rel is not None:
            self._append({"op": "unlink", "path": rel})

    def note(self, kind: str, **info: Any) -> None:
        """What the workload knows, at its place in the order (``stored``:
        ``key`` hex and ``digest`` of the bytes; ``purged``: ``keys`` hex)."""
        self._append({"op": "note", "kind": kind, **info})

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


def read_log(rec_dir: str) -> list[dict[str, Any]]:
    """The operations of a recording, in order.

    A process killed inside its append (``kill -9`` of a recorded writer: a
    long write is cut at a page) leaves a line without its end; the next
    append starts right after it. The torn entry is dropped (its diffed
    pages were not marked recorded, so a later diff records them again) and
    the entry that follows it on the same line is kept."""
    with open(os.path.join(rec_dir, LOG_NAME), "rb") as f:
        text = f.read().decode(errors="replace")
    out = []
    for line in text.splitlines():
        while line:
            try:
                out.append(json.loads(line))
                break
            except json.JSONDecodeError:
                at = line.find('{"op": ', 1)
                line = line[at:] if at > 0 else ""
    return out


def read_blob(rec_dir: str, name: str) -> bytes:
    with open(os.path.join(rec_dir, "blobs", name), "rb") as f:
        return f.read()
