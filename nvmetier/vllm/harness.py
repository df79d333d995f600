"""A simulated vLLM engine around the real tiering orchestrator.

Owns: one ``TieringOffloadingSpec`` -> ``CPUPrimaryTierOffloadingManager`` ->
``TieringOffloadingManager`` stack built from an ``OffloadingConfig``, exactly
as vLLM's scheduler builds it, and a stand-in for the GPU worker that writes
chunk bytes into the primary region and reads them back. Used by the demo,
the vLLM tests and the benchmarks. Single-threaded; ``wait_*`` methods block
(they step the engine until the tiers finish).
"""

from __future__ import annotations

import hashlib
import itertools
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    get_offload_group_idx,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from nvmetier.vllm import compat

_END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def make_config(
    secondary_tiers: list[dict[str, Any]],
    *,
    chunk_bytes: int = 64 << 10,
    cpu_chunks: int = 64,
    model: str = "nvmetier/test-model",
    dtype: str = "float16",
    tp_size: int = 1,
    dp_index: int = 0,
    dp_size: int = 1,
    engine_id: str | None = None,
    enable_kv_cache_events: bool = False,
    extra: dict[str, Any] | None = None,
    max_model_len: int = 0,
    groups: Sequence[OffloadingGroupConfig] = (),
) -> OffloadingConfig:
    """An ``OffloadingConfig`` whose primary rows are ``chunk_bytes`` each
    (16 tokens a chunk; ``max_model_len`` 0: unknown; ``groups``: the KV
    groups, default one full-attention group)."""
    extra_config: dict[str, Any] = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": chunk_bytes * cpu_chunks,
        "secondary_tiers": secondary_tiers,
    }
    extra_config.update(extra or {})
    return OffloadingConfig(
        groups=tuple(groups) or (OffloadingGroupConfig(16, ("model.layers.0.attn",), 0),),
        worker_kv_bytes_per_block=chunk_bytes // tp_size,
        enable_kv_cache_events=enable_kv_cache_events,
        extra_config=extra_config,
        engine_id=engine_id or f"nvmetier-{uuid.uuid4().hex[:12]}",
        model=_model_config(model, dtype, max_model_len),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=tp_size,
            tp_size=tp_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=dp_index,
            data_parallel_size=dp_size,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def _model_config(name: str, dtype: str, max_model_len: int) -> OffloadingModelConfig:
    """vLLM 0.33 carries ``max_model_len`` in the offloading config; 0.32 has
    no such field (0: unknown, not passed)."""
    if max_model_len:
        return OffloadingModelConfig(name=name, dtype=dtype, max_model_len=max_model_len)  # type: ignore[call-arg,unused-ignore]
    return OffloadingModelConfig(name=name, dtype=dtype)


def key_of(i: int, group: int = 0) -> bytes:
    """A deterministic 32-byte block hash -> OffloadKey for integer ``i``."""
    return make_offload_key(int(i).to_bytes(8, "little") * 4, group)


_BASE: dict[int, np.ndarray] = {}


def payload_of(key: bytes, n: int) -> np.ndarray:
    """Deterministic bytes for ``key`` (what the GPU worker would have written).

    A fixed pseudo-random block XOR-ed with a word derived from the key: unique
    per key, and cheap enough not to dominate throughput figures.
    """
    base = _BASE.get(n)
    if base is None:
        base = np.random.default_rng(0x6E766D65).integers(0, 1 << 63, size=n // 8, dtype=np.uint64)
        _BASE[n] = base
    word = np.uint64(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little"))
    return (base ^ word).view(np.uint8)


def record_positions(ctx: ReqContext, keys: Sequence[bytes], tokens_per_chunk: int = 16) -> None:
    """Record ``keys`` in ``ctx`` as vLLM's connector does for a prompt
    (``update_offload_keys``): each key's end token, chunk after chunk from the
    prompt's first token, counted per KV group. The promotion guard plans a
    request from these; without them it falls back to per-request budgets."""
    counts: dict[int, int] = {}
    for key in keys:
        group = get_offload_group_idx(key)
        n = counts[group] = counts.get(group, 0) + 1
        ctx.set_offload_key_position(key, n * tokens_per_chunk)


class SimulatedEngine:
    """Drives the orchestrator the way the scheduler and GPU worker do."""

    def __init__(self, config: OffloadingConfig) -> None:
        self.spec = TieringOffloadingSpec(config)
        self.manager = compat.ensure_manager_lock(self.spec.get_manager())
        self.primary = self.manager.primary_tier
        view = self.primary.get_kv_memoryview()
        self.rows = np.frombuffer(view, dtype=np.uint8).reshape(view.shape)
        self.chunk_bytes = int(view.strides[0])
        # Tokens per chunk of the first KV group (16 for make_config's).
        groups = config.groups
        self.tokens_per_chunk = int(groups[0].tokens_per_block) * int(config.cache.blocks_per_chunk)
        self._req_ids = itertools.count()
        self.tiers = self.manager.secondary_tiers

    # ------------------------------------------------------------ plumbing
    def _req(self, prefix: str) -> ReqContext:
        ctx = ReqContext(req_id=f"{prefix}-{next(self._req_ids)}")
        self.manager.on_new_request(ctx)
        return ctx

    def step(self) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(_END)

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Step until no tier has work in flight."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.step()
            with self.manager.lock:
                if not self.manager.has_pending_work():
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"tiers still busy after {timeout_s:.0f}s")
            time.sleep(0.0002)

    # ------------------------------------------------------------ store
    def store(self, keys: Sequence[bytes], payloads: Sequence[np.ndarray] | None = None) -> int:
        """GPU -> primary store of ``keys`` (the cascade to the tiers follows).

        Returns the number of keys the primary accepted.
        """
        ctx = self._req("store")
        with self.manager.lock:
            out = self.manager.prepare_store(list(keys), ctx)
        if out is None:
            with self.manager.lock:
                self.manager.on_request_finished(ctx)
            return 0
        chunk_ids = out.store_spec.chunk_ids  # type: ignore[attr-defined]
        index = {k: i for i, k in enumerate(keys)}
        for key, cid in zip(out.keys_to_store, chunk_ids, strict=True):
            data = (
                payloads[index[key]] if payloads is not None else payload_of(key, self.chunk_bytes)
            )
            self.rows[int(cid)] = data
        with self.manager.lock:
            if out.keys_to_store:
                self.manager.complete_store(out.keys_to_store, ctx)
            self.manager.on_request_finished(ctx)
        return len(out.keys_to_store)

    def store_all(self, keys: Sequence[bytes], batch: int = 16) -> None:
        """Store many keys, waiting for room in the primary tier as needed."""
        for i in range(0, len(keys), batch):
            part = keys[i : i + batch]
            while self.store(part) == 0 and any(not self.primary_has(k) for k in part):
                self.step()
                time.sleep(0.0002)
        self.wait_idle()

    def primary_has(self, key: bytes) -> bool:
        ctx = ReqContext(req_id="probe")
        with self.manager.lock:
            return self.primary.lookup(key, ctx) is LookupResult.HIT

    def reset_primary(self) -> None:
        """Empty the primary tier (vLLM's reset_cache), so loads hit the tiers."""
        with self.manager.lock:
            self.manager.reset_cache()
            # 0.33 waits for the workers' in-flight jobs before promotions
            # resume (on_reset_flushed); 0.32 has no such hand-shake.
            if hasattr(self.manager, "on_reset_flushed"):
                self.manager.on_reset_flushed()

    # ------------------------------------------------------------ load
    def promote(
        self, keys: Sequence[bytes], timeout_s: float = 60.0, *, positions: bool = True
    ) -> dict[bytes, LookupResult]:
        """Look ``keys`` up until each is HIT or MISS (promoting from the tiers).

        ``keys`` are a prompt's chunks in order: their positions are recorded
        in the request's context as vLLM's connector records them, so the
        tier's promotion guard plans the request exactly as in a deployment
        (``positions=False``: a request with none, which the guard bounds by
        its budget alone and whose every key the disk is asked about).
        Returns the final lookup result per key.
        """
        ctx = ReqContext(req_id=f"load-{next(self._req_ids)}")
        if positions:
            record_positions(ctx, keys, self.tokens_per_chunk)
        with self.manager.lock:
            self.manager.on_new_request(ctx)
        result: dict[bytes, LookupResult] = {}
        pending = list(keys)
        deadline = time.monotonic() + timeout_s
        while pending:
            still = []
            with self.manager.lock:
                for key in pending:
                    r = self.manager.lookup(key, ctx)
                    if r in (LookupResult.HIT, LookupResult.MISS):
                        result[key] = r
                    else:
                        still.append(key)
                self.manager.on_schedule_end(ScheduleEndContext((ctx.req_id,), ()))
            pending = still
            if pending:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(pending)} keys still pending")
                time.sleep(0.0002)
        with self.manager.lock:
            self.manager.on_request_finished(ctx)
        return result

    def read_primary(self, keys: Sequence[bytes]) -> list[np.ndarray]:
        """Bytes of ``keys`` in the primary tier (what the GPU would load)."""
        ctx = ReqContext(req_id=f"read-{next(self._req_ids)}")
        with self.manager.lock:
            spec = self.manager.prepare_load(list(keys), ctx)
        out = [self.rows[int(c)].copy() for c in spec.chunk_ids]  # type: ignore[attr-defined]
        with self.manager.lock:
            self.manager.complete_load(list(keys), ctx)
        return out

    def verify(self, keys: Sequence[bytes]) -> int:
        """Count keys whose primary bytes equal their expected payload."""
        got = self.read_primary(keys)
        return sum(
            bool(np.array_equal(g, payload_of(k, self.chunk_bytes)))
            for k, g in zip(keys, got, strict=True)
        )

    def shutdown(self) -> None:
        # Drop the numpy export of the primary region before it is unmapped.
        del self.rows
        self.manager.shutdown()
