"""vLLM's primary-tier region files (``/dev/shm/vllm_offload_<engine_id>.mmap``):
a server's claim on its region, and the reclaim of regions no live server
holds.

vLLM's ``SharedOffloadRegion`` (0.32, 0.33) keeps the CPU primary tier of a
tiering spec in one file per engine, opened by every worker process and by
the scheduler; ``CpuTieringOffloadingSpec`` unlinks it once the scheduler
mapped it, so a file is left only by a server that died before that. The
protocol that tells a live server's file from a dead one's, across PID
namespaces (containers that share ``/dev/shm`` but see none of each other's
processes):

- **Claim.** Every process of ours that maps a region claims it first
  (``claim_region``): it opens the file, creating it if absent, takes a
  *shared* flock on it and keeps that fd, with the lock, for as long as it
  lives; only then does vLLM open the file and the region become usable.
  flock locks live on the inode (kernel-wide, whatever the PID namespace)
  and go with the last fd of their holder, so a killed server's claims go
  with its processes. A claim that finds its file unlinked once locked (a
  reclaim removed it between the open and the flock) starts again with a
  new file, so a claim never holds a file that is gone.
- **Reclaim.** ``reclaim_stale_regions`` removes a file only while it holds
  it *exclusively* itself (``LOCK_EX | LOCK_NB``: no claim is held on it, by
  anyone), never because some PID looks dead. Two more conditions keep the
  files of servers that claim nothing (vLLM's own specs on a GPU server):
  no process this one can see maps it, and it is older than ``min_age_s``
  (between their creation and their first mapping such files are neither
  mapped nor locked).
- A file this process may not open or remove (another user's: ``/dev/shm``
  is sticky) is left in place with one warning naming it, its owner, and
  what to do; a server's start never fails on it.

Owns: no state; the fd of a claim belongs to its holder (``RegionClaim``).
Called on the constructing thread (vLLM's worker while it registers the KV
cache, the scheduler while it builds the primary tier). Blocking: a claim
polls for at most ``timeout_s`` while a reclaim holds its file (an instant);
a reclaim never waits on a lock. Imports nothing of vLLM.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import logging
import os
import pwd
import stat
import time
from collections.abc import Callable, Iterator

from nvmetier.locks import _is_linked

logger = logging.getLogger(__name__)

# Where vLLM's SharedOffloadRegion puts the file (fixed in 0.32 and 0.33), and
# its name: the first file of a region, then ``.1``, ``.2``... for segments.
REGION_DIR = "/dev/shm"
REGION_PATTERN = "vllm_offload_*.mmap*"
# vLLM's mode for the file; a claim that creates it uses the same.
REGION_MODE = 0o600
# A file younger than this may be between its creation and its first mapping
# by a starting server that claims nothing: never reclaimed.
STALE_REGION_MIN_AGE_S = 120.0
# How long a claim waits while a reclaim holds its file exclusively (the
# reclaim holds it only to unlink it).
CLAIM_TIMEOUT_S = 30.0


def region_path(engine_id: str, region_dir: str = REGION_DIR) -> str:
    """The file vLLM's ``SharedOffloadRegion`` uses for ``engine_id``."""
    return os.path.join(region_dir, f"vllm_offload_{engine_id}.mmap")


class RegionClaimTimeout(TimeoutError):
    """A reclaim kept the region's file locked past the bound."""


class RegionClaim:
    """A held claim: an fd on the region's file with a shared flock on it.

    The claim lasts as long as the fd: until ``release()``, the end of a
    ``with`` block, or the holder's exit, however it exits.
    """

    def __init__(self, path: str, fd: int, created: bool) -> None:
        self.path = path
        # Whether this claim created the file (and sized it).
        self.created = created
        self._fd: int | None = fd

    def remove(self) -> None:
        """Unlink the file if it is still this claim's (a start that failed
        after it created the region: peers waiting for it then fail at once)."""
        if self._fd is not None and _is_linked(self._fd, self.path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def release(self) -> None:
        """Drop the claim (the file may then be reclaimed). Idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RegionClaim:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.release()


def claim_region(
    path: str,
    size_bytes: int,
    *,
    check_space: Callable[[int], None] | None = None,
    timeout_s: float = CLAIM_TIMEOUT_S,
) -> RegionClaim:
    """Claim the region file at ``path`` for this process's life.

    Opens the file (creating it with ``REGION_MODE`` if absent), holds a
    shared flock on it, and, if this call created it, sizes it to
    ``size_bytes`` after ``check_space(size_bytes)`` (vLLM's free-space
    check; it raises to refuse). Processes that open it afterwards, vLLM's
    ``SharedOffloadRegion`` included, find it sized and join it.

    Postcondition: the returned claim holds the file that is at ``path``
    now; no reclaim removes it while the claim is held.

    Raises:
        RegionClaimTimeout: a reclaim held the file past ``timeout_s``.
        OSError: the file cannot be opened or sized (the file this call
            created is removed again first); whatever ``check_space`` raises.
    """
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while True:
        fd, created = _open_region(path)
        if fd is not None:
            if _lock_shared(fd) and _is_linked(fd, path):
                claim = RegionClaim(path, fd, created)
                break
            # Locked but unlinked: a reclaim removed it between the open and
            # the flock. Start again: never hold a file that is gone.
            os.close(fd)
        now = time.monotonic()
        if now >= deadline:
            raise RegionClaimTimeout(
                f"{path} stayed locked by a reclaim of stale primary-tier regions for over "
                f"{timeout_s:g} s"
            )
        time.sleep(min(pause, deadline - now))
        pause = min(pause * 2, 0.05)
    if created:
        try:
            if check_space is not None:
                check_space(size_bytes)
            os.ftruncate(fd, size_bytes)
        except BaseException:
            claim.remove()
            claim.release()
            raise
    return claim


def _lock_shared(fd: int) -> bool:
    """Take a shared flock on ``fd`` without waiting; False while a reclaim
    holds the file exclusively (to remove it)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _open_region(path: str) -> tuple[int | None, bool]:
    """(fd, created) of the file at ``path``, created if absent; (None,
    False) when it vanished between a failed create and the open."""
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL, REGION_MODE), True
    except FileExistsError:
        pass
    try:
        return os.open(path, flags), False
    except FileNotFoundError:
        return None, False


