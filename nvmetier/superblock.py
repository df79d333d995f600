"""A store's superblock: reading it, checking it against what the
configuration asks for (``Layout``), and writing it durably.

Owns: no state; ``StoreFiles`` holds the superblock it read or wrote. Called
on the constructing thread (open, create) and at close (the clean mark);
blocking: one small read, or a write and its syncs.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from nvmetier import format as fmt
from nvmetier.config import DEFAULT_WAYS
from nvmetier.crashsim import hook
from nvmetier.errors import ConfigError, FormatError
from nvmetier.store_dir import SUPERBLOCK_NAME, fsync_dir, write_file

# Test-only (issue 31): the planted bug the crash explorer must find.
_NO_DIR_FSYNC = hook.planted("superblock-no-dir-fsync")


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the configuration asks a store to be (compared at every open)."""

    capacity_bytes: int
    chunk_bytes: int
    ways: int | None  # None: DEFAULT_WAYS, or fewer when fewer slots fit
    identity: dict[str, Any]
    capacity_per_path: tuple[int, ...] | None = None

    def geometry(self, n_paths: int) -> tuple[int, int, int]:
        """``(ways, slot_bytes, n_slots)`` of this layout over ``n_paths`` drives.

        Raises:
            FormatError: not one set fits (an explicit ``ways``), or not one
                slot per drive (the default).
        """
        ways = self.ways
        if ways is None:
            _slot, most = self._geometry(1, n_paths)
            ways = max(1, min(DEFAULT_WAYS, most // n_paths))
        return (ways, *self._geometry(ways, n_paths))

    def _geometry(self, ways: int, n_paths: int) -> tuple[int, int]:
        return fmt.geometry(
            self.capacity_bytes,
            self.chunk_bytes,
            ways,
            n_paths,
            self.identity,
            self.capacity_per_path,
        )


def read_superblock(path: str) -> fmt.Superblock:
    """The superblock at ``path``.

    Raises:
        FormatError: not a superblock of this format version (or corrupt).
    """
    with open(path, "rb") as f:
        return fmt.unpack_superblock(f.read(), where=path)


def write_superblock(directory: str, sb: fmt.Superblock) -> None:
    """Write the superblock atomically and durably: a temporary file, its
    fsync, a rename over the old one, then an fsync of ``directory``.

    Durable on return: without the directory's fsync the rename may still be
    only in memory after a power loss, and a start would read the old
    superblock (a *clean* one while the session's writes already landed:
    ``docs/format.md``, "Durability order").

    Raises:
        OSError: any step failed; the old superblock may then still be the
            one on disk (never a torn one).
    """
    path = os.path.join(directory, SUPERBLOCK_NAME)
    write_file(path, fmt.pack_superblock(sb), tmp=path + ".tmp")
    if not _NO_DIR_FSYNC:
        fsync_dir(directory)


def check_same_layout(sb: fmt.Superblock, layout: Layout, main: str, n_paths: int) -> None:
    """Refuse to reuse the store in ``main`` (superblock ``sb``, over
    ``n_paths`` drives) for another layout than ``layout``.

    Raises:
        FormatError: another layout identity or chunk size (its data must
            never be served).
        ConfigError: another geometry (ways, drives, slots) than the
            configuration asks for.
    """
    if sb.identity != layout.identity:
        raise FormatError(
            f"store {main!r} was written for another layout identity; "
            "its data will not be served. Remove the directory or use another root_dir"
        )
    if sb.chunk_bytes != layout.chunk_bytes:
        raise FormatError(
            f"store {main!r} holds {sb.chunk_bytes}-byte chunks, not {layout.chunk_bytes}"
        )
    ways, _slot_bytes, n_slots = layout.geometry(n_paths)
    if (sb.ways, sb.n_paths, sb.n_slots) != (ways, n_paths, n_slots):
        raise ConfigError(
            f"store {main!r} was created with ways={sb.ways}, {sb.n_paths} path(s) "
            f"and {sb.n_slots} slots, but the configuration asks for ways={ways}, "
            f"{n_paths} path(s) and {n_slots} slots "
            f"(capacity_bytes={layout.capacity_bytes}); restore the original settings, or "
            "remove the store directory to start a new cache with the new size"
        )
