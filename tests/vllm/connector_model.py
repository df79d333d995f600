"""A model of vLLM's OffloadingConnector scheduler, driving the real orchestrator.

Written from vLLM 0.33's ``distributed/kv_transfer/kv_connector/v1/offloading/
scheduler.py`` and ``v1/core/sched/scheduler.py`` (one full-attention KV
group, one request per prompt, prefill only), as an independent statement of
how vLLM calls the offloading manager step after step; it knows nothing of
nvmetier. Per scheduler step:

1. every waiting request, in arrival order, gets ``get_num_new_matched_tokens``:
   the prefix walk ``_maximal_prefix_lookup`` calls ``manager.lookup`` key after
   key until the first MISS; a HIT_PENDING or RETRY anywhere defers the request
   (None: asked again next step); otherwise the count of leading hits is the
   external hit. A request whose hit chunks another request is loading is
   deferred too (``_chunks_being_loaded``);
2. a scheduled request with a hit pins its chunks (``update_state_after_alloc``
   -> ``manager.prepare_load``), and computes the rest of its prompt;
3. ``build_connector_meta`` offers the chunks computed in the previous step to
   the CPU tier (``manager.prepare_store``), then ends the step
   (``manager.on_schedule_end``, which flushes the step's promotions);
4. the workers move the bytes; ``update_connector_output`` completes the loads
   (``complete_load``) and stores (``complete_store``, which cascades) of the
   step, and a request whose work is done finishes (``on_request_finished``).

``reads_land_in_step`` makes every tier read land before the step's output
(a fast disk, or a long model step): the case where vLLM, unguarded, can
defer a request for good.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

from nvmetier.vllm.harness import SimulatedEngine, payload_of

TOKENS_PER_CHUNK = 16  # the harness's group: 16 tokens a block, 1 block a chunk


@dataclass
class Prompt:
    """One request of the model."""

    ctx: ReqContext
    keys: list[bytes]
    arrival: int
    gpu_cached: int = 0  # leading chunks in the GPU prefix cache (never looked up)
    scheduled_step: int | None = None
    hit_chunks: int = 0  # chunks loaded from the offloading tiers
    correct_chunks: int = 0  # of those, with the bytes that were stored
    deferred_steps: int = 0
    to_store: list[bytes] = field(default_factory=list)
    storing: list[bytes] = field(default_factory=list)
    loading: list[bytes] = field(default_factory=list)
    finished: bool = False


class ConnectorModel:
    """Steps a ``SimulatedEngine``'s manager the way vLLM's scheduler does."""

    def __init__(self, engine: SimulatedEngine, *, reads_land_in_step: bool) -> None:
        self.engine = engine
        self.manager = engine.manager
        self.reads_land_in_step = reads_land_in_step
        self.step_no = 0
        self.waiting: list[Prompt] = []
        self.prompts: list[Prompt] = []
        self._computed_last_step: list[Prompt] = []
        self._being_loaded: set[bytes] = set()
        # Chunks each request read from the secondary tiers (every submit_load).
        self.chunks_read: dict[str, int] = defaultdict(int)
        for tier in self.manager.secondary_tiers:
            submit = tier.submit_load

            def counted(job, _submit=submit):  # type: ignore[no-untyped-def]
                self.chunks_read[job.req_context.req_id] += len(job.keys)
                _submit(job)

            tier.submit_load = counted  # type: ignore[method-assign]

    def _locked(self) -> AbstractContextManager[object]:
        # vLLM 0.33's manager has a lock the connector holds; 0.32's has none.
        lock = getattr(self.manager, "lock", None)
        return lock if lock is not None else nullcontext()

    def add(self, req_id: str, keys: list[bytes], gpu_cached: int = 0) -> Prompt:
        """A new request; its first ``gpu_cached`` chunks are GPU prefix-cache
        hits (``num_computed_tokens``), so its walk starts after them."""
        ctx = ReqContext(req_id=req_id)
        # update_offload_keys: the end token of every key (16 tokens a chunk).
        for j, key in enumerate(keys):
            ctx.set_offload_key_position(key, (j + 1) * TOKENS_PER_CHUNK)
        with self._locked():
            self.manager.on_new_request(ctx)
        p = Prompt(ctx, list(keys), self.step_no, gpu_cached)
        self.waiting.append(p)
        self.prompts.append(p)
        return p

    # ------------------------------------------------------------ the walk
    def _walk(self, p: Prompt) -> int | None:
        """``_maximal_prefix_lookup`` + the tail of ``_lookup_complete_chunks``."""
        hits = 0
        defer = False
        for key in p.keys[p.gpu_cached :]:
            result = self.manager.lookup(key, p.ctx)
            if result in (LookupResult.HIT, LookupResult.HIT_PENDING):
                hits += 1
                defer |= result is LookupResult.HIT_PENDING
            elif result is LookupResult.RETRY:
                defer = True
            else:
                break
        if defer:
            return None  # the walk returns None before the zero check
        if hits == 0:
            return 0
        if any(k in self._being_loaded for k in p.keys[p.gpu_cached : p.gpu_cached + hits]):
            return None
        return hits

    # ------------------------------------------------------------ one step
    def step(self) -> None:
        self.step_no += 1
        loads: list[Prompt] = []
        new_ids: list[str] = []
        with self._locked():
            still_waiting = []
            for p in self.waiting:
                hits = self._walk(p)
                if hits is None:
                    p.deferred_steps += 1
                    still_waiting.append(p)
                    continue
                p.scheduled_step = self.step_no
                p.hit_chunks = hits
                new_ids.append(p.ctx.req_id)
                start = p.gpu_cached
                if hits:
                    p.loading = p.keys[start : start + hits]
                    spec = self.manager.prepare_load(p.loading, p.ctx)
                    rows = [self.engine.rows[int(c)] for c in spec.chunk_ids]  # type: ignore[attr-defined]
                    p.correct_chunks = sum(
                        bool(np.array_equal(row, payload_of(k, self.engine.chunk_bytes)))
                        for k, row in zip(p.loading, rows, strict=True)
                    )
                    self._being_loaded.update(p.loading)
                    loads.append(p)
                p.to_store = p.keys[start + hits :]
            self.waiting = still_waiting
            # build_connector_meta: store what was computed last step, end the step.
            stores: list[tuple[Prompt, list[bytes]]] = []
            for p in self._computed_last_step:
                out = self.manager.prepare_store(p.to_store, p.ctx)
                if out is not None and out.keys_to_store:
                    for key, cid in zip(
                        out.keys_to_store,
                        out.store_spec.chunk_ids,  # type: ignore[attr-defined]
                        strict=True,
                    ):
                        self.engine.rows[int(cid)] = payload_of(key, self.engine.chunk_bytes)
                    stores.append((p, list(out.keys_to_store)))
            done_computing = self._computed_last_step
            self._computed_last_step = [p for p in self.prompts if p.scheduled_step == self.step_no]
            self.manager.on_schedule_end(ScheduleEndContext(tuple(new_ids), ()))
        if self.reads_land_in_step:
            for tier in self.manager.secondary_tiers:
                tier.store.wait_idle(timeout_s=10.0)  # type: ignore[attr-defined]
        # update_connector_output: this step's GPU loads and stores are done.
        with self._locked():
            for p in loads:
                self.manager.complete_load(p.loading, p.ctx)
                self._being_loaded.difference_update(p.loading)
                p.loading = []
            for p, keys in stores:
                self.manager.complete_store(keys, p.ctx)
            for p in done_computing:
                p.finished = True
                self.manager.on_request_finished(p.ctx)

    def run(self, max_steps: int, step_s: float = 0.0) -> None:
        """Step until every request finished, or ``max_steps``; each step
        lasts at least ``step_s`` (the model's forward pass)."""
        for _ in range(max_steps):
            if all(p.finished for p in self.prompts):
                return
            self.step()
            if step_s:
                time.sleep(step_s)

    def drain(self) -> None:
        """Let the tiers finish (cascades) after the requests."""
        self.engine.wait_idle()
