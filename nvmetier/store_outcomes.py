"""What the store reports: its counters, a finished job, and its errors.

Owns: ``COUNTERS`` (every counter ``BlockStore.stats`` reports), ``JobOutcome``
(a finished job as ``BlockStore.poll`` returns it) and ``RawOutcome`` (as the
native table's poll gives it), the one-line warnings for a refused or failed
job, and what a failed store open says (``open_error_message``: the store,
the file, the error and the fix). Pure data and formatting: no state, no
I/O but logging. Called on the scheduler thread (job outcomes, warnings) and
the opening thread (open errors). ``nvmetier.store`` re-exports every name.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
from typing import Any

logger = logging.getLogger("nvmetier.store")

# Every counter ``stats()`` reports (zero until it happens).
COUNTERS = (
    "bytes_written",
    "bytes_read",
    "ops_written",
    "ops_read",
    "hits",
    "misses",
    "evictions",
    "checksum_failures",
    "read_errors",
    "loads_cancelled",
    "write_errors",
    "load_keys_missing",
    "load_jobs_failed",
    "store_jobs_failed",
    "stores_skipped_present",
    "stores_dropped_queue_full",
    "stores_dropped_set_busy",
    "stores_not_admitted",
    "records_dropped_at_open",
    "loads_raced",
    "dead_slots_reclaimed",
    "lock_recoveries",
    # Bounds on waiting for other processes (issue 15): a store of a key
    # another process was writing that gave up (timeout) or whose write did
    # not land; set mutex waits that timed out; completions whose set was
    # held (deferred) and those whose job gave up on them (abandoned).
    "stores_dropped_watch_timeout",
    "stores_dropped_watch_failed",
    "set_lock_timeouts",
    "completions_deferred",
    "completions_abandoned",
    # Loads of slots left unverified by a crash or a dead writer, checked
    # whatever verify_checksums says, that verified.
    "loads_verified_unverified",
    # KV event keys (stored/removed) not recorded for lack of memory; the
    # ops themselves were applied.
    "kv_events_lost",
    # Chunks found past the configured retention (never served: a miss).
    "retention_expired",
    # Writes that `nvmetier purge --all` caught in flight (never published).
    "stores_purged",
    # Sealed writes skipped because no epoch could seal at that instant (a
    # rotation under way, e.g. right after `purge --all`): never published.
    "stores_skipped_no_epoch",
    # Removal events emitted for chunks `nvmetier purge` removed.
    "purge_removals_emitted",
    # Encrypted chunks whose AES-GCM tag did not verify (also counted in
    # checksum_failures: a miss, the slot freed).
    "auth_failures",
    # Sealed chunks found under a key epoch known destroyed (a purge, a
    # retention, a full keys file) while their load was in flight or since: a
    # miss, the slot freed; not corruption (neither counter above).
    "loads_key_destroyed",
    # READY chunks whose recency a touch refreshed (vLLM's tier: the chunks a
    # finished request used, whichever tier or the GPU served them).
    "chunks_touched",
    # Stores under the root that this process removed, whole, to fit the
    # root budget when it created its own (nvmetier.budget: give_way).
    "stores_removed_for_budget",
)


@dataclasses.dataclass(slots=True)
class JobOutcome:
    """A finished job, as ``poll`` returns it.

    Attributes:
        job_id: the caller's job id.
        is_load: True for a load (disk -> buffer), False for a store.
        success: every key of the job succeeded.
        successful_keys: for a partly failed job, the keys that succeeded.
        transfer_time_s: submit to last completion.
        transfer_bytes: bytes actually moved.
    """

    job_id: int
    is_load: bool
    success: bool
    successful_keys: list[bytes] | None
    transfer_time_s: float
    transfer_bytes: int


# A finished job as the native table's poll() gives it: (job_id, success,
# successful_keys or None, transfer_time_s, moved_bytes, error or None, is_load).
RawOutcome = tuple[int, bool, "list[bytes] | None", float, int, "str | None", bool]


def log_refused_job(job_id: int, error: str) -> None:
    """One warning for a job whose ops the engine refused (closed): the
    table failed the job, which ``poll`` reports; vLLM sees no exception."""
    logger.warning("nvmetier: job %d could not be submitted: %s", job_id, error)


def log_failed_job(raw: RawOutcome) -> None:
    """One warning for a job that failed for a reason other than missing
    keys (a miss is not a fault). Called for entries whose error is set."""
    job_id, _ok, ok_keys, _t, _moved, error, is_load = raw
    logger.warning(
        "nvmetier: %s job %d failed (%d keys succeeded): %s",
        "load" if is_load else "store",
        job_id,
        len(ok_keys or ()),
        error,
    )


_NO_ACCESS = (
    "this process may not use the file: fix its owner or mode, or run vLLM as the "
    "user that made the store"
)
_OPEN_ERROR_HINTS = {
    errno.EIO: "the drive or its filesystem reports an I/O error (see `dmesg`): "
    "repair or replace it, or point root_dir at another drive",
    errno.EROFS: "the filesystem is read-only (ext4 remounts itself read-only "
    "after errors: see `dmesg`): remount it read-write once it is sound, or point "
    "root_dir at another drive",
    errno.ENOSPC: "the filesystem is full: free space or lower capacity_bytes",
    errno.EDQUOT: "the user's disk quota is used up: raise it or lower capacity_bytes",
    errno.EACCES: _NO_ACCESS,
    errno.EPERM: _NO_ACCESS,
}


def open_error_message(root_dir: Any, store_name: str, exc: OSError) -> str:
    """What a failed store open says: the store, the file, the error, the fix."""
    where = f" on {exc.filename}" if exc.filename else ""
    hint = _OPEN_ERROR_HINTS.get(
        exc.errno or 0, "check the filesystem under root_dir and the path itself"
    )
    return (
        f"cannot open store {store_name!r} under root_dir {root_dir!r}: "
        f"{exc.strerror or exc} (errno {exc.errno}){where}; {hint}"
    )
