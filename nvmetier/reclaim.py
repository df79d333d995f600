"""Stores that outlive their process: the names of private stores, the
reclaim of those whose process is gone, the removal of a store's
directories, and the stores an older format version left beside ours.

Owns: no state. Called on the constructing thread (the vLLM adapter at
start, ``StoreFiles.close(remove=True)``); blocking: directory listings,
lock probes that never wait, and ``rmtree`` of what it removes. A store is
removed only under its ``lock.init`` (``locks``), so no process attaches
to it meanwhile.

Sits above ``locks`` (it judges a store free by its locks) and below
``files``; that is why it is not part of ``store_dir``, which ``locks``
itself imports.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import shutil
from collections.abc import Sequence

from nvmetier import format as fmt
from nvmetier.locks import _is_linked, mark_init_busy
from nvmetier.store_dir import INIT_LOCK_NAME, LOCK_NAME, REMOVING_TAG, SUPERBLOCK_NAME

logger = logging.getLogger(__name__)

PRIVATE_TAG = "_private_"


def private_store_name(base: str) -> str:
    """The name of a store private to this process: ``<base>_private_<pid>_<random>``.

    The pid is for a person reading the directory; the random part keeps
    names unique where pids are not (containers in their own pid namespace
    start at the same pids), so no two processes ever pick one store.
    """
    return f"{base}{PRIVATE_TAG}{os.getpid()}_{secrets.token_hex(4)}"


def stores_of_other_formats(roots: Sequence[str]) -> list[tuple[str, int, int]]:
    """Stores under ``roots`` written by another nvmetier format version.

    This version never opens them (its layout identity, hence its store
    name, includes the format version), so after an upgrade the old store
    sits beside the new one, outside the new one's ``capacity_bytes``. Blocks
    for one directory listing and one superblock read per store; never raises.

    Returns:
        ``(main directory, format version, bytes on disk over all roots)``.
    """
    out: list[tuple[str, int, int]] = []
    if not roots:
        return out
    try:
        names = sorted(os.listdir(roots[0]))
    except OSError:
        return out
    for name in names:
        main = os.path.join(roots[0], name)
        try:
            with open(os.path.join(main, SUPERBLOCK_NAME), "rb") as f:
                version = fmt.superblock_version(f.read(64))
        except OSError:
            continue
        if version is None or version == fmt.FORMAT_VERSION:
            continue
        size = 0
        for d in _under(roots, name):
            with contextlib.suppress(OSError):
                for entry in os.scandir(d):
                    with contextlib.suppress(OSError):
                        size += entry.stat(follow_symlinks=False).st_blocks * 512
        out.append((main, version, size))
    return out


def reclaim_private_stores(roots: Sequence[str]) -> list[str]:
    """Delete the private stores under ``roots`` whose process is gone, and
    the ``.removing-`` directories a crash left in the middle of a removal.

    A private store is judged by its locks, never by a pid (pids are reused,
    and another container's pids are not ours): its process holds ``lock``
    exclusively for its whole life, so a store whose ``lock`` we can take
    (under ``lock.init``, without waiting) has nobody attached. A stopped
    (SIGSTOP, ``docker pause``) process still holds its lock and keeps its
    store. Blocks for one directory listing and a few lock probes; never
    raises: what cannot be examined is left.

    Returns:
        The main directories deleted.
    """
    if not roots:
        return []
    try:
        names = sorted(os.listdir(roots[0]))
    except OSError:
        return []
    reclaimed = []
    for name in names:
        if _REMOVING_NAME.search(name):
            for root in roots:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        elif _PRIVATE_NAME.search(name) and _reclaim_if_free(_under(roots, name)):
            reclaimed.append(os.path.join(roots[0], name))
    return reclaimed


def _under(roots: Sequence[str], name: str) -> list[str]:
    return [os.path.join(r, name) for r in roots]


# Exactly the names private_store_name gives (the pid alone before the random
# part was added) after a store name's 12-hex-digit digest, and _remove_dirs'
# names: a shared store is never taken for one, whatever its model is called.
_PRIVATE_NAME = re.compile(r"_[0-9a-f]{12}(_dp\d+)?_private_\d+(_[0-9a-f]{8})?$")
_REMOVING_NAME = re.compile(r"\.removing-[0-9a-f]{12}$")


def _reclaim_if_free(dirs: Sequence[str], why: str | None = None) -> bool:
    """Remove the store in ``dirs`` if nobody holds it: its ``lock.init``
    and ``lock`` both taken without waiting (a stopped process keeps both).
    ``reclaim_private_stores``, and the root budget's give-way (``why``:
    the warning it logs)."""
    main = dirs[0]
    init_path = os.path.join(main, INIT_LOCK_NAME)
    try:
        init_fd = os.open(init_path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False  # not a store, or one being created right now
    try:
        try:
            fcntl.flock(init_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # being opened or closed now
        mark_init_busy(init_fd)
        if not _is_linked(init_fd, init_path):
            return False
        try:
            lock_fd = os.open(os.path.join(main, LOCK_NAME), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            lock_fd = -1  # its process died before it took the lock
        except OSError:
            return False
        try:
            if lock_fd >= 0:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # its process is alive (or stopped): keep it
        finally:
            if lock_fd >= 0:
                os.close(lock_fd)
        if why is None:
            logger.info("nvmetier: removing %s, the private store of a process that is gone", main)
        else:
            logger.warning("nvmetier: removing %s: %s", main, why)
        _remove_dirs(dirs)
        return True
    finally:
        os.close(init_fd)


def _remove_dirs(dirs: Sequence[str]) -> None:
    """Delete a store's directories; call with its ``lock.init`` held.

    Each directory is first renamed aside (``<name>.removing-<random>``,
    the main one last, which moves ``lock.init`` with it), then deleted. An
    opener that waited on the old ``lock.init`` finds it gone from its path
    and starts again; one that comes after the rename creates a fresh store
    at once, never waiting for the files to be deleted. A crash between the
    two steps leaves a ``.removing-`` directory, which the next
    ``reclaim_private_stores`` deletes.
    """
    tag = f"{REMOVING_TAG}{secrets.token_hex(6)}"
    doomed = []
    for d in [*dirs[1:], dirs[0]]:
        aside = os.path.normpath(d) + tag
        with contextlib.suppress(OSError):
            os.rename(d, aside)
            doomed.append(aside)
    for d in doomed:
        shutil.rmtree(d, ignore_errors=True)
