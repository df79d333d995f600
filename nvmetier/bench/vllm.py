"""The ``vllm`` level: vLLM's real orchestrator with our tier and with vLLM's ``fs`` tier.

Owns: ``run_vllm_level`` (store, then load, through ``TieringOffloadingManager``
with a simulated GPU worker) and the direct lookup timing. The CPU a tier
costs is counted by ``bench/clock.py``'s ``_TierClock`` (re-exported here).
Runs on the calling thread, which plays vLLM's scheduler thread; blocks for
the length of the run.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from nvmetier.bench.clock import _TierClock
from nvmetier.bench.common import _bs, _note_drop, parse_tier_options
from nvmetier.bench.cpuprof import CpuProfile
from nvmetier.bench.machine import (
    _settle_heap,
    busy_cores,
    machine_cpu,
    thread_cpu_s,
    xxh3_s_per_gb,
)
from nvmetier.bench.parties import MachineShare, share_line
from nvmetier.bench.report import LookupStats, PhaseResult, _percentiles, _phase_line


class _EngineProfile:
    """Per-worker rates (io_uring workers) and CPU by thread over one phase."""

    def __init__(self, tier: Any) -> None:
        store = getattr(tier, "store", None)
        engine = getattr(store, "engine", None)
        self._stats = getattr(engine, "worker_stats", None)
        self._w0 = self._stats() if self._stats else []
        self._t0 = thread_cpu_s()
        self._m0 = machine_cpu()
        self._share = MachineShare()

    def report(self, elapsed_s: float, log: Callable, moved_bytes: int) -> dict[str, Any]:
        out: dict[str, Any] = {"machine_busy_cores": round(busy_cores(self._m0, machine_cpu()), 2)}
        out["machine_share"] = self._share.report(moved_bytes)
        threads = thread_cpu_s()
        out["thread_cpu_s"] = {
            name: round(cpu - self._t0.get(name, 0.0), 3)
            for name, cpu in sorted(threads.items())
            if cpu - self._t0.get(name, 0.0) >= 0.005
        }
        if self._stats:
            rows = []
            for a, b in zip(self._w0, self._stats(), strict=True):
                moved = b["bytes"] - a["bytes"]
                cpu = b["cpu_s"] - a["cpu_s"]
                rows.append(
                    {
                        "ops": b["ops"] - a["ops"],
                        "gbps": round(moved / elapsed_s / 1e9, 3) if elapsed_s else 0.0,
                        "cpu_s": round(cpu, 3),
                        "cpu_s_per_gb": round(cpu / (moved / 1e9), 4) if moved else None,
                    }
                )
            out["workers"] = rows
            log(
                "  workers: "
                + ", ".join(
                    f"w{i} {r['gbps']:.2f} GB/s ({r['cpu_s_per_gb']} s/GB)"
                    for i, r in enumerate(rows)
                )
            )
        log(
            "  cpu by thread (s): "
            + ", ".join(f"{k} {v:.3f}" for k, v in out["thread_cpu_s"].items())
            + f"; machine: {out['machine_busy_cores']:.2f} of {os.cpu_count()} cores busy"
        )
        log(share_line(out["machine_share"]))
        return out


def _vllm_tier_dict(
    args: argparse.Namespace, which: str, roots: list[str], bs: int, n: int
) -> dict:
    if which == "fs":
        return {"type": "fs", "root_dir": roots[0]}
    cap = 2 * n * (bs + 4096 + 128) + (64 << 20)
    # The store phase cascades up to a primary's worth at once: a queue bound
    # below that drops stores by design (max_queued_bytes, 1 GiB by default),
    # and the load phase then counts misses rather than moving bytes.
    queued = max(1 << 30, args.primary)
    return {
        "type": "NvmeTierManager",
        "module_path": "nvmetier.vllm",
        "root_dir": roots if len(roots) > 1 else roots[0],
        "io_workers": getattr(args, "io_workers", "auto"),
        "capacity_bytes": cap,
        "max_queued_bytes": queued,
        "io_engine": which.removeprefix("nvmetier-"),
        "io_threads": args.iodepth,
        "queue_depth": args.iodepth,
        "o_direct": bool(args.direct),
        "persist": False,
        # --tier-option KEY=VALUE (e.g. encryption={"key_file": ...}).
        **parse_tier_options(getattr(args, "tier_option", None) or []),
    }


def run_vllm_level(
    args: argparse.Namespace, bs: int, which: str, log: Callable
) -> tuple[list[PhaseResult], LookupStats | None]:
    """Store then load ``--size`` bytes of ``bs`` chunks through vLLM's orchestrator."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

    from nvmetier.vllm.harness import SimulatedEngine, key_of, make_config, record_positions

    n = args.size // bs
    cpu_chunks = max(1, args.primary // bs)
    dirs = list(getattr(args, "dirs", None) or [args.dir])
    roots = [os.path.join(d, f"vllm-{which}-{bs}") for d in dirs]
    for root in roots:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root, exist_ok=True)
    tier = _vllm_tier_dict(args, which, roots, bs, n)
    eng = SimulatedEngine(make_config([tier], chunk_bytes=bs, cpu_chunks=cpu_chunks))
    m = eng.manager
    clock = _TierClock(eng.tiers[0])
    reason = getattr(getattr(eng.tiers[0], "store", None), "staging_reason", None)
    if reason:
        log(f"  {which} bs={_bs(bs)}: {reason}")
    keys = [key_of(i) for i in range(n)]
    index_of = {k: i for i, k in enumerate(keys)}
    base = np.frombuffer(os.urandom(bs), dtype=np.uint8)
    end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    step_s = args.step_ms / 1000.0
    results: list[PhaseResult] = []
    lookups: LookupStats | None = None

    def wait_idle(timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with m.lock:
                m.on_schedule_end(end)
                if not m.has_pending_work():
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{which}: tiers still busy after {timeout_s:.0f}s")
            time.sleep(step_s)

    try:
        _note_drop(args, log)
        # ---- store: GPU -> primary, cascaded by the orchestrator to the tier.
        batch = max(1, min(args.store_batch, cpu_chunks))
        # In a deployment the GPU's copy engine fills a row, not a CPU: write
        # the pattern into every row now, untimed, and only each chunk's 8-byte
        # stamp inside the timed phase, so the CPU figures are the tier's and
        # the orchestrator's rather than a simulated memcpy's.
        eng.rows[:] = base
        xxh3_cost = xxh3_s_per_gb(bs)
        _settle_heap()
        cprof = CpuProfile(bs, n * bs) if getattr(args, "profile", False) else None
        prof = _EngineProfile(eng.tiers[0])
        cpu = clock.start()
        t0 = time.perf_counter()
        i = 0
        req = 0
        full_waits = 0
        while i < n:
            part = keys[i : i + batch]
            ctx = ReqContext(req_id=f"store-{req}")
            req += 1
            with m.lock:
                m.on_new_request(ctx)
                out = m.prepare_store(part, ctx)
                if out is None:
                    m.on_request_finished(ctx)
                    m.on_schedule_end(end)
            if out is None:  # primary full of chunks still being cascaded
                full_waits += 1
                time.sleep(step_s)
                continue
            for key, cid in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
                eng.rows[int(cid), :8] = np.frombuffer(
                    index_of[key].to_bytes(8, "little"), dtype=np.uint8
                )
            with m.lock:
                if out.keys_to_store:
                    m.complete_store(out.keys_to_store, ctx)
                m.on_request_finished(ctx)
                m.on_schedule_end(end)
            i += batch
        wait_idle()
        elapsed = time.perf_counter() - t0
        usr, sys_ = cpu.stop()
        tier_s = clock.tier_s(cpu, usr, sys_)
        stored_bytes = n * bs
        extra: dict[str, Any] = {
            **clock.report(),
            **prof.report(elapsed, log, n * bs),
            "xxh3_s_per_gb": round(xxh3_cost, 4),
            "chunks": n,
            "tier_by_method": clock.by_method_us(n),
            "store_batch": batch,
            "primary_full_waits": full_waits,
        }
        if cprof is not None:
            extra["cpu_profile"] = cprof.report(n * bs, log, inside_s=clock.inside_corrected_s())
        if which != "fs":
            st = eng.tiers[0].store.stats()
            stored_bytes = int(st.get("bytes_written", 0))
            extra["dropped"] = {
                k: st.get(k, 0)
                for k in ("stores_dropped_set_busy", "stores_dropped_queue_full", "evictions")
            }
        res = PhaseResult(
            "vllm",
            which,
            "write",
            bs,
            stored_bytes,
            elapsed,
            stored_bytes // bs,
            {},
            usr,
            sys_,
            extra=extra,
            tier_cpu_s=tier_s,
        )
        log(_phase_line(res))
        log(clock.per_chunk_line("stored", n))
        results.append(res)

        # ---- load: empty the primary, then promote in batches of its capacity.
        _note_drop(args, log)
        eng.reset_primary()
        # Zero the rows (untimed) so that a verified row proves its load.
        eng.rows[:] = 0
        _settle_heap()
        # --load-requests K: K requests in flight, each of 1/K of the primary
        # (vLLM schedules several; the next request's promotions start while
        # an earlier one's drain). K = 1: one request of the whole primary at
        # a time, each waited out before the next (the figures before K).
        window = max(1, int(getattr(args, "load_requests", 1) or 1))
        per_req = max(1, cpu_chunks // window)
        loaded = misses = retries = 0
        job_lat: list[float] = []
        lookup_s = 0.0
        retry_s = args.retry_ms / 1000.0
        cprof = CpuProfile(bs, n * bs) if getattr(args, "profile", False) else None
        prof = _EngineProfile(eng.tiers[0])
        cpu = clock.start()
        busy = 0.0
        last: list[bytes] = []
        pipelined = window > 1
        if pipelined:
            t_phase = time.perf_counter()
            got = _load_window(m, eng, keys, per_req, window, retry_s, record_positions)
            wait_idle()
            busy = lookup_s = time.perf_counter() - t_phase
            loaded, misses, retries, job_lat, last = got
        for b in range(0, n if not pipelined else 0, per_req):
            part = keys[b : b + per_req]
            ctx = ReqContext(req_id=f"load-{b}")
            # A prompt of these chunks, positions recorded as vLLM's connector
            # does: the tier's promotion guard plans it exactly (untimed).
            record_positions(ctx, part, eng.tokens_per_chunk)
            t0 = time.perf_counter()
            with m.lock:
                m.on_new_request(ctx)
            pending = part
            promoted = []
            while pending:
                still = []
                with m.lock:
                    for key in pending:
                        r = m.lookup(key, ctx)
                        if r is LookupResult.RETRY:
                            still.append(key)
                        elif r is LookupResult.MISS:
                            misses += 1
                        else:
                            promoted.append(key)
                    m.on_schedule_end(ScheduleEndContext((ctx.req_id,), ()))
                retries += len(still)
                pending = still
                if pending:
                    # A real scheduler re-scans a deferred request once per
                    # step; re-scanning every 0.2 ms would starve the tier's
                    # lookup thread of the GIL.
                    time.sleep(retry_s)
            lookup_s += time.perf_counter() - t0
            wait_idle()
            dt = time.perf_counter() - t0
            busy += dt
            job_lat.append(dt)
            # Not timed: which promoted keys actually landed in the primary.
            probe = ReqContext(req_id=f"probe-{b}")
            with m.lock:
                landed = sum(m.primary_tier.lookup(k, probe) is LookupResult.HIT for k in promoted)
                m.on_request_finished(ctx)
            loaded += landed
            last = [k for k in promoted[:: max(1, len(promoted) // 32)]][:32]
        usr, sys_ = cpu.stop()
        tier_s = clock.tier_s(cpu, usr, sys_)
        # The phase's CPU by thread and party ends here: the check below
        # copies and compares 32 chunks (256 MiB at 8 MiB), untimed.
        engine_prof = prof.report(busy, log, loaded * bs)
        verified = _vllm_verify(eng, last, index_of, base)
        profiled = (
            {"cpu_profile": cprof.report(loaded * bs, log, inside_s=clock.inside_corrected_s())}
            if cprof is not None
            else {}
        )
        res = PhaseResult(
            "vllm",
            which,
            "read",
            bs,
            loaded * bs,
            busy,
            loaded,
            _percentiles(job_lat),
            usr,
            sys_,
            errors=n - loaded,
            extra={
                **clock.report(),
                **engine_prof,
                "xxh3_s_per_gb": round(xxh3_cost, 4),
                "chunks": n,
                "tier_by_method": clock.by_method_us(loaded),
                "chunks_per_request": per_req,
                "load_requests_in_flight": window,
                "lookup_misses": misses,
                "lookup_retries": retries,
                "lookup_and_submit_s": round(lookup_s, 4),
                "verified_sample": f"{verified}/{len(last)}",
                "latency_unit": "promotion batch",
                **profiled,
            },
            tier_cpu_s=tier_s,
        )
        log(_phase_line(res))
        log(clock.per_chunk_line("loaded", loaded))
        results.append(res)
        clock.remove()
        if which != "fs":
            lookups = _lookup_latency(eng, keys, n, args.lookups, per_request=min(256, cpu_chunks))
            log(
                f"  lookup {which} bs={_bs(bs)}: "
                f"hit p50 {lookups.hit_ns.get('p50', 0) / 1e3:.2f} us"
                f" p99 {lookups.hit_ns.get('p99', 0) / 1e3:.2f} us; miss p50 "
                f"{lookups.miss_ns.get('p50', 0) / 1e3:.2f} us p99 "
                f"{lookups.miss_ns.get('p99', 0) / 1e3:.2f} us; {lookups.results}"
            )
    finally:
        eng.shutdown()
        if not args.keep:
            for root in roots:
                shutil.rmtree(root, ignore_errors=True)
    return results, lookups


def _load_window(
    m: Any,
    eng: Any,
    keys: list[bytes],
    per_req: int,
    window: int,
    retry_s: float,
    record_positions: Callable,
) -> tuple[int, int, int, list[float], list[bytes]]:
    """Promote ``keys`` as vLLM's scheduler would with ``window`` requests of
    ``per_req`` chunks in flight: each step asks every active request's
    unanswered chunks (RETRY and HIT_PENDING are asked again the next step),
    counts the chunks of a request whose chunks all answered at once, through
    the primary, as vLLM schedules and loads it then (before a later request's
    promotions can evict them), ends the step with those requests as the
    step's scheduled ones (the waiting ones keep the guard's pins), retires
    them and admits the next. Returns (loaded, misses, retries, per-request latency,
    a sample of loaded keys to verify)."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

    again = (LookupResult.RETRY, LookupResult.HIT_PENDING)
    starts = list(range(0, len(keys), per_req))
    active: list[tuple[Any, list[bytes], list[bytes], float]] = []
    loaded = misses = retries = 0
    job_lat: list[float] = []
    last: list[bytes] = []
    nxt = 0
    while nxt < len(starts) or active:
        while len(active) < window and nxt < len(starts):
            b = starts[nxt]
            nxt += 1
            part = keys[b : b + per_req]
            ctx = ReqContext(req_id=f"load-{b}")
            record_positions(ctx, part, eng.tokens_per_chunk)
            with m.lock:
                m.on_new_request(ctx)
            active.append((ctx, part, [], time.perf_counter()))
        waiting = []
        scheduled = []
        with m.lock:
            for ctx, pending, promoted, t0 in active:
                still = []
                for key in pending:
                    r = m.lookup(key, ctx)
                    if r in again:
                        still.append(key)
                    elif r is LookupResult.MISS:
                        misses += 1
                    else:
                        promoted.append(key)
                retries += len(still)
                if still:
                    waiting.append((ctx, still, promoted, t0))
                    continue
                # Every chunk answered: vLLM schedules the request now and
                # loads its chunks (its prepare_load pins them), before the
                # next request's promotions may evict what is not pinned.
                # Counted here (untimed in spirit: a few primary lookups).
                probe = ReqContext(req_id=f"probe-{ctx.req_id}")
                loaded += sum(m.primary_tier.lookup(k, probe) is LookupResult.HIT for k in promoted)
                scheduled.append((ctx, promoted, t0))
            # Only the requests scheduled this step are new to vLLM's
            # scheduler; the waiting ones keep the guard's pins.
            m.on_schedule_end(ScheduleEndContext(tuple(e[0].req_id for e in scheduled), ()))
        active = waiting
        for ctx, promoted, t0 in scheduled:
            job_lat.append(time.perf_counter() - t0)
            with m.lock:
                m.on_request_finished(ctx)
            last = promoted[:: max(1, len(promoted) // 32)][:32]
        if active:
            time.sleep(retry_s)
    return loaded, misses, retries, job_lat, last


def _vllm_verify(
    eng: Any, sample: list[bytes], index_of: dict[bytes, int], base: np.ndarray
) -> int:
    """Count sample keys whose primary bytes are the ones stored."""
    if not sample:
        return 0
    got = eng.read_primary(sample)
    ok = 0
    for key, row in zip(sample, got, strict=True):
        want = base.copy()
        want[:8] = np.frombuffer(index_of[key].to_bytes(8, "little"), dtype=np.uint8)
        ok += bool(np.array_equal(row, want))
    return ok


def _lookup_latency(
    eng: Any, keys: list[bytes], n: int, count: int, per_request: int = 256
) -> LookupStats:
    """Time ``NvmeTierManager.lookup`` directly: stored keys (hits) and absent
    ones, in requests of ``per_request`` keys (at most the CPU tier's chunks).

    Each request is a prompt whose key positions are recorded as vLLM's
    connector records them, so the promotion guard takes its exact path (one
    plan at the request's first lookup, then one answer per key), and the CPU
    tier is emptied first so every stored key is a disk-only chunk the plan
    promotes (the stored keys of a request are distinct, in random order).
    Each figure is the call's time less the timer's own (the median of
    back-to-back ``perf_counter_ns`` reads). Nothing loads these HITs: the
    guard's "hits not loaded" warning is held back while they are timed.
    """
    from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext

    from nvmetier.vllm.harness import key_of, record_positions

    tier = eng.tiers[0]
    eng.reset_primary()
    rng = np.random.default_rng(7)
    per_request = max(1, min(per_request, n))
    hits: list[bytes] = []
    while len(hits) < count:
        hits.extend(keys[int(i)] for i in rng.choice(n, size=per_request, replace=False))
    hits = hits[:count]
    misses = [key_of(n + 1_000_000 + i) for i in range(count)]
    end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    outcomes: dict[str, int] = {}
    perf = time.perf_counter_ns
    pairs = [-(perf() - perf()) for _ in range(20_001)]
    timer_ns = sorted(pairs)[len(pairs) // 2]
    out: list[list[float]] = []
    quiet = _HoldBack("disk hits of")
    guard_log = logging.getLogger("nvmetier.vllm")
    guard_log.addFilter(quiet)
    try:
        with eng.manager.lock:
            for r, sample in enumerate((hits, misses)):
                lat = []
                for b in range(0, len(sample), per_request):
                    part = sample[b : b + per_request]
                    ctx = ReqContext(req_id=f"lookup-bench-{r}-{b}")
                    record_positions(ctx, part, eng.tokens_per_chunk)
                    tier.on_new_request(ctx)
                    for key in part:
                        t = perf()
                        res = tier.lookup(key, ctx)
                        lat.append(max(0, perf() - t - timer_ns) / 1e9)
                        outcomes[res.name] = outcomes.get(res.name, 0) + 1
                    tier.on_request_finished(ctx)  # a step per request (untimed)
                    tier.on_schedule_end(end)
                out.append(lat)
    finally:
        guard_log.removeFilter(quiet)
    return LookupStats(_percentiles(out[0]), _percentiles(out[1]), outcomes)


class _HoldBack(logging.Filter):
    """Drops the log records whose message contains ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in str(record.msg)