def _could_be_vllm(pid_dir: str) -> bool:
    """Whether a process whose maps we may not read could be a vLLM process
    (a Python): then nothing can be called unmapped. Others (a sandbox's
    init, a daemon of another user) are not."""
    try:
        with open(os.path.join(pid_dir, "cmdline"), "rb") as f:
            cmd = f.read().lower()
    except FileNotFoundError:
        return False
    except PermissionError:
        return True
    return b"python" in cmd or b"vllm" in cmd


def _mapped_paths(region_dir: str) -> set[str] | None:
    """Region files in ``region_dir`` mapped by any process this one can
    see (from /proc/*/maps); None when a process that could be vLLM's cannot
    be read (then nothing may be called unmapped)."""
    prefix = os.path.join(region_dir, "vllm_offload_")
    mapped: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if prefix in line:
                        mapped.add(line.split(None, 5)[-1].strip().removesuffix(" (deleted)"))
        except FileNotFoundError:  # the process exited meanwhile
            continue
        except PermissionError:
            if _could_be_vllm(os.path.dirname(maps)):
                return None
    return mapped


def _may_remove(st: os.stat_result, dir_st: os.stat_result, region_dir: str) -> bool:
    """Whether this process may unlink a file with ``st`` from ``region_dir``:
    write access to the directory and, where it is sticky (``/dev/shm``),
    owning the file or the directory, or being root."""
    euid = os.geteuid()
    if euid == 0:
        return True
    if not os.access(region_dir, os.W_OK | os.X_OK):
        return False
    return not dir_st.st_mode & stat.S_ISVTX or euid in (st.st_uid, dir_st.st_uid)


@contextlib.contextmanager
def _opened(path: str) -> Iterator[int]:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        yield fd
    finally:
        os.close(fd)


def _warn_not_removable(path: str, st: os.stat_result) -> None:
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:  # a uid with no name here (another container's user)
        owner = "?"
    logger.warning(
        "nvmetier: left %s (%d MiB) in place: it belongs to user %s (uid %d) and this "
        "process (uid %d) may not remove it. If no vLLM server of that user runs, it is "
        "the primary-tier region of a dead server, holding that much RAM: remove it as "
        "that user or as root (rm %s)",
        path,
        st.st_size >> 20,
        owner,
        st.st_uid,
        os.geteuid(),
        path,
    )


def reclaim_stale_regions(
    region_dir: str = REGION_DIR, min_age_s: float = STALE_REGION_MIN_AGE_S
) -> list[str]:
    """Remove region files no live server holds: unclaimed, unmapped, old.

    A file is removed only while this call holds it exclusively (no claim on
    it, in any PID namespace), no process it can see maps it, and it is at
    least ``min_age_s`` old. A file it may not open or remove (another
    user's) is left with one warning each. Never raises for a file.

    Returns:
        The paths removed.
    """
    candidates = sorted(glob.glob(os.path.join(glob.escape(region_dir), REGION_PATTERN)))
    if not candidates:
        return []
    try:
        dir_st = os.stat(region_dir)
    except FileNotFoundError:
        return []
    mapped: set[str] | None = None
    mapped_known = False
    removed = []
    now = time.time()
    for path in candidates:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode) or now - st.st_mtime < min_age_s:
            continue
        try:
            with _opened(path) as fd:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # claimed: a live server's
                if not _is_linked(fd, path):
                    continue
                if not _may_remove(st, dir_st, region_dir):
                    _warn_not_removable(path, st)
                    continue
                if not mapped_known:
                    mapped, mapped_known = _mapped_paths(region_dir), True
                if mapped is None or path in mapped:
                    continue
                os.unlink(path)  # under the exclusive lock: no claim can start on it
        except FileNotFoundError:
            continue
        except PermissionError:  # may not open it, or the unlink was refused
            _warn_not_removable(path, st)
            continue
        removed.append(path)
    if removed:
        logger.info(
            "nvmetier: removed %d stale primary-tier file(s) of dead vLLM servers from %s (%s)",
            len(removed),
            region_dir,
            ", ".join(os.path.basename(p) for p in removed),
        )
    return removed
