"""The vLLM adapter: ``NvmeTierManager``, a ``SecondaryTierManager``.

This subpackage is the only code of nvmetier that imports vLLM. Used as::

    {"type": "NvmeTierManager", "module_path": "nvmetier.vllm",
     "root_dir": "/mnt/nvme/kv", "capacity_bytes": "500GiB"}

in ``secondary_tiers`` of ``TieringOffloadingSpec`` (or ``{"type": "nvme", ...}``
once the plugin registered the short name).

Threads: every tier method runs under the orchestrator's lock on the
scheduler thread (the tier asks for no tier-poll thread) and never blocks on disk, except
``drain_jobs`` (waits for in-flight I/O, by contract) and ``shutdown``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import os
import weakref
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from typing_extensions import override
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import (
    JobResult,
    SecondaryTierManager,
    TransferJob,
)

from nvmetier import format as fmt
from nvmetier._table import FinishedJobs, NewRequest, ScheduleEnd, SubmitStore
from nvmetier.config import TierConfig
from nvmetier.engine import IoEngine
from nvmetier.errors import ConfigError
from nvmetier.files import private_store_name, reclaim_private_stores, stores_of_other_formats
from nvmetier.store import ENCRYPTION_ID, BlockStore, log_failed_job, log_refused_job
from nvmetier.store_outcomes import RawOutcome
from nvmetier.vllm import compat, recency
from nvmetier.vllm.backpressure import TIER_TYPES as TIER_TYPES
from nvmetier.vllm.backpressure import (  # re-exported: vLLM's configs name them here
    FailureBackpressureDetector as FailureBackpressureDetector,
)
from nvmetier.vllm.backpressure import (
    StorageBackpressureDetector as StorageBackpressureDetector,
)
from nvmetier.vllm.backpressure import (
    default_backpressure_detector,
    warn_top_level_backpressure,
)
from nvmetier.vllm.compat import TIER_LABEL, ConfigInfoMapping
from nvmetier.vllm.cpu_view import (
    POSITIONS_ATTR,
    PrimaryView,
    connector_groups,
    connector_max_model_len,
    find_primary,
)
from nvmetier.vllm.metrics import METRIC_PREFIX, METRICS, STORE_GAUGES
from nvmetier.vllm.promotion import (
    PromotionGuard,
    check_cpu_tier_size,
    kv_groups,
    longest_request_chunks,
)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

logger = logging.getLogger(__name__)

# Test hook: wraps each tier's I/O engine once built (fault injection).
ENGINE_WRAPPER: Callable[[IoEngine], IoEngine] | None = None


_warned_random_seed = False
_HIT, _MISS = LookupResult.HIT, LookupResult.MISS
# What on_new_request returns: vLLM reads only its policy (the default), so
# one instance serves every request.
_REQUEST_CONTEXT = RequestOffloadingContext()

# Tier labels handed out per offloading spec (vLLM's index of each tier), and
# a fallback counter for tiers built outside a TieringOffloadingSpec.
_claimed_labels: weakref.WeakKeyDictionary[Any, set[int]] = weakref.WeakKeyDictionary()
_unplaced_tiers = itertools.count(1)


def tier_label(offloading_spec: Any, tier_type: str, tier_config: dict[str, Any]) -> str:
    """The ``tier`` label value of this tier's metric series.

    The same value vLLM's orchestrator gives the tier in its own labelled
    series (``"<index + 1>:<type>"``, e.g. ``"1:nvme"``), so our series join
    vLLM's per tier. The index is found by matching this tier's config among
    the spec's ``secondary_tiers`` (each entry is claimed once, so two
    identical configs get their two indexes in order). A tier built outside a
    spec gets ``"<type>:<n>"``, unique in the process.
    """
    configs = getattr(offloading_spec, "secondary_tier_configs", None)
    if isinstance(configs, list):
        try:
            claimed = _claimed_labels.setdefault(offloading_spec, set())
        except TypeError:  # not weak-referenceable: nothing to remember
            claimed = set()
        ignored = ("type", "module_path", "backpressure")
        for i, cfg in enumerate(configs):
            if i in claimed or not isinstance(cfg, dict) or cfg.get("type") != tier_type:
                continue
            if {k: v for k, v in cfg.items() if k not in ignored} == tier_config:
                claimed.add(i)
                return f"{i + 1}:{tier_type}"
    return f"{tier_type}:{next(_unplaced_tiers)}"


def none_hash_seed_is_random() -> bool:
    """Whether vLLM derived its block hashes from a random per-process seed.

    vLLM seeds ``NONE_HASH`` with ``PYTHONHASHSEED`` when set, a fixed default
    for cryptographic hashes (sha256 family), and ``os.urandom`` for the
    non-cryptographic ones (xxhash) otherwise (``resolve_none_hash_seed`` in
    ``vllm/v1/core/kv_cache_utils.py``). Only the random case makes block
    hashes, hence our keys, unreproducible by any other process or restart.
    """
    try:
        from vllm.v1.core import kv_cache_utils as kcu
    except ImportError:  # pragma: no cover - depends on the vLLM build
        return False
    seed = getattr(kcu, "_NONE_HASH_SEED", None)
    if seed is None or os.getenv("PYTHONHASHSEED") is not None:
        return False
    return seed != getattr(kcu, "DEFAULT_NONE_HASH_SEED", seed)


def layout_identity(spec: OffloadingSpec, chunk_bytes: int) -> dict[str, Any]:
    """The layout identity of a spec: what must match for data to be reused.

    vLLM's ``FileMapper`` fields (model, dtype, tokens per hash, blocks per
    chunk, KV groups, parallel layout unless vLLM certifies it portable) plus
    the chunk size and our format version.
    """
    from vllm.v1.kv_offload.file_mapper import FileMapper

    mapper = FileMapper.from_offloading_spec(
        root_dir="",
        offloading_spec=spec,
        blocks_per_file=spec.blocks_per_chunk,
        parallel_agnostic=True,
    )
    identity = dict(mapper.get_run_config())
    identity["chunk_bytes"] = chunk_bytes
    identity["nvmetier_format"] = fmt.FORMAT_VERSION
    return identity


def store_name(
    identity: dict[str, Any], dp_index: int = 0, dp_size: int = 1, sharing: str = "process"
) -> str:
    """``<model>_<sha256 prefix>``: one store per layout identity, shared by
    every data-parallel rank with ``sharing="node"``; with ``"process"`` each
    rank of a data-parallel group keeps its own ``..._dp<i>`` store."""
    digest = hashlib.sha256(fmt.identity_json(identity)).hexdigest()[:12]
    model = str(identity.get("model_name", "model")).replace("/", "_") or "model"
    name = f"{model}_{digest}"
    # vLLM runs the ranks of a non-MoE model as independent engines whose
    # data_parallel_size reads 1 (reconfigure_for_independent_dp_rank); the
    # rank index alone then tells rank 1 from rank 0.
    in_dp = dp_size > 1 or dp_index > 0
    return f"{name}_dp{dp_index}" if in_dp and sharing == "process" else name


_warned_formats: set[str] = set()


def _warn_other_formats(roots: tuple[str, ...]) -> None:
    """One warning per store left by another format version (an upgrade):
    this version never uses it, and it sits outside ``capacity_bytes``.
    Never deleted automatically (it may belong to an older nvmetier still
    running on this machine)."""
    for path, version, size in stores_of_other_formats(roots):
        if path in _warned_formats:
            continue
        _warned_formats.add(path)
        logger.warning(
            "nvmetier: %s is a store of format version %d, which this nvmetier (format %d) "
            "never uses; it takes %.2f GiB outside capacity_bytes. Remove it when no older "
            "nvmetier uses it any more (nvmetier info %s lists it)",
            path,
            version,
            fmt.FORMAT_VERSION,
            size / (1 << 30),
            os.path.dirname(path),
        )


class NvmeTierManager(SecondaryTierManager):
    """A persistent, bounded, checksummed NVMe secondary tier.

    Every key of the tier config other than ``type``/``module_path``/
    ``backpressure`` arrives as a keyword argument; see ``TierConfig`` for the
    accepted ones. An unknown key raises ``ConfigError`` (a ``ValueError``)
    naming it.

    Without a ``backpressure`` section the tier still gets vLLM's
    ``EMABackpressureDetector`` (``default_backpressure_detector``), unless
    ``default_backpressure`` is false; a section the user wrote always wins.
    """

    medium: ClassVar[Medium] = Medium.STORAGE
    # No tier-poll thread: vLLM's thread exists for tiers that answer a remote
    # counterpart between steps (serve_external_requests). Ours has none, and
    # the scheduler acts on a finished job only at a step anyway (its lookups
    # and on_schedule_end poll every step), so a 1 kHz poll thread would only
    # add wake-ups and vLLM-thread CPU per chunk (docs/bench.md).
    tolerates_off_thread_polling: ClassVar[bool] = False

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **tier_config: Any,
    ) -> None:
        config = TierConfig.from_dict(tier_config)
        if backpressure_detector is None and config.default_backpressure:
            backpressure_detector = default_backpressure_detector(tier_type, config.locality)
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.config = config
        # Always set (LOCAL by default): vLLM matches a tier with no locality
        # against every per-request tier filter, REMOTE-only ones included.
        self.locality = Locality(self.config.locality.upper())
        self.tier_label = tier_label(offloading_spec, tier_type, tier_config)
        warn_top_level_backpressure(offloading_spec, self.tier_label)
        self._labels = (self.tier_label,)
        chunk_bytes = self.block_size_bytes
        if chunk_bytes % fmt.ALIGN_BYTES:
            raise ConfigError(
                f"the primary tier's chunk size {chunk_bytes} is not a multiple of "
                f"{fmt.ALIGN_BYTES}; nvmetier needs page-aligned chunks"
            )
        self.identity = layout_identity(offloading_spec, chunk_bytes)
        if self.config.encryption is not None:
            # A sealed store is its own store: a plaintext one is never reused.
            self.identity["encryption"] = ENCRYPTION_ID
        parallel = offloading_spec.config.parallel
        self.store_name = store_name(
            self.identity,
            parallel.data_parallel_index,
            parallel.data_parallel_size,
            self.config.sharing,
        )
        # vLLM builds the tiers before it draws the block-hash seed
        # (EngineCore: scheduler first, then init_none_hash), so the seed is
        # checked here and again at the first lookup or transfer.
        self.private_store = none_hash_seed_is_random()
        self._seed_checked = False
        if self.private_store:
            self._use_private_store()
            self._seed_checked = True
        self._events_enabled = self.config.enable_kv_events
        if self._events_enabled and not offloading_spec.kv_events_config.enable_kv_cache_events:
            logger.warning(
                "nvmetier: enable_kv_events is set on tier '%s' but KV cache events are "
                "disabled globally; the tier will not emit events",
                tier_type,
            )
            self._events_enabled = False
        if self._events_enabled != self.config.enable_kv_events:
            self.config = dataclasses.replace(self.config, enable_kv_events=False)
        self._primary_view = primary_kv_view
        # Private stores of processes that crashed are reclaimed by the next start.
        reclaim_private_stores(self.config.root_dir)
        self.store = self._open_store()
        self._reported: dict[str, int] = {}
        # vLLM adds up a gauge's series over the engines of an instance (one
        # series per engine label; 0.32 also one per API-server process), so a
        # store-wide figure reported by every data-parallel rank of one shared
        # store would count the store once per rank. Only rank 0 reports it;
        # the other ranks report 0, and a dashboard's sum is the store's.
        # (vLLM runs the ranks of a non-MoE model as independent engines with
        # data_parallel_size 1; data_parallel_index keeps the rank.)
        self.reports_store_gauges = not (
            self.config.sharing == "node" and parallel.data_parallel_index != 0
        )
        self._spec = offloading_spec
        self._guard = self._build_guard(offloading_spec, primary_kv_view)
        self._guard_wired = False
        self._hot = self._guard.hot
        # vLLM calls lookup once per chunk: the hot request's leased keys are
        # answered by the guard's native HotRequest itself, set as this
        # instance's lookup (it shadows the method below; vLLM calls
        # tier.lookup(key, req_context)); everything else is its fallback,
        # the guard's answer (_answer: True for HIT), which it maps to
        # vLLM's HIT or MISS.
        self._hot.hit = _HIT
        self._hot.miss = _MISS
        self._hot.fallback = self._answer
        # (A subclass that overrides lookup keeps its own: the instance's
        # HotRequest would shadow it.)
        if type(self).lookup is NvmeTierManager.lookup:
            self.lookup = self._hot  # type: ignore[method-assign]
        # Per request on the scheduler thread: one C call each, no guard frame
        # (a request's finish and an end of step, while the guard has no
        # round open: nvt_guard_calls.c).
        self._track = self._guard.track_call()
        self._finish = self._guard.finish_call()
        self._end_step = self._guard.end_step_call()
        self._wire_native_calls()
        self._refresh_chunks = self.config.recency_refresh_chunks
        # Per request still running: the key lists of its load jobs, whose
        # chunks their load marked recent already (the refresh at its finish
        # leaves them as they are where that keeps the request's order).
        self._loads_of: dict[str, list[Collection[OffloadKey]]] = {}
        _warn_other_formats(self.config.root_dir)

    @property
    def store(self) -> BlockStore:
        return self._store

    @store.setter
    def store(self, store: BlockStore) -> None:
        self._store = store
        # A sealed store's refresh marks every key (its table's keys are MACs
        # made per call, other objects than the load jobs'): its loads' key
        # lists are not kept (_loads_of).
        self._keeps_loads = not store.sealed
        # lookup runs once per chunk on the scheduler thread: call the native
        # table directly unless the store counts lookups (admit_after_lookups).
        # (A sealed store's calls map keys to their MACs first, natively.)
        self._lookup = store.lookup_call()
        # The guard's answer over this store's lookup, built at the next lookup.
        self._answer = self._first_lookup
        self._poll = store.poll_raw()
        # Per job and per step: the native calls themselves, no store frame
        # (vLLM's chunk_ids array goes to the table as it is).
        submit_store, self._submit_load, self._release = store.table_calls()
        self._submit_store = store.submit_store if store.counts_lookups else submit_store
        native = vars(self).get("_native_calls")
        if native is not None:  # (made at the end of __init__)
            finished, schedule_end, submit = native
            finished.poll = self._poll
            schedule_end.release = self._release
            submit.submit = self._submit_store

    def _wire_native_calls(self) -> None:
        """vLLM's per-step and per-job calls answered in C, with no Python
        frame of ours (nvmetier._table, native/nvt_tier_calls.c), each set on
        the instance where its method is this class's (a subclass that
        overrides one keeps it); the store setter points them at a new
        store's calls in place (an instance's callable stays the same object,
        whatever wraps it). Each does what the method below it does:

        - ``get_finished_jobs``: most steps nothing of ours finished, answered
          without a frame (the table's poll itself skips the engine while its
          completion hint reads none); a store job that succeeded gets its
          JobResult made there (unless a subclass has its own
          ``_report_finished``); loads and failures go to _report_finished.
        - ``on_new_request``: the guard's track (``track_call``), then the
          one request context every request gets.
        - ``on_schedule_end``: the step's leases released, the guard's
          end_step.
        - ``submit_store``: the block-hash seed checked before the first
          (``once``), then the table's submit; a refused job logged.
        """
        cls = type(self)
        # A subclass's own _report_finished gets every job: no JobResult
        # made past it.
        own_report = cls._report_finished is not NvmeTierManager._report_finished
        finished = FinishedJobs(
            self._poll, self._report_finished, (), None if own_report else JobResult
        )
        schedule_end = ScheduleEnd(self._release, self._end_step)
        submit = SubmitStore(
            self._submit_store, log_refused_job, None if self._seed_checked else self._seed_once
        )
        self._native_calls = (finished, schedule_end, submit)
        if cls.on_new_request is NvmeTierManager.on_new_request:
            self.on_new_request = NewRequest(self._track, _REQUEST_CONTEXT)  # type: ignore[method-assign]
        if cls.get_finished_jobs is NvmeTierManager.get_finished_jobs:
            self.get_finished_jobs = finished  # type: ignore[method-assign]
        if cls.on_schedule_end is NvmeTierManager.on_schedule_end:
            self.on_schedule_end = schedule_end  # type: ignore[method-assign]
        if cls.submit_store is NvmeTierManager.submit_store:
            self.submit_store = submit  # type: ignore[method-assign]

    def _seed_once(self) -> None:
        """The native submit_store's first call: the seed check, if no other
        data-path call made it yet."""
        if not self._seed_checked:
            self._check_seed()

    def _build_guard(self, spec: OffloadingSpec, view: memoryview) -> PromotionGuard:
        """Warn when the CPU tier is too small for one longest request, and
        build the promotion guard (counting only, with ``promotion_guard: false``)."""
        # vLLM's primary view is (num_chunks, row bytes).
        shape = view.shape
        cpu_chunks = shape[0] if shape and len(shape) >= 2 else view.nbytes // self.block_size_bytes
        chunk_bytes = int(getattr(spec, "kv_bytes_per_chunk", 0) or self.block_size_bytes)
        # vLLM's connector is building this tier: its groups carry the windows
        # that 0.32's offloading config lacks.
        walked = connector_groups()
        longest = longest_request_chunks(spec, walked, connector_max_model_len())
        check_cpu_tier_size(longest, cpu_chunks, chunk_bytes, self.tier_label)
        groups = kv_groups(spec, walked)
        return PromotionGuard(
            cpu_chunks,
            self.config.promotion_fraction,
            longest_request_chunks=longest,
            chunk_bytes=chunk_bytes,
            tier_label=self.tier_label,
            enabled=self.config.promotion_guard,
            groups=groups,
        )

    def _wire_guard(self) -> None:
        """First lookup: the orchestrator exists now; give the guard its view
        of the CPU tier (plans stay per-request budgets without one)."""
        self._guard_wired = True
        primary = find_primary(self._spec, self)
        if primary is None:
            logger.info(
                "nvmetier[%s]: no CPU primary tier found beside this tier; the promotion "
                "guard bounds each request by its budget alone",
                self.tier_label,
            )
            return
        # A plan reads the disk in one call that leases what it finds (a
        # promotion's plan: its walk's lookups of those keys this step ask the
        # disk nothing, and count their HITs through count_hits) or only
        # reads it (the protection of waiting requests). (The store is not
        # replaced after this: the seed check came first.)
        store = self.store
        self._guard.attach(
            PrimaryView(primary),
            store.contains_call(),
            store.contains_many_call(),
            store.lease_many_call(),
            store.count_hits,
        )

    def _open_store(self) -> BlockStore:
        return BlockStore(
            self.config,
            store_name=self.store_name,
            identity=self.identity,
            buffer=self._primary_view,
            row_bytes=self.block_size_bytes,
            engine_wrapper=ENGINE_WRAPPER,
        )

    def _check_seed(self) -> None:
        """First data-path call: vLLM has drawn its block-hash seed by now. A
        random one moves this process to a private store (once; the shared
        store got nothing from us yet, and is removed if we created it for
        nothing and nobody else uses it)."""
        self._seed_checked = True
        if not none_hash_seed_is_random():
            return
        shared = self.store
        shared.close(persist=not shared.files.created)
        self.private_store = True
        self._use_private_store()
        self.store = self._open_store()

    def _use_private_store(self) -> None:
        """Random block-hash seed: nobody else can ever hit our chunks, so keep
        them in a store of our own, removed at shutdown, instead of filling
        the shared one with unreachable data."""
        global _warned_random_seed
        if not _warned_random_seed:
            _warned_random_seed = True
            logger.warning(
                "nvmetier: vLLM uses a random per-process block-hash seed (a non-cryptographic "
                "prefix_caching_hash_algo such as xxhash, and PYTHONHASHSEED unset), so no other "
                "process and no restart can hit this process's chunks. They go to a private "
                "store that is removed at shutdown. To share the cache between processes and "
                "keep it warm across restarts, set PYTHONHASHSEED to the same value for every "
                "vLLM process, or use --prefix-caching-hash-algo sha256."
            )
        self.store_name = private_store_name(self.store_name)
        self.config = dataclasses.replace(self.config, sharing="process", persist=False)

    # ------------------------------------------------------------ lookups
    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        # HIT only for the chunks the request's plan will load through the CPU
        # tier (nvmetier.vllm.promotion says why: otherwise a read storm); the
        # guard's lookup_call asks the disk for those alone. The answer is
        # the guard's native HotRequest's (a hot request's leased key in C,
        # anything else through the guard's function), which __init__ also
        # sets as the instance's lookup: this method is what vLLM's interface
        # names, and what a subclass's override calls.
        return self._hot(key, req_context)  # type: ignore[no-any-return]

    @property
    def _answer(self) -> Callable[[OffloadKey, ReqContext], bool]:
        """The guard's answer (True for HIT) to every lookup the native hot
        path does not answer: this method's own path and the instance's."""
        return self._answer_fn

    @_answer.setter
    def _answer(self, answer: Callable[[OffloadKey, ReqContext], bool]) -> None:
        self._answer_fn = answer
        hot = getattr(self, "_hot", None)  # None while __init__ sets the store
        if hot is not None:
            hot.fallback = answer

    def _first_lookup(self, key: OffloadKey, req_context: ReqContext) -> bool:
        """The first lookup (and the first after the store was replaced):
        check the seed, give the guard its view, then answer through the
        guard's ``lookup_call`` from now on."""
        if not self._seed_checked:
            self._check_seed()
        if not self._guard_wired:
            self._wire_guard()
        # Write admission counts the lookups of absent chunks: those the guard
        # withholds without asking the disk count too.
        store = self.store
        withheld = store.count_lookup if store.counts_lookups else None
        self._answer = self._guard.lookup_call(self._lookup, withheld)
        return self._answer(key, req_context)

    @override
    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.store.touch(keys)

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._track(req_context.req_id, req_context)  # PromotionGuard.track, inlined
        return _REQUEST_CONTEXT

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        req_id = req_context.req_id
        self._finish(req_id)  # PromotionGuard.finish, in C while no round is open
        loaded = self._loads_of.pop(req_id, None) if self._loads_of else None
        # vLLM never asks the disk about chunks the GPU or the CPU tier served,
        # nor calls touch: refresh the disk's recency of every chunk the
        # request used, here, once per request (nvmetier.vllm.recency). A
        # request that recorded no key (None: this vLLM records none, which
        # recency warns about once) has nothing to refresh. The chunks its
        # own loads took were marked by them, in the same order: the table
        # leaves those as they are unless their set has another of its
        # chunks to mark (native/nvt_refresh.c).
        max_chunks = self._refresh_chunks
        if max_chunks and getattr(req_context, POSITIONS_ATTR, None) != {}:
            keys = recency.request_keys(req_context, max_chunks)
            if keys:
                if not self._seed_checked:
                    self._check_seed()
                self.store.touch(keys, loaded)

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        # Promotions of this step were submitted before this hook runs; a HIT
        # that was not promoted (primary full) stops protecting its slot.
        self._release()
        # Counts this step's HITs that were not loaded, drops the pins of the
        # requests vLLM scheduled (their own prepare_load holds the chunks)
        # or preempted, and pins the promotions that landed.
        self._end_step(context.new_req_ids, context.preempted_req_ids)  # PromotionGuard.end_step

    # ------------------------------------------------------------ transfers
    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        if not self._seed_checked:
            self._check_seed()
        job_id = job_metadata.job_id
        error = self._submit_store(job_id, job_metadata.keys, job_metadata.chunk_ids)
        if error is not None:  # the engine refused the ops: the job fails, not vLLM
            log_refused_job(job_id, error)

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        keys = job_metadata.keys
        ctx = job_metadata.req_context
        self._guard.note_load_job(job_id, keys, ctx)
        if self._refresh_chunks and ctx is not None and self._keeps_loads:
            loads = self._loads_of.get(ctx.req_id)
            if loads is None:
                self._loads_of[ctx.req_id] = [keys]
            else:
                loads.append(keys)
        error = self._submit_load(job_id, keys, job_metadata.chunk_ids)
        if error is not None:
            log_refused_job(job_id, error)

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        # What the instance's native FinishedJobs does (_wire_native_calls).
        done = self._poll()  # one native call: completions applied, finished jobs out
        if not done:
            return ()
        return self._report_finished(done)

    def _report_finished(self, done: Sequence[RawOutcome]) -> list[JobResult]:
        """vLLM's JobResults of the jobs a poll found finished: failures
        logged, the promotion guard told of every finished load first."""
        out: list[JobResult] = []
        append = out.append
        for raw in done:
            job_id, success, ok_keys, secs, moved, error, is_load = raw
            if error is not None:
                log_failed_job(raw)
            if is_load:  # the guard pins what landed for requests waiting on it
                self._guard.load_finished(job_id, success, ok_keys)
                if not success and self._loads_of:
                    # A chunk the load missed got no mark from it: the
                    # refresh must mark it. Which request the job was is not
                    # kept (per job, on this thread): every request running
                    # refreshes in full (a failed load is rare).
                    self._loads_of.clear()
            elif not success and not compat.REPORTS_STORE_FAILURES:
                self._report_store_failed()
            append(JobResult(job_id, success, ok_keys or None, secs, moved))
        return out

    def _report_store_failed(self) -> None:
        """vLLM 0.32 tells the detector about successful stores only: report
        a failed store job to it ourselves (0.33's orchestrator does)."""
        on_store_failed = getattr(self.bp_detector, "on_store_failed", None)
        if on_store_failed is not None:
            on_store_failed()

    @override
    def has_pending_work(self) -> bool:
        return self.store.has_pending_work()

    @override
    def drain_jobs(self) -> None:
        # vLLM drains the tiers before it resets the CPU tier: the guard's
        # pins go first, while the chunks they hold still exist.
        self._guard.release_all()
        while not self.store.wait_idle(timeout_s=5.0):
            logger.warning("nvmetier: drain_jobs still waiting for in-flight I/O after 5 s")

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        # Every chunk announced stored is announced removed when it leaves the
        # disk (eviction, invalidation, retention, purge), so vLLM may keep
        # its block hashes until then (removal_expected). The ownership is
        # the tier label: unique per tier of an engine, so two nvmetier tiers
        # do not end each other's copies in vLLM's tracking.
        locality, owner = self.locality, self.tier_label
        for removed, keys in self.store.take_events():
            yield compat.offloading_event(list(keys), Medium.STORAGE, removed, locality, owner)

    @override
    def shutdown(self) -> None:
        self._guard.release_all()
        self.store.close()

    # ------------------------------------------------------------ metrics
    @classmethod
    @override
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        # Every series carries vLLM's tier label, so two nvmetier tiers of one
        # engine report apart (their values are the tier_label of each).
        defs: dict[str, OffloadingMetricMetadata] = {}
        for name, (kind, doc) in METRICS.items():
            meta_cls = OffloadingCounterMetadata if kind == "counter" else OffloadingGaugeMetadata
            defs[METRIC_PREFIX + name] = meta_cls(
                documentation=doc + " Labelled by tier.", labelnames=(TIER_LABEL,)
            )
        return defs

    @override
    def get_stats(self) -> OffloadingConnectorStats | None:
        guard = self._guard.stats()  # first: it reports its leased HITs to the store
        now = self.store.stats()
        now.update(guard)
        stats = OffloadingConnectorStats()
        labels = self._labels
        for name, (kind, _doc) in METRICS.items():
            value = now.get(name, 0)
            if kind == "gauge":
                if name in STORE_GAUGES and not self.reports_store_gauges:
                    value = 0
                stats.set_gauge(METRIC_PREFIX + name, value, labels)
                continue
            reported = self._reported.get(name)
            # The first payload carries every counter, at 0 if nothing was
            # counted yet: a series exists on /metrics from the start (an
            # alert on hits_not_loaded can tell "0" from "not exported").
            if reported is None or value != reported:
                stats.increase_counter(METRIC_PREFIX + name, value - (reported or 0), labels)
                self._reported[name] = value
        return stats

    @classmethod
    @override
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("nvmetier_engine", "nvmetier_o_direct", "nvmetier_capacity_bytes", "nvmetier_ways")

    @override
    def config_info(self) -> ConfigInfoMapping:
        d = self.store.describe()
        return {
            "nvmetier_engine": str(d["engine"]),
            "nvmetier_o_direct": bool(d["o_direct"]),
            "nvmetier_capacity_bytes": int(self.store.sb.n_slots * self.store.sb.slot_bytes),
            "nvmetier_ways": int(self.store.sb.ways),
        }
