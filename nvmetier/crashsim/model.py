"""The persistence model: which on-disk states a crash may leave after any
prefix of a recording.

Owns: the replay of a recording's operations into a model of the files
(``FsModel``) and the materialisation of one crash state into a directory.
Pure computation and file writes into the directory it is given; any thread.

The rules (ext4 ``data=ordered`` and xfs, as a cautious application must
assume them; ``docs/architecture.md``, "Failure model"):

- A write reaches the media only at its file's ``fsync`` (or ``msync``);
  before that any subset of its 4 KiB pages may have (a power loss tears a
  write at page boundaries, and the kernel writes dirty pages back in any
  order at any time), each page whole.
- ``create``, ``rename``, ``link`` and ``unlink`` change the names at once
  for the running processes, but reach the media only with an ``fsync`` of
  their directory; the journal commits them in order, so a crash keeps a
  prefix of the ones not yet synced.
- A killed process (``kill -9``, no power loss) loses nothing it wrote: the
  page cache survives it (``volatile`` states).
- Directories themselves are taken to exist (stores live in directories
  made and synced before anything in them matters).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any

from nvmetier.crashsim.recorder import PAGE, read_blob

NS_OPS = ("create", "rename", "link", "unlink")


@dataclasses.dataclass
class Inode:
    durable: bytearray
    volatile: bytearray
    # Unsynced pages: (operation index, file offset, bytes), in order.
    pending: list[tuple[int, int, bytes]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Unit:
    """One unsynced page: which inode, where, from which operation."""

    inode: int
    op: int
    offset: int
    data: bytes


@dataclasses.dataclass(frozen=True)
class Choice:
    """One crash state at a point: ``ns_prefix`` of the unsynced name
    changes kept, the unsynced pages ``units`` kept (indices into the
    point's units), or ``volatile`` (a killed process: everything kept)."""

    point: int
    ns_prefix: int = 0
    units: frozenset[int] = frozenset()
    volatile: bool = False

    def describe(self) -> str:
        if self.volatile:
            return f"--point {self.point} --volatile"
        units = ",".join(map(str, sorted(self.units))) or "none"
        return f"--point {self.point} --ns {self.ns_prefix} --units {units}"


class FsModel:
    """Files after operations ``[0, point)`` of a recording, durable and not."""

    def __init__(self, rec_dir: str, ops: list[dict[str, Any]]) -> None:
        self.rec_dir = rec_dir
        self.ops = ops
        self.point = 0
        self.inodes: list[Inode] = []
        self.names: dict[str, int] = {}  # what running processes see
        self.durable_names: dict[str, int] = {}
        self.pending_ns: list[tuple[int, dict[str, Any], int]] = []  # (op index, op, inode)
        self._blobs: dict[str, bytes] = {}

    def _blob(self, name: str) -> bytes:
        b = self._blobs.get(name)
        if b is None:
            b = self._blobs[name] = read_blob(self.rec_dir, name)
        return b

    def _inode_of(self, path: str) -> Inode:
        i = self.names.get(path)
        if i is None:
            # A file the recording did not see created (it was there
            # before, or a process's first touch made it): take it as durable.
            self.inodes.append(Inode(bytearray(), bytearray()))
            i = self.names[path] = self.durable_names[path] = len(self.inodes) - 1
        return self.inodes[i]

    def advance(self, point: int) -> None:
        """Apply operations up to (not including) ``point``."""
        while self.point < point:
            self._apply(self.point, self.ops[self.point])
            self.point += 1

    def _apply(self, i: int, op: dict[str, Any]) -> None:
        kind = op["op"]
        path = op.get("path", "")
        if kind == "write":
            ino = self._inode_of(path)
            data = self._blob(op["blob"])
            _put(ino.volatile, op["off"], data)
            off = op["off"]
            # Page units, aligned to the file's pages.
            at = 0
            while at < len(data):
                end = min(len(data), (off + at) // PAGE * PAGE + PAGE - off)
                ino.pending.append((i, off + at, data[at:end]))
                at = end
        elif kind == "truncate":
            ino = self._inode_of(path)
            size = op["size"]
            del ino.volatile[size:]
            ino.volatile.extend(bytes(size - len(ino.volatile)))
        elif kind == "fsync":
            ino = self._inode_of(path)
            ino.durable = bytearray(ino.volatile)
            ino.pending.clear()
        elif kind in NS_OPS:
            if kind == "create":
                self.inodes.append(Inode(bytearray(), bytearray()))
                target = len(self.inodes) - 1
                self.names[path] = target
            elif kind in ("rename", "link"):
                self._inode_of(path)  # a file from before the recording: durable
                target = self.names[path]
                self.names[op["dst"]] = target
                if kind == "rename":
                    del self.names[path]
            else:
                self._inode_of(path)
                target = self.names.pop(path)
            self.pending_ns.append((i, op, target))
        elif kind == "fsync_dir":
            d = os.path.normpath(path)
            last = -1
            for n, (_i, nop, _t) in enumerate(self.pending_ns):
                dirs = {os.path.dirname(nop["path"]) or "."}
                if "dst" in nop:
                    dirs.add(os.path.dirname(nop["dst"]) or ".")
                if d in dirs:
                    last = n
            self.durable_names = self._names_after(last + 1)
            del self.pending_ns[: last + 1]

    def _names_after(self, prefix: int) -> dict[str, int]:
        names = dict(self.durable_names)
        for _i, op, target in self.pending_ns[:prefix]:
            kind = op["op"]
            if kind == "create":
                names[op["path"]] = target
            elif kind in ("rename", "link"):
                names[op["dst"]] = target
                if kind == "rename":
                    names.pop(op["path"], None)
            else:
                names.pop(op["path"], None)
        return names

    def units(self) -> list[Unit]:
        """Every unsynced page now, in operation order."""
        out: list[Unit] = []
        for n, ino in enumerate(self.inodes):
            out.extend(Unit(n, i, off, data) for i, off, data in ino.pending)
        return sorted(out, key=lambda u: u.op)

    def files(self, choice: Choice) -> dict[str, bytes]:
        """The files (name -> bytes) of one crash state at ``self.point``."""
        if choice.volatile:
            return {name: bytes(self.inodes[i].volatile) for name, i in self.names.items()}
        names = self._names_after(choice.ns_prefix)
        units = self.units()
        content: dict[int, bytearray] = {}
        for _name, i in names.items():
            if i not in content:
                content[i] = bytearray(self.inodes[i].durable)
        for n in sorted(choice.units):
            u = units[n]
            if u.inode in content:
                _put(content[u.inode], u.offset, u.data)
        return {name: bytes(content[i]) for name, i in names.items()}


def _put(buf: bytearray, off: int, data: bytes) -> None:
    if len(buf) < off + len(data):
        buf.extend(bytes(off + len(data) - len(buf)))
    buf[off : off + len(data)] = data


def state_digest(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return h.hexdigest()


def materialize(files: dict[str, bytes], root: str) -> None:
    """Write one state's files under ``root`` (directories made as needed)."""
    for name, data in files.items():
        path = os.path.join(root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, 0o600)
