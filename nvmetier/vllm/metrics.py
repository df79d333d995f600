"""The metric series the NVMe tier reports to vLLM: names, kinds and help text.

Owns ``METRIC_PREFIX``, ``METRICS`` (name -> kind and documentation; counters
are reported as deltas per ``get_stats``) and ``STORE_GAUGES`` (the gauges that
describe the whole store rather than one process). Data only; imported by
``nvmetier.vllm`` (which re-exports these names) and by the docs' tests.
"""

from __future__ import annotations

METRIC_PREFIX = "vllm:nvmetier_"
# name -> (kind, documentation); counters are reported as deltas per get_stats.
METRICS: dict[str, tuple[str, str]] = {
    "bytes_written": ("counter", "Bytes written to the NVMe tier's data files."),
    "bytes_read": ("counter", "Bytes read from the NVMe tier and verified."),
    "ops_written": ("counter", "Chunks written to the NVMe tier."),
    "ops_read": ("counter", "Chunks read from the NVMe tier and verified."),
    "hits": ("counter", "Lookups answered HIT by the NVMe tier."),
    "misses": ("counter", "Lookups answered MISS by the NVMe tier."),
    "evictions": ("counter", "Chunks evicted from the NVMe tier to make room."),
    "checksum_failures": (
        "counter",
        "Chunks whose checksum did not verify on load (served as a miss, invalidated).",
    ),
    "retention_expired": (
        "counter",
        "Chunks found stored longer ago than the tier's retention (served as a miss, freed).",
    ),
    "stores_purged": (
        "counter",
        "Chunk writes caught in flight by 'nvmetier purge --all' (never published).",
    ),
    "stores_skipped_no_epoch": (
        "counter",
        "Sealed chunk writes skipped because no key epoch could seal at that instant "
        "(a key rotation under way, e.g. right after 'nvmetier purge --all').",
    ),
    "auth_failures": (
        "counter",
        "Encrypted chunks whose AES-GCM tag did not verify on load (a miss, freed; "
        "also counted in checksum_failures).",
    ),
    "loads_key_destroyed": (
        "counter",
        "Sealed chunks found on load under a key epoch destroyed by a purge, the retention "
        "or a full keys file (a miss, freed; not in checksum_failures or auth_failures; "
        "a rise with no purge or retention: treat as auth_failures).",
    ),
    "read_errors": ("counter", "Chunk reads that failed with an I/O error."),
    "write_errors": ("counter", "Chunk writes that failed with an I/O error."),
    "stores_dropped_queue_full": (
        "counter",
        "Chunk stores dropped because max_queued_bytes were already queued "
        "(reported to vLLM as failed keys of their store job).",
    ),
    "stores_dropped_set_busy": (
        "counter",
        "Chunk stores dropped because every way of the chunk's set was busy "
        "(reported to vLLM as failed keys of their store job).",
    ),
    "store_jobs_failed": (
        "counter",
        "Store jobs reported to vLLM with success=False (a key dropped or failed).",
    ),
    "load_jobs_failed": (
        "counter",
        "Load jobs reported to vLLM with success=False (a key missing or failed).",
    ),
    "stores_not_admitted": (
        "counter",
        "Chunk stores skipped by admit_after_lookups (SSD wear limit).",
    ),
    "stores_skipped_present": ("counter", "Chunk stores skipped: already on disk."),
    "ops_outstanding": ("gauge", "Chunk reads and writes queued or in flight."),
    "bytes_in_flight": ("gauge", "Bytes handed to the I/O engine and not yet completed."),
    "bytes_queued": ("gauge", "Bytes waiting for the I/O engine (admission bound)."),
    "bytes_used": ("gauge", "Bytes of the data files holding chunks."),
    "capacity_bytes": ("gauge", "Bytes of the data files (the capacity bound)."),
    "slots_used": ("gauge", "Slots holding a chunk (every sharer's)."),
    "sharers": ("gauge", "Processes attached to the NVMe tier's store (this one included)."),
    "root_budget_bytes": (
        "gauge",
        "The root budget every store under the tier's root_dir shares (0: unbounded). "
        "Every model on the root reports it: take max, not sum, across models.",
    ),
    "root_used_bytes": (
        "gauge",
        "Bytes on disk (allocated blocks) of every store under the tier's root_dir. "
        "Every model on the root reports it: take max, not sum, across models.",
    ),
    "stores_removed_for_budget": (
        "counter",
        "Stores with no process attached that this process removed, least recently used "
        "first, to fit its own store under the root budget.",
    ),
    "loads_raced": (
        "counter",
        "Chunk loads failed because another process reused the slot while loading (a miss).",
    ),
    "loads_cancelled": (
        "counter",
        "Chunk loads cancelled before reaching the disk (the slot stays stored).",
    ),
    "stores_dropped_watch_timeout": (
        "counter",
        "Chunk stores failed because another process was still writing the same chunk "
        "after the bounded wait (a stopped or hung sharer).",
    ),
    "stores_dropped_watch_failed": (
        "counter",
        "Chunk stores failed because another process's write of the same chunk, "
        "waited for, did not land (error, cancelled, writer died).",
    ),
    "set_lock_timeouts": (
        "counter",
        "Set lock waits that gave up (a sharer stopped or hung holding the set): "
        "a miss or a dropped store instead of a frozen scheduler thread.",
    ),
    "completions_deferred": (
        "counter",
        "Op completions deferred to a later poll because their set was held by another process.",
    ),
    "completions_abandoned": (
        "counter",
        "Op completions whose job stopped waiting for them (set held past the bound).",
    ),
    "loads_verified_unverified": (
        "counter",
        "Loads of slots recovered after a crash or from a dead writer, checksum-verified "
        "whatever verify_checksums says.",
    ),
    "dead_slots_reclaimed": (
        "counter",
        "Slots of processes that died while writing them, reclaimed.",
    ),
    "kv_events_lost": (
        "counter",
        "KV cache events not recorded for lack of memory (the chunks were stored or removed).",
    ),
    "chunks_touched": (
        "counter",
        "Chunks on disk whose recency a finished request refreshed: it used them, served by "
        "any tier or the GPU prefix cache (recency_refresh_chunks).",
    ),
    # The promotion guard's counters (nvmetier.vllm.promotion).
    "hits_not_loaded": (
        "counter",
        "Lookups answered HIT that vLLM did not load in that step: its CPU tier had no "
        "free slot (the chunk is recomputed). Nonzero: raise cpu_bytes_to_use.",
    ),
    "requests_larger_than_cpu_tier": (
        "counter",
        "Requests whose disk hits needed more CPU tier chunks than vLLM's CPU tier has "
        "(they load part and recompute the rest). Nonzero: raise cpu_bytes_to_use.",
    ),
    "promotion_pins": (
        "gauge",
        "CPU tier chunks the promotion guard holds for requests that wait for their "
        "promotions (released when vLLM schedules them).",
    ),
    "lookups_withheld": (
        "counter",
        "Lookups answered MISS without asking the disk: the chunk is outside what the "
        "request's plan can load through the CPU tier (promotion_guard).",
    ),
}

# Gauges that describe the whole store, not this process: with several engines
# of one vLLM instance on one store (data parallelism, sharing="node") only one
# engine reports them (see NvmeTierManager.reports_store_gauges).
STORE_GAUGES = frozenset(
    {
        "bytes_used",
        "capacity_bytes",
        "slots_used",
        "sharers",
        "root_budget_bytes",
        "root_used_bytes",
    }
)
