"""BlockStore: the tier's data path — shared table + files + engine + jobs.

Owns: this process's view of one store (its ``StoreFiles``, with the
process-shared slot table ``nvmetier._table.Table``, and its ``IoEngine``),
and the jobs it submitted. Other processes may be attached to the same store
at the same time (``sharing: node``): every slot decision is made in the
shared table under its set's lock, so they see each other's chunks at once.

Threads: one at a time. Every method is called by the *scheduler thread*,
under vLLM's manager lock, so the store needs no lock of its own. A job is
one call into the native table (``submit_store``/``submit_load``: keys to
ops, ops to the engine) and a poll is one more (``poll``: the engine's
completions applied, finished jobs out), so vLLM's
threads pay per job and per poll rather than per chunk; the engine's threads
(Python workers, or the native io_uring thread) move bytes and compute
checksums. Only ``wait_idle`` and ``close`` block (they wait for the engine).

Crash protocol: a claimed slot is marked WRITING (owned by this process) and
its old record zeroed (in the shared mapping of the index, so a killed process
cannot lose it) before its data write is submitted; the new record is written,
then the slot published READY, only after the data write completed (when
``poll`` collects it, before the store is reported to vLLM). A load succeeds
only if its slot's generation did not change while it ran and the payload
checksum, seeded with the key, verifies.

Encryption at rest (``encryption``): keys go to the table as HMAC-SHA256
MACs (mapped back for vLLM: ``successful_keys``, KV events) and the engine
seals and opens chunks in its own threads (``engine/sealed.py``: ``Sealing``); the
layout identity says ``encryption``, so a sealed store is never a plaintext
one. Retention (``retention``) is applied by the table itself.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

import numpy as np

from nvmetier import budget, crypto, staging_probe
from nvmetier import format as fmt
from nvmetier.config import TierConfig
from nvmetier.engine import IoEngine, make_engine, resolve_engine_name
from nvmetier.engine.sealed import Sealing, sealed_chunk_bytes
from nvmetier.errors import ConfigError, NvmeTierError, StoreIOError
from nvmetier.files import StoreFiles
from nvmetier.keyring import KEYRING_FILE, Keyring, KeyringError
from nvmetier.memory import describe_primary, huge_page_bytes, staging_wanted
from nvmetier.store_events import PurgeEvents, unseal_events
from nvmetier.store_outcomes import (  # re-exported: the names this module always had
    COUNTERS,
    JobOutcome,
    RawOutcome,
    log_failed_job,
    log_refused_job,
    open_error_message,
)

logger = logging.getLogger(__name__)

_MAX_LOOKUP_COUNTS = 1 << 20
# The layout identity's "encryption" of a sealed store (format.md).
ENCRYPTION_ID = "aes-256-gcm/v1"
# Where the table header keeps the latest sealed opener's key fingerprint.
KEY_FINGERPRINT_OFFSET = 72
KEYS_GEN_OFFSET = 80  # nvt_table_header.keys_gen (native/nvt_layout.h), a u32
# Keys remembered per process to turn KV events' key MACs back into keys.
_MAX_KNOWN_MACS = 1 << 20
# How long a lookup hit or a load protects its slot from every sharer's
# eviction. A lease expires on its own, so a dead process pins nothing for long.
LEASE_S = 5.0
# How long a store of a key that another process is writing waits for that
# write (a stopped or hung writer must not hold this process's jobs): past it
# the key is reported not stored by this job (stores_dropped_watch_timeout).
WATCH_TIMEOUT_S = 2.0
# How long close() waits for jobs in flight before it gives up on them (and
# warns with what it dropped). Longer than WATCH_TIMEOUT_S, so stores waiting
# for another process's write end on their own first.
CLOSE_DRAIN_S = 10.0


def _key_list(keys: Iterable[bytes]) -> Sequence[bytes]:
    return keys if isinstance(keys, (list, tuple)) else list(keys)


class BlockStore:
    """A persistent, bounded, checksummed store of fixed-size chunks, shared
    live with every other process that opens it (``sharing: node``).

    Args:
        config: validated tier configuration.
        store_name: directory name of this store under each root.
        identity: layout identity (JSON-able); decides which data is served.
        buffer: the memory ops read from and write into (the primary view);
            row ``i`` starts at ``i * row_bytes``.
        row_bytes: bytes of one row = one chunk.
        engine: force an engine name (``threads``/``uring``) instead of
            resolving ``config.io_engine`` (tests, benchmarks).
        engine_wrapper: wraps the engine once built (fault injection in
            tests: an engine that fails ops on command).

    Raises:
        ConfigError, StoreLockedError, StoreSpaceError, FormatError,
        EngineUnavailableError: at construction, with a message naming the fix.
    """

    def __init__(
        self,
        config: TierConfig,
        *,
        store_name: str,
        identity: dict[str, Any],
        buffer: memoryview,
        row_bytes: int,
        engine: str | None = None,
        engine_wrapper: Callable[[IoEngine], IoEngine] | None = None,
    ) -> None:
        self.config = config
        self.row_bytes = row_bytes
        # Encryption at rest: the key file is checked first (a ConfigError
        # naming it), the layout identity says the store is sealed (a
        # plaintext store is never reused), and slots hold the sealed chunk.
        self._keys: crypto.StoreKeys | None = None
        self._operator: crypto.KeySet | None = None
        self._keyring: Keyring | None = None
        self._sealing: Sealing | None = None
        chunk_bytes = row_bytes
        if config.encryption is not None:
            self._operator = crypto.KeySet.from_file(config.encryption["key_file"])
            identity = {**identity, "encryption": ENCRYPTION_ID}
            chunk_bytes = sealed_chunk_bytes(row_bytes)
        self.identity = identity
        self._buf = memoryview(buffer).cast("B")
        self._n_rows = len(self._buf) // row_bytes
        engine_name, self.engine_reason = (
            (engine, "forced") if engine else resolve_engine_name(config.io_engine)
        )
        t0 = time.monotonic()
        try:
            self.files = StoreFiles.open(
                config.root_dir,
                store_name,
                capacity_bytes=config.capacity_bytes,
                chunk_bytes=chunk_bytes,
                ways=config.ways,
                identity=identity,
                o_direct=config.o_direct,
                capacity_per_path=config.capacity_per_path,
                sharing=config.sharing,
                row_bytes=row_bytes,
                n_rows=self._n_rows,
                lease_ns=int(LEASE_S * 1e9),
                watch_timeout_ns=int(WATCH_TIMEOUT_S * 1e9),
                wipe=not config.persist,
                policy=budget.Policy.from_config(config),
            )
        except BaseException as exc:
            self._buf.release()  # the caller's buffer is not held by a store never opened
            if isinstance(exc, OSError) and not isinstance(exc, NvmeTierError):
                msg = open_error_message(config.root_dir, store_name, exc)
                raise StoreIOError(msg, exc) from exc
            raise
        self.sb = self.files.sb
        self._table = self.files.table
        self._stats: collections.Counter[str] = collections.Counter()
        self._hits_leased = 0  # count_hits: HITs answered from lease_many's leases
        self._stats["records_dropped_at_open"] += self.files.records_dropped
        self._stats["stores_removed_for_budget"] += len(self.files.removed_for_budget)
        try:
            self.open_time_s = time.monotonic() - t0
            self.primary = describe_primary(self._buf)
            stage, self.staging_reason = staging_wanted(config.staging, self._buf)
            self.staging_probe: dict[str, Any] | None = None
            if stage and config.staging == "auto" and self.files.o_direct and not self._operator:
                stage, self.staging_reason, self.staging_probe = staging_probe.decide(
                    self.files,
                    engine_name,
                    config,
                    row_bytes,
                    stage,
                    self.staging_reason,
                )
            slot_bytes = self.sb.slot_bytes

            def inner(buf: memoryview, sealing: Sealing | None = None) -> IoEngine:
                return make_engine(
                    engine_name,
                    buf,
                    self.files.data_fds,
                    io_threads=config.io_threads,
                    queue_depth=config.queue_depth,
                    max_inflight_bytes=config.max_inflight_bytes,
                    io_workers=config.io_workers,
                    chunk_bytes=slot_bytes if self._operator else row_bytes,
                    keepalive_fd=self.files.registry_fd,
                    staging=stage,
                    sealing=sealing,
                )

            if self._operator is None:
                self.engine: IoEngine = inner(self._buf)
            else:
                self._keys = self._open_keys(self._operator, store_name)
                # The store key is unwrapped: a running store keeps no KEK
                # (a core dump must not hold what unwraps its keys).
                self._operator.forget_kek()
                assert self._keyring is not None
                # A fresh epoch (random key) for this open, durable before its
                # first seal; both engines seal and open in their own threads
                # through one native key table (engine/sealed.py: Sealing).
                self._sealing = Sealing(
                    self._keys,
                    self._keyring,
                    fmt.identity_digest(identity),
                    row_bytes=row_bytes,
                    slot_bytes=slot_bytes,
                    retention_s=config.retention,
                    keys_generation=self._table.keys_generation,
                    bump_keys=self._table.bump_keys,
                    keys_counter=(self.files.table_map, KEYS_GEN_OFFSET),
                )
                self._sealing.start()
                self.engine = inner(self._buf, self._sealing)
                # For nvmetier info: the latest sealed opener's key fingerprint.
                self.files.table_map[KEY_FINGERPRINT_OFFSET : KEY_FINGERPRINT_OFFSET + 8] = (
                    self._keys.fingerprint
                )
            if engine_wrapper is not None:
                self.engine = engine_wrapper(self.engine)
            self._table.bind(
                # The io_uring engine's own submit, no Python frame; not under
                # a wrapper, which may watch or change what is submitted.
                getattr(self.engine, "native_submit_raw", self.engine.submit_raw)
                if engine_wrapper is None
                else self.engine.submit_raw,
                getattr(self.engine, "native_wait_raw", self.engine.wait_raw),
                max(0, config.max_queued_bytes // row_bytes),
                # A sealed load is always authenticated; its "checksum" (the
                # tag's head) binds the record to the sealing it was written for.
                config.verify_checksums or self._operator is not None,
                config.enable_kv_events,
                # The io_uring engine's workers apply the slot side of each
                # completion themselves (native/nvt_job_worker.c); not under a
                # wrapper, which may change completions after the engine.
                getattr(self.engine, "native_apply_hook", None) if engine_wrapper is None else None,
            )
            self._table.set_retention(int((config.retention or 0) * 1e9))
        except BaseException:
            engine_built = getattr(self, "engine", None)
            if engine_built is not None:
                engine_built.close()
            self._close_sealing()
            self._table = None
            self.files.close(clean=False)
            self._buf.release()
            raise
        self.engine_name = engine_name
        _used, ready, _watches, _jobs = self._table.usage()
        logger.info(
            "nvmetier: opened store %s (%d slots of %d bytes, %d ready, %s, engine %s: %s, "
            "O_DIRECT %s) in %.3fs",
            self.files.dirs[0],
            self.sb.n_slots,
            self.sb.slot_bytes,
            ready,
            "first process attached" if self.files.alone else "attached beside other processes",
            engine_name,
            self.engine_reason,
            self.files.o_direct,
            self.open_time_s,
        )
        # Which memory the primary is decides how fast O_DIRECT moves it
        # (nvmetier.memory): say it once, with what was done about it.
        arenas = self.engine.describe().get("worker_staging", [])
        if isinstance(arenas, list) and arenas:
            total = sum(int(n) for _a, n in arenas)
            huge = sum(huge_page_bytes(int(a), int(n)) for a, n in arenas)
            self.primary["staging_arena_bytes"] = total
            self.primary["staging_arena_huge_page_bytes"] = huge
            self.staging_reason += f" (arena {total >> 20} MiB, {huge >> 20} MiB in huge pages)"
        logger.info(
            "nvmetier: primary %d MiB, %d MiB of it in huge pages (THP %s, shmem THP %s); %s",
            self.primary["primary_bytes"] >> 20,
            self.primary["primary_huge_page_bytes"] >> 20,
            self.primary["thp_enabled"],
            self.primary["thp_shmem_enabled"],
            self.staging_reason,
        )
        # Scheduler-thread state (jobs and completions live in the table).
        self._lookup_counts: dict[bytes, int] = {}
        self._closed = False
        # Sealed stores: the table holds key MACs; what vLLM gets back (a
        # job's successful_keys, KV events) is turned back into its keys.
        self._job_keys: dict[int, dict[bytes, bytes]] = {}
        self._known: dict[bytes, bytes] = {}
        # The removals of `nvmetier purge` runs, announced as KV events.
        self._purges = PurgeEvents(
            self.files.dirs[0], self._stats, self._known if self._keys is not None else None
        )

    def _open_keys(self, operator: crypto.KeySet, store_name: str) -> crypto.StoreKeys:
        """The store's keyring (created with the store) and its secrets.

        Raises:
            ConfigError: the key file does not open this store's keys.
        """
        store_dir = self.files.dirs[0]
        if not self.config.persist and self.files.alone and Keyring.exists(store_dir):
            # The store was wiped at open: its keys go too (a fresh keyring).
            os.unlink(os.path.join(store_dir, KEYRING_FILE))
        self._keyring = Keyring.open(store_dir, create=True, operator=operator)
        try:
            return self._keyring.store_keys(operator, heal=True)
        except KeyringError as exc:
            raise ConfigError(
                f"encryption key_file {self.config.encryption['key_file']!r} "  # type: ignore[index]
                f"does not open store {store_name!r}: {exc}"
            ) from exc

    def _close_sealing(self) -> None:
        if self._sealing is not None:
            self._sealing.close()
            self._sealing = None
        if self._keyring is not None:
            self._keyring.close()
            self._keyring = None

    # ------------------------------------------------------------- scheduler
    @property
    def counts_lookups(self) -> bool:
        """Whether ``lookup`` does more than the table's lookup (admission)."""
        return bool(self.config.admit_after_lookups)

    @property
    def sealed(self) -> bool:
        """Whether the store is encrypted (keys go to the table as MACs)."""
        return self._operator is not None

    @property
    def direct_table(self) -> bool:
        """Whether callers may use the table's own calls (``table_lookup``,
        ``table_calls``' submit_store): no admission, no key MACs."""
        return not self.counts_lookups and not self.sealed

    def _mac(self, key: bytes) -> bytes:
        assert self._keys is not None
        return self._keys.key_mac(key)

    def _macs(self, keys: Iterable[bytes], job_id: int | None = None) -> list[bytes]:
        """The MACs of ``keys`` (~0.3 µs each, one native call); remembered
        for the job's successful_keys and, with events on, for the events."""
        assert self._keys is not None
        key_list = _key_list(keys)
        macs = self._keys.key_macs(key_list)
        if job_id is not None:
            self._job_keys[job_id] = dict(zip(macs, key_list, strict=True))
        if self.config.enable_kv_events:
            known = self._known
            known.update(zip(macs, key_list, strict=True))
            while len(known) > _MAX_KNOWN_MACS:
                known.pop(next(iter(known)))
        return macs

    def table_lookup(self) -> Callable[[bytes], bool]:
        """The shared table's ``lookup`` itself: ``lookup`` without a Python
        frame, for callers that checked ``direct_table``."""
        return self._table.lookup  # type: ignore[no-any-return]

    def lookup_call(self) -> Callable[[bytes], bool]:
        """The cheapest callable equal to ``lookup``: the table's own
        ``lookup`` for a plaintext store, the native HMAC handing the key's
        MAC straight to it for a sealed one (no Python frame either way), or
        ``lookup`` itself when the store counts lookups."""
        if self.direct_table:
            return self.table_lookup()
        if self._keys is not None and not self.counts_lookups:
            return self._keys.mac_then(self._table.lookup)
        return self.lookup

    def table_calls(
        self,
    ) -> tuple[Callable[..., str | None], Callable[..., str | None], Callable[[], None]]:
        """The table's ``submit_store``, ``submit_load`` and ``release_leases``
        themselves, for vLLM's adapter to call without a Python frame per job
        or step (a sealed store's submits go through its key MACs). Each
        submit returns None, or the engine's error when it refused the ops
        (the job then fails; log it). ``submit_store`` skips admission: only
        for callers that checked ``counts_lookups`` is False."""
        t = self._table
        if self.sealed:
            return self._submit_store_sealed, self._submit_load_sealed, t.release_leases
        return t.submit_store, t.submit_load, t.release_leases

    def _submit_store_sealed(
        self, job_id: int, keys: Collection[bytes], rows: Any, skip: bytes | None = None
    ) -> str | None:
        return self._table.submit_store(job_id, self._macs(keys, job_id), rows, skip)  # type: ignore[no-any-return]

    def _submit_load_sealed(self, job_id: int, keys: Collection[bytes], rows: Any) -> str | None:
        if self._sealing is not None:
            self._sealing.poke()  # another process's new epoch: reload its key
        return self._table.submit_load(job_id, self._macs(keys, job_id), rows)  # type: ignore[no-any-return]

    def lookup(self, key: bytes) -> bool:
        """Whether ``key`` is READY in the shared table. A hit is leased: no
        sharer evicts it for ``LEASE_S`` (the HIT -> load window). Never blocks."""
        if self._table.lookup(self._mac(key) if self._keys else key):
            return True
        if self.config.admit_after_lookups:
            self._count_miss(key)
        return False

    def count_lookup(self, key: bytes) -> None:
        """A lookup of ``key`` that vLLM's adapter answered MISS without
        asking the table (the promotion guard withheld it): counted for
        ``admit_after_lookups`` as a miss of ``lookup`` would be, unless the
        key is READY already. Never blocks."""
        if self.config.admit_after_lookups and not self.contains(key):
            self._count_miss(key)

    def _count_miss(self, key: bytes) -> None:
        """One more lookup of absent ``key`` for ``admit_after_lookups``, in a
        dict bounded at ``_MAX_LOOKUP_COUNTS`` keys (the oldest goes)."""
        counts = self._lookup_counts
        counts[key] = counts.get(key, 0) + 1
        if len(counts) > _MAX_LOOKUP_COUNTS:
            counts.pop(next(iter(counts)))

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is READY, without leasing it or counting."""
        return bool(self._table.contains(self._mac(key) if self._keys else key))

    def contains_call(self) -> Callable[[bytes], Any]:
        """The cheapest callable equal to ``contains`` (truthy when READY):
        the table's own ``contains``, behind the native key MAC for a sealed
        store (no Python frame either way); the promotion guard's plan asks it
        once per chunk of a request."""
        if self._keys is not None:
            return self._keys.mac_then(self._table.contains)
        return self._table.contains  # type: ignore[no-any-return]

    def contains_many_call(self) -> Callable[[list[bytes]], bytes]:
        """``contains`` of many keys in one native call: one byte per key, 1
        when READY (a sealed store maps them to their MACs first, natively).
        The promotion guard's plan asks it for a request's chunks at once, so
        that the index's cache misses of those keys overlap."""
        return self._many_call(self._table.contains_many)

    def lease_many_call(self) -> Callable[[list[bytes]], bytes]:
        """``contains_many_call`` that also leases: one byte per key, 1 when
        READY, the key then leased as a ``lookup`` hit is (no sharer evicts
        it until ``release_holds`` at the step's end, or ``LEASE_S``), in one
        native call (a sealed store maps the keys to their MACs first,
        natively). Counts neither hits nor admission misses and leaves
        recency alone: the caller reports the HITs it answers from these
        leases with ``count_hits``, and asks ``lookup`` for any other key.
        The promotion guard's plan reads a request's chunks with it, on
        vLLM's scheduler thread. Never blocks on disk (a set lock held by
        another process is waited for a bounded time, as by ``lookup``)."""
        return self._many_call(self._table.lease_many)

    def _many_call(self, native: Callable[[list[bytes]], bytes]) -> Callable[[list[bytes]], bytes]:
        """``native`` (a table call over a list of keys) itself, or for a
        sealed store the keys mapped to their MACs first, natively."""
        keys = self._keys
        if keys is not None:
            key_macs = keys.key_macs
            return lambda batch: native(key_macs(batch))
        return native

    def count_hits(self, n: int) -> None:
        """``n`` lookups answered HIT from ``lease_many_call``'s leases
        (counted in ``hits`` with the table's own). The scheduler thread's,
        as every lookup; never blocks."""
        self._hits_leased += n

    def slot_of(self, key: bytes) -> int | None:
        """The slot holding ``key`` READY, or None (tools and tests: where a
        chunk lives on disk, ``sb.slot_location(slot)``)."""
        return self._table.slot_of(self._mac(key) if self._keys else key)  # type: ignore[no-any-return]

    def release_holds(self) -> None:
        """End of a step: lookup hits that no load took stop protecting their
        slots. (A lease that another sharer extended stays; every lease also
        runs out on its own after ``LEASE_S``, so a dead process pins nothing.)"""
        if self._table is not None:
            self._table.release_leases()

    def touch(
        self, keys: Iterable[bytes], loaded: Sequence[Collection[bytes]] | None = None
    ) -> int:
        """Mark the READY ones of ``keys`` most recently used, in order (of
        two keys in one set, the later ends up the more recent); the others
        are left alone. One native call (a sealed store's first maps the keys
        to their MACs, not remembered: a touch emits no event). Never blocks
        on disk: the recency lives in the mapped table (a set lock wait is
        bounded, and a set not taken is skipped). Returns how many were READY
        (counted in ``chunks_touched``).

        ``loaded``: a finished request's load jobs' key lists, whose keys
        (the same objects as in ``keys``) their load marked, last to first:
        those are left as they are (and counted), except in a set where
        another of ``keys`` is marked now, or where the loads (jobs in order)
        left them in another order than ``keys``: there all are marked in
        order (``native/nvt_refresh.c``). A sealed store marks them all (its keys
        become MACs here, other objects than the jobs')."""
        key_list = _key_list(keys)
        if self._keys is not None:
            key_list = self._keys.key_macs(key_list)
            loaded = None
        touched: int = self._table.touch(key_list, loaded)
        self._stats["chunks_touched"] += touched
        return touched

    def submit_store(
        self, job_id: int, keys: Collection[bytes], rows: Sequence[int] | np.ndarray
    ) -> None:
        """Write the chunks of ``rows`` under ``keys``. Never blocks.

        Keys already present are skipped (success); a key another sharer is
        writing succeeds once that write landed, and fails if it did not or
        is still unfinished after ``WATCH_TIMEOUT_S``. Keys dropped for lack
        of resources (queue over ``max_queued_bytes``, every way of the set
        busy or leased, the set lock not taken in its bound) are counted and
        fail the job quietly (``successful_keys`` names the stored ones).
        Keys not yet looked up ``admit_after_lookups`` times are skipped on
        purpose and succeed (the admission policy is not a failure).
        """
        if self._closed:
            raise RuntimeError("submit on a closed BlockStore")
        skip = None
        admit_n = self.config.admit_after_lookups
        if admit_n:
            key_list = _key_list(keys)
            counts = self._lookup_counts
            skip = bytes(counts.get(k, 0) < admit_n for k in key_list)
            self._stats["stores_not_admitted"] += sum(skip)
            keys = key_list
        # Rows: vLLM's chunk_ids array is read in place; other sequences copied.
        if self._keys is not None:
            error = self._submit_store_sealed(job_id, keys, rows, skip)
        else:
            error = self._table.submit_store(job_id, keys, rows, skip)
        if error is not None:
            log_refused_job(job_id, error)

    def submit_load(
        self, job_id: int, keys: Collection[bytes], rows: Sequence[int] | np.ndarray
    ) -> None:
        """Read ``keys`` into ``rows``. Never blocks. A key that is not READY
        fails at once (reported in ``successful_keys`` of the outcome)."""
        if self._closed:
            raise RuntimeError("submit on a closed BlockStore")
        if self._keys is not None:
            error = self._submit_load_sealed(job_id, keys, rows)
        else:
            error = self._table.submit_load(job_id, keys, rows)
        if error is not None:
            log_refused_job(job_id, error)

    def invalidate(self, key: bytes) -> bool:
        """Remove ``key`` (its record first). False when absent, being
        written, or leased by a lookup or load (of any sharer)."""
        return bool(self._table.invalidate(self._mac(key) if self._keys else key))

    def poll_raw(self) -> Callable[[], Sequence[RawOutcome]]:
        """The table's ``poll`` itself: finished jobs as ``RawOutcome``
        tuples, without a Python frame (vLLM's ``get_finished_jobs``); a
        sealed store's turns the key MACs back into keys. The caller logs
        entries whose error is set (``log_failed_job``)."""
        if self._keys is not None:
            return self._poll_sealed
        return self._table.poll  # type: ignore[no-any-return]

    def _poll_sealed(self) -> Sequence[RawOutcome]:
        done = self._table.poll()
        if not done:
            return done  # type: ignore[no-any-return]
        out = []
        for job_id, success, ok_keys, secs, moved, error, is_load in done:
            keys = self._job_keys.pop(job_id, None)
            if ok_keys and keys is not None:
                ok_keys = [keys.get(k, k) for k in ok_keys]
            out.append((job_id, success, ok_keys, secs, moved, error, is_load))
        return out

    def poll(self) -> list[JobOutcome]:
        """Apply finished ops and return the jobs that finished. Never blocks."""
        out = []
        for raw in self.poll_raw()() if self._table is not None else ():
            job_id, success, ok_keys, secs, moved, error, is_load = raw
            if error is not None:
                log_failed_job(raw)
            out.append(JobOutcome(job_id, is_load, success, ok_keys, secs, moved))
        return out

    def take_events(self) -> list[tuple[bool, list[bytes]]]:
        """``(removed, keys)`` pairs since the last call (if events enabled),
        in the order to replay them: one stored event per store job, handed
        out once the job's ops are done, and a key's removal always after the
        stored event that announced it; and the removals of an ``nvmetier
        purge`` of this store (``nvmetier.store_events``)."""
        table = self._table
        if table is None:
            return []
        if self.config.enable_kv_events:
            self._purges.take(table)
        events: list[tuple[bool, list[bytes]]] = table.take_events()
        if self._keys is not None and events:
            events = unseal_events(self._known, events)
        return events

    def has_pending_work(self) -> bool:
        return self._table is not None and bool(self._table.inflight()[1])

    # ----------------------------------------------------------- blocking
    def wait_completions(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` for the engine's next completion and apply
        what came (the GIL is released while waiting); the jobs it finished
        wait for ``poll``. For callers that have nothing else to do, e.g. a
        benchmark, instead of polling in a loop. Scheduler thread only."""
        table = self._table
        if table is not None and timeout_s > 0:
            table.collect(float(timeout_s))

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Block until every submitted op completed and was collected.

        Results are then waiting for the next ``poll``. Scheduler thread only.
        Returns False if ops are still outstanding after ``timeout_s``.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        table = self._table
        while table is not None:
            outstanding, jobs = table.inflight()
            if not jobs:
                break
            wait_s = 0.1 if outstanding else 0.001
            if deadline is not None:
                wait_s = min(wait_s, deadline - time.monotonic())
                if wait_s <= 0:
                    return False
            if outstanding:
                table.collect(float(wait_s))
            else:  # only stores waiting for other processes' writes of their keys
                time.sleep(wait_s)
                table.collect(0.0)
        return True

    def close(self, persist: bool | None = None) -> None:
        """Finish in-flight ops (waiting ``CLOSE_DRAIN_S`` at most, then
        warning with what is dropped), stop the engine and detach. The last
        process attached also marks the store clean. Idempotent.

        With ``persist=False`` (default: ``config.persist``) the store's
        directories are removed afterwards, by the last process attached.
        """
        if self._closed:
            return
        self._closed = True
        if self.files.table is None and self._table is not None:
            # A child forked from the process that opened the store: its
            # store fds are closed already (files._forget_after_fork) and the
            # table, the engine and the store's state are the parent's. Only
            # this process's references go.
            self.engine.close()
            self._table = None
            self.files.close(clean=False)
            self._buf.release()
            return
        if not self.wait_idle(CLOSE_DRAIN_S):
            # Bounded: an engine that stopped completing, or a set held by a
            # stopped sharer, must not hang shutdown. What is left is dropped
            # (its WRITING slots are reclaimed by the others once we detach).
            outstanding, jobs = self._table.inflight()
            _used, _ready, watches, _jobs = self._table.usage()
            logger.warning(
                "nvmetier: close gave up after %.1fs waiting for %d jobs in flight "
                "(%d ops outstanding, %d stores waiting for another process's write); "
                "they are dropped",
                CLOSE_DRAIN_S,
                jobs,
                outstanding,
                watches,
            )
        self.poll()
        self.engine.close()
        self._close_sealing()
        self._table.bind(None, None, 0, False, False)  # drop its references to the engine
        self._table = None  # drop our reference: files.close releases the mappings
        keep = self.config.persist if persist is None else persist
        # The last process attached removes the store under its init lock.
        self.files.close(clean=True, remove=not keep)
        # Drop our export of the primary region so its owner can unmap it.
        self._buf.release()

    # --------------------------------------------------------------- stats
    def sharers(self) -> int:
        """Processes attached to this store now (this one included): one
        lock probe per registered process."""
        if self._closed:
            return 0
        return 1 + self.files.other_sharers()

    def stats(self) -> dict[str, int]:
        """Cumulative counters (this process's) and current gauges (the shared
        store's: slots used and ready count every sharer's chunks)."""
        out = {name: 0 for name in COUNTERS}
        out.update(self._stats)
        table = self._table
        used = ready = 0
        if table is not None:
            out.update(table.counters())
            out["kv_events_lost"] += self._purges.lost
            used, ready, _watches, _jobs = table.usage()
        out["hits"] += self._hits_leased
        outstanding = jobs = 0
        if table is not None:
            outstanding, jobs = table.inflight()
        outstanding_bytes = outstanding * self.row_bytes
        out["bytes_in_flight"] = outstanding_bytes
        out["bytes_queued"] = max(0, outstanding_bytes - self.config.max_inflight_bytes)
        out["ops_outstanding"] = outstanding
        out["slots_total"] = self.sb.n_slots
        out["slots_used"] = used
        out["slots_ready"] = ready
        out["capacity_bytes"] = self.sb.n_slots * self.sb.slot_bytes
        out["bytes_used"] = used * self.sb.slot_bytes
        out["jobs_in_flight"] = jobs
        out["sharers"] = self.sharers()
        # The root's budget and what every store under it occupies (a few
        # stat calls at most every budget.USAGE_REFRESH_S; never a lock).
        out["root_budget_bytes"], out["root_used_bytes"] = budget.root_usage_cached(
            self.config.root_dir[0]
        )
        return out

    def describe(self) -> dict[str, Any]:
        return {
            "store_dir": self.files.dirs[0],
            "data_dirs": list(self.files.dirs),
            "slots": self.sb.n_slots,
            "ways": self.sb.ways,
            "slot_bytes": self.sb.slot_bytes,
            "o_direct": self.files.o_direct,
            "o_direct_reason": self.files.o_direct_reason,
            "engine_reason": self.engine_reason,
            "sharing": self.config.sharing,
            "staging_reason": self.staging_reason,
            "staging_probe": self.staging_probe,
            **self.primary,
            **self.engine.describe(),
            "encryption": ENCRYPTION_ID if self._keys else None,
            "key_fingerprint": self._keys.fingerprint_hex if self._keys else None,
        }
