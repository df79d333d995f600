"""The purge log (``purged`` in a store directory): its format, its durable
replacement and its reader.

Owns: the file's byte layout (``docs/format.md``, "Purge log") and nothing
else. ``nvmetier purge`` writes it (``write_log``, on the CLI's main thread,
blocking for a write and an fsync); an attached store reads it when it takes
its KV events (``removed_since``, on vLLM's scheduler thread: one read of a
small file just written, in the page cache). Kept apart from ``purge`` so the
data path (``store``) does not import the purge command.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Sequence

from nvmetier import format as fmt
from nvmetier.crashsim import hook
from nvmetier.store_dir import write_file

LOG_NAME = "purged"
_LOG_MAGIC = b"NVTPURGE"
# magic, version, first purge generation covered, last covered, keys.
# Changing this layout requires a new _LOG_VERSION (docs/format.md).
_LOG_HEAD = struct.Struct("<8sIIIQ4x")
assert _LOG_HEAD.size == 32
_LOG_VERSION = 1
# One key per entry: its length, then the key zero padded.
_LOG_ENTRY_BYTES = 96

# Test-only (issue 31): the planted bug the crash explorer must find.
_NO_SYNC = hook.planted("purge-log-no-sync")


def pack_log(first_gen: int, last_gen: int, keys: Sequence[bytes]) -> bytes:
    """The bytes of a purge log of ``keys`` covering ``first_gen..last_gen``."""
    body = bytearray(_LOG_HEAD.size + _LOG_ENTRY_BYTES * len(keys))
    _LOG_HEAD.pack_into(body, 0, _LOG_MAGIC, _LOG_VERSION, first_gen, last_gen, len(keys))
    at = _LOG_HEAD.size
    for k in keys:
        n = min(len(k), fmt.KEY_MAX_BYTES)
        body[at] = n
        body[at + 8 : at + 8 + n] = k[:n]
        at += _LOG_ENTRY_BYTES
    return bytes(body)


def unpack_log(data: bytes) -> tuple[int, int, list[bytes]] | None:
    """``(first_gen, last_gen, keys)`` of a whole log, None when ``data`` is
    not one (short, another magic or version, fewer entries than it says)."""
    if len(data) < _LOG_HEAD.size:
        return None
    magic, version, first, last, n = _LOG_HEAD.unpack_from(data, 0)
    if magic != _LOG_MAGIC or version != _LOG_VERSION:
        return None
    if len(data) < _LOG_HEAD.size + n * _LOG_ENTRY_BYTES:
        return None
    keys = []
    at = _LOG_HEAD.size
    for _ in range(n):
        k = min(data[at], fmt.KEY_MAX_BYTES)
        keys.append(bytes(data[at + 8 : at + 8 + k]))
        at += _LOG_ENTRY_BYTES
    return first, last, keys


def write_log(store_dir: str, first_gen: int, last_gen: int, keys: Sequence[bytes]) -> None:
    """Replace the purge log with ``keys`` (covering purge generations
    ``first_gen..last_gen``): a temporary file, its fsync, a rename. After a
    power loss the log is the old one or the new one, whole (the rename is
    not made durable: after a power loss no attached process reads it, the
    table's purge generation restarts at 0)."""
    body = pack_log(first_gen, last_gen, keys)
    path = os.path.join(store_dir, LOG_NAME)
    write_file(path, body, tmp=f"{path}.tmp-{os.getpid()}", sync=not _NO_SYNC)


def read_log(store_dir: str) -> tuple[int, int, list[bytes]]:
    """``(first_gen, last_gen, keys)`` of the purge log; ``(0, 0, [])`` when
    there is none or it is not readable (events are best effort)."""
    try:
        with open(os.path.join(store_dir, LOG_NAME), "rb") as f:
            data = f.read()
    except OSError:
        return 0, 0, []
    return unpack_log(data) or (0, 0, [])


def removed_since(store_dir: str, taken_gen: int) -> list[bytes]:
    """The keys of the purge log when it covers a purge after
    ``taken_gen`` (what ``claim_purge_events`` returned), else none."""
    _first, last, keys = read_log(store_dir)
    return keys if last > taken_gen else []


def remove_stale_logs(store_dir: str) -> None:
    """Temporary logs of purges killed before their rename (call with the
    purge lock held: no purge is writing one now)."""
    rec = hook.recorder
    for name in os.listdir(store_dir):
        if name.startswith(f"{LOG_NAME}.tmp-"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(store_dir, name))
                if rec is not None:
                    rec.unlink(os.path.join(store_dir, name))
