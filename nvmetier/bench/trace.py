"""The ``trace`` level: capacity planning from request traces (Mooncake format):
the replay across replica processes (``run_trace_level``, ``_replica_main``),
its report (``trace_table``) and the capacity plot (``plot_curve``, both
in ``bench/trace_report.py``).

Reading, routing and pacing a trace are in ``bench/traces.py``; the exact-LRU
reference and the capacity curve in ``bench/lru.py`` (both pure). Their names
are re-exported here, where the bench and its tests have imported them, as is
``parse_tier_options`` (``bench/common.py``, shared with the ``vllm`` level).
The tier's CPU is counted by ``bench/clock.py``'s ``_TierClock``.

Threads and processes: ``run_trace_level`` runs on the calling thread and
blocks for the length of the replay. It starts one process per replica (from a
``forkserver`` that imported vLLM once); each plays one data-parallel engine's
scheduler thread on its own vLLM ``TieringOffloadingManager``, CPU primary and
nvmetier tier, all on the same root.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from nvmetier.bench.clock import _TierClock
from nvmetier.bench.common import parse_tier_options
from nvmetier.bench.lru import (
    NEVER,
    DepthProfile,
    Hits,
    _sum_hits,
    capacity_curve,
    lru_hits,
    prefix_depths,
)
from nvmetier.bench.machine import _settle_heap
from nvmetier.bench.report import _bytes
from nvmetier.bench.trace_report import plot_curve, trace_table
from nvmetier.bench.traces import (
    ROUTES,
    TraceError,
    TraceRequest,
    due_offsets_s,
    paced,
    parse_line,
    read_trace,
    route,
)

__all__ = [
    "NEVER",
    "ROUTES",
    "DepthProfile",
    "Hits",
    "TraceError",
    "TraceRequest",
    "capacity_curve",
    "chunk_sizes",
    "due_offsets_s",
    "lru_hits",
    "paced",
    "parse_line",
    "parse_scale",
    "parse_tier_options",
    "plot_curve",
    "prefix_depths",
    "read_trace",
    "route",
    "run_trace_level",
    "trace_table",
]

# Kept small so that a probe costs little disk: the probe only compares names.
_PROBE_CHUNKS = 64
# Tokens per chunk of the harness's KV group (make_config: 16-token blocks, one
# block a chunk): the unit of the end-token positions the connector records.
_HARNESS_CHUNK_TOKENS = 16


# -------------------------------------------------------------------- sizes
def parse_scale(text: str) -> float:
    """``"1/1024"`` or ``"0.5"`` -> a factor in (0, 1]."""
    try:
        if "/" in text:
            a, b = text.split("/", 1)
            value = float(a) / float(b)
        else:
            value = float(text)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"--scale {text!r}: use a fraction such as 1/1024 or 0.25") from None
    if not 0 < value <= 1:
        raise ValueError(f"--scale {text!r} must be in (0, 1]")
    return value


def chunk_sizes(bytes_per_token: int, block_tokens: int, scale: float) -> tuple[int, int]:
    """``(real, scaled)`` chunk bytes: one chunk per trace block; the scaled size
    is rounded to a multiple of 4096 (the tier's alignment), at least 4096."""
    real = bytes_per_token * block_tokens
    scaled = max(4096, round(real * scale / 4096) * 4096)
    return real, scaled


# ------------------------------------------------------------------ replicas
class _JobTally:
    """Bytes and keys of a tier's finished jobs, by kind.

    Wraps ``submit_store``/``submit_load``/``get_finished_jobs`` on the
    instance (after ``_TierClock``, so its own cost is not the tier's). The
    scheduler thread only.
    """

    def __init__(self, tier: Any) -> None:
        self.kind: dict[int, tuple[str, list[bytes]]] = {}
        self.bytes = {"load": 0, "store": 0}
        self.failed_jobs = {"load": 0, "store": 0}
        self.promoted: set[bytes] = set()
        store, load, finished = tier.submit_store, tier.submit_load, tier.get_finished_jobs

        def submit_store(job: Any) -> None:
            self.kind[job.job_id] = ("store", [])
            store(job)

        def submit_load(job: Any) -> None:
            self.kind[job.job_id] = ("load", list(job.keys))
            load(job)

        def get_finished_jobs() -> list[Any]:
            out = list(finished())
            for r in out:
                kind, keys = self.kind.pop(r.job_id, ("?", []))
                if kind == "?":
                    continue
                self.bytes[kind] += int(r.transfer_bytes or 0)
                if not r.success:
                    self.failed_jobs[kind] += 1
                if kind == "load":
                    ok = keys if r.success else list(r.successful_keys or ())
                    self.promoted.update(ok)
            return out

        tier.submit_store = submit_store
        tier.submit_load = submit_load
        tier.get_finished_jobs = get_finished_jobs


def _tier_dict(
    root: str,
    capacity_bytes: int,
    engine: str,
    iodepth: int,
    direct: bool,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "type": "NvmeTierManager",
        "module_path": "nvmetier.vllm",
        "root_dir": root,
        "capacity_bytes": capacity_bytes,
        "io_engine": engine,
        "io_threads": iodepth,
        "queue_depth": iodepth,
        "o_direct": direct,
        "persist": False,
        **(extra or {}),
    }


def _build(spec: dict[str, Any], tier: dict[str, Any]) -> Any:
    from nvmetier.vllm.harness import SimulatedEngine, make_config

    cfg = make_config(
        [tier],
        chunk_bytes=spec["chunk_bytes"],
        cpu_chunks=spec["cpu_chunks"],
        model="nvmetier/trace-replay",
        dp_index=spec["rank"],
        dp_size=spec["replicas"],
        # As vLLM names a data-parallel rank's engine: the CPU primary's region
        # is /dev/shm/vllm_offload_<engine_id>.mmap, one per engine.
        engine_id=f"{spec['engine_id']}_dp{spec['rank']}",
    )
    return SimulatedEngine(cfg)


def _store_info(eng: Any) -> dict[str, Any]:
    store = eng.tiers[0].store
    st = store.stats()
    return {
        "store_dir": str(store.describe().get("store_dir", "")),
        "slots_total": int(st["slots_total"]),
        "capacity_bytes": int(st["capacity_bytes"]),
    }


def _quiet_stdout() -> None:
    """Child: send stdout (where vLLM logs) to stderr, so that the parent's
    stdout carries only its report (``--output-format json``)."""
    sys.stdout.flush()
    os.dup2(2, 1)


def _probe_main(conn: Any, spec: dict[str, Any]) -> None:
    """Child: open the stack of one rank on a small store; report its store."""
    _quiet_stdout()
    try:
        eng = _build(spec, spec["tier"])
        try:
            conn.send(("ok", _store_info(eng)))
        finally:
            eng.shutdown()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _serve_request(
    eng: Any,
    tally: _JobTally,
    req_id: str,
    ids: Sequence[int],
    tokens: Sequence[int],
    step_s: float,
) -> dict[str, int]:
    """One request through the orchestrator, as vLLM's scheduler drives it.

    Look the blocks up in order until the first miss
    (``OffloadingConnectorScheduler._maximal_prefix_lookup``: a RETRY or
    HIT_PENDING defers the request to the next step, which scans again); load
    the hits out of the primary (``prepare_load``/``complete_load``) and verify
    every one byte for byte; store the rest (``prepare_store``, the "GPU"
    writes each chunk, ``complete_store``, which cascades them to the tier).
    """
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

    from nvmetier.vllm.harness import key_of, payload_of

    m = eng.manager
    rows = eng.rows
    chunk_bytes = eng.chunk_bytes
    keys = [key_of(i) for i in ids]
    ctx = ReqContext(req_id=req_id)
    # update_offload_keys: the connector records every key's end token, which
    # vLLM's CPU LRU orders by and the tier's recency refresh reads at
    # on_request_finished (--tier-option recency_refresh_chunks=0: off).
    for j, key in enumerate(keys, 1):
        ctx.set_offload_key_position(key, j * _HARNESS_CHUNK_TOKENS)
    idle_end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    scheduled = ScheduleEndContext(new_req_ids=(req_id,), preempted_req_ids=())
    HIT, PENDING, RETRY = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.RETRY
    with m.lock:
        m.on_new_request(ctx)
    # One request at a time per replica: what is promoted from now on is this
    # request's (its lookups are repeated until every promotion finished).
    tally.promoted.clear()
    deferrals = 0
    deadline = time.monotonic() + 120.0
    while True:
        hit = 0
        deferred = False
        with m.lock:
            for key in keys:
                r = m.lookup(key, ctx)
                if r is HIT or r is PENDING:
                    hit += 1
                    deferred |= r is PENDING
                elif r is RETRY:
                    deferred = True
                else:
                    break
            m.on_schedule_end(idle_end if deferred else scheduled)
        if not deferred:
            break
        deferrals += 1
        if time.monotonic() > deadline:
            raise TimeoutError(f"{req_id}: lookups still deferred after 120 s")
        time.sleep(step_s)
    hits = keys[:hit]
    from_disk = [k in tally.promoted for k in hits]
    wrong = 0
    if hits:
        with m.lock:
            spec = m.prepare_load(hits, ctx)
        for key, cid in zip(hits, spec.chunk_ids, strict=True):
            if not np.array_equal(rows[int(cid)], payload_of(key, chunk_bytes)):
                wrong += 1
        with m.lock:
            m.complete_load(hits, ctx)
    rest = keys[hit:]
    stored = store_waits = skipped = 0
    if rest:
        give_up = time.monotonic() + 5.0
        while True:
            with m.lock:
                out = m.prepare_store(rest, ctx)
            if out is not None:
                break
            # Every row holds a chunk still being cascaded: a step frees some.
            store_waits += 1
            if time.monotonic() > give_up:
                skipped = len(rest)
                break
            with m.lock:
                m.on_schedule_end(idle_end)
            time.sleep(step_s)
        if out is not None and out.keys_to_store:
            for key, cid in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
                rows[int(cid)] = payload_of(key, chunk_bytes)
            stored = len(out.keys_to_store)
            with m.lock:
                m.complete_store(out.keys_to_store, ctx)
    with m.lock:
        m.on_request_finished(ctx)
        m.on_schedule_end(idle_end)
    return {
        "hit": hit,
        "hit_tokens": sum(tokens[:hit]),
        "disk": sum(from_disk),
        "disk_tokens": sum(t for t, d in zip(tokens, from_disk, strict=False) if d),
        "wrong": wrong,
        "stored": stored,
        "store_waits": store_waits,
        "skipped": skipped,
        "deferrals": deferrals,
    }


def _replica_main(conn: Any, spec: dict[str, Any]) -> None:
    """Child: one data-parallel engine replaying its share of the trace.

    Protocol on ``conn``: send ``("ready", store info)``; receive ``("go",
    start_monotonic)``; replay; send ``("done", results)``; receive
    ``("close",)``; shut the stack down. Any failure sends ``("error", text)``.
    """
    eng = None
    _quiet_stdout()
    try:
        eng = _build(spec, spec["tier"])
        tier = eng.tiers[0]
        clock = _TierClock(tier)
        tally = _JobTally(tier)
        _settle_heap()
        conn.send(("ready", _store_info(eng)))
        msg = conn.recv()
        if msg[0] != "go":
            return
        start_s = float(msg[1])
        step_s = spec["step_s"]

        def idle(left_s: float) -> None:
            eng.step()
            time.sleep(min(step_s, left_s))

        per_req: list[dict[str, int]] = []
        lags: list[float] = []
        stats0 = tier.store.stats()
        cpu = clock.start()
        for i, lag in paced(spec["offsets_s"], start_s, time.monotonic, idle):
            lags.append(lag)
            rid = f"r{spec['rank']}-{i}"
            per_req.append(
                _serve_request(eng, tally, rid, spec["ids"][i], spec["tokens"][i], step_s)
            )
        busy_s = time.monotonic() - start_s
        eng.wait_idle(timeout_s=600.0)
        wall_s = time.monotonic() - start_s
        usr, sys_ = cpu.stop()
        tier_s = clock.tier_s(cpu, usr, sys_)
        stats1 = tier.store.stats()
        result = {
            "rank": spec["rank"],
            "hits": [r["hit"] for r in per_req],
            "hit_tokens": [r["hit_tokens"] for r in per_req],
            "disk_hits": [r["disk"] for r in per_req],
            "disk_tokens": [r["disk_tokens"] for r in per_req],
            "wrong_chunks": sum(r["wrong"] for r in per_req),
            "stored_chunks": sum(r["stored"] for r in per_req),
            "store_waits": sum(r["store_waits"] for r in per_req),
            "stores_skipped_primary_full": sum(r["skipped"] for r in per_req),
            "deferred_steps": sum(r["deferrals"] for r in per_req),
            "lags_s": lags,
            "busy_s": busy_s,
            "wall_s": wall_s,
            "promoted_bytes": tally.bytes["load"],
            "stored_bytes": tally.bytes["store"],
            "failed_jobs": tally.failed_jobs,
            "cpu_usr_s": usr,
            "cpu_sys_s": sys_,
            "sched_thread_s": cpu.thread_s,
            "tier_on_sched_thread_s": clock.inside_ns / 1e9,
            "tier_cpu_s": tier_s,
            "tier_stats": {
                k: int(stats1.get(k, 0)) - int(stats0.get(k, 0))
                for k in (
                    "evictions",
                    "stores_dropped_set_busy",
                    "stores_dropped_queue_full",
                    "stores_skipped_present",
                    "checksum_failures",
                    "read_errors",
                    "write_errors",
                    "chunks_touched",
                )
            },
            "slots_used": int(stats1.get("slots_used", 0)),
        }
        conn.send(("done", result))
        while conn.recv()[0] != "close":
            pass
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
    finally:
        if eng is not None:
            eng.shutdown()
        conn.close()


# ------------------------------------------------------------------ the replay
def _mp_context() -> Any:
    """A ``forkserver`` that imported vLLM once: replicas start in a fraction
    of a second, from a process without threads (forking the caller, which
    may hold threads, is unsafe)."""
    from nvmetier.bench.common import forkserver_context

    return forkserver_context(["nvmetier.vllm.harness", "nvmetier.bench.trace"])


def _recv(conn: Any, proc: Any, timeout_s: float, what: str) -> tuple[Any, ...]:
    """The next message of a child; raises if it failed, died or timed out."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.5):
        if not proc.is_alive():
            raise RuntimeError(f"{proc.name} exited ({proc.exitcode}) before {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{proc.name}: no {what} after {timeout_s:.0f}s")
    try:
        msg = conn.recv()
    except EOFError:
        raise RuntimeError(f"{proc.name} closed its pipe before {what}") from None
    if msg[0] == "error":
        raise RuntimeError(f"{proc.name} failed:\n{msg[1]}")
    return tuple(msg)


def _probe_sharing(
    ctx: Any, base: dict[str, Any], root: str, engine: str, direct: bool, extra: dict[str, Any]
) -> str:
    """``"shared"`` if ranks 0 and 1 of this data-parallel group open one store
    on one root, ``"per-rank"`` if each opens its own: asked of the tier itself
    (two small stores, one per child process), never assumed."""
    dirs = []
    shutil.rmtree(root, ignore_errors=True)
    try:
        for rank in (0, 1):
            cap = _PROBE_CHUNKS * (base["chunk_bytes"] + 4096) + (16 << 20)
            spec = dict(base, rank=rank, tier=_tier_dict(root, cap, engine, 2, direct, extra))
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_probe_main, args=(child, spec), name=f"probe-rank{rank}")
            proc.start()
            child.close()
            try:
                dirs.append(_recv(parent, proc, 300.0, "its store")[1]["store_dir"])
            finally:
                proc.join(60)
                parent.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return "shared" if dirs[0] == dirs[1] else "per-rank"


def _pcts_s(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values)
    return {
        "p50": round(float(np.percentile(arr, 50)), 4),
        "p99": round(float(np.percentile(arr, 99)), 4),
        "max": round(float(arr.max()), 4),
    }


def _replica_figures(
    res: dict[str, Any],
    requests: Sequence[TraceRequest],
    block_tokens: int,
    scaled: int,
    real: int,
    trace_s: float,
) -> dict[str, Any]:
    """Ratios, rates and CPU of one replica's results (or of their sum)."""
    blocks = sum(len(r.hash_ids) for r in requests)
    tokens = sum(r.input_length for r in requests)
    hit = Hits(sum(res["hits"]), sum(res["hit_tokens"]), blocks, tokens)
    disk = Hits(sum(res["disk_hits"]), sum(res["disk_tokens"]), blocks, tokens)
    promoted = res["promoted_bytes"] // scaled
    stored = res["stored_bytes"] // scaled
    chunks = promoted + stored
    wall = res["wall_s"]
    return {
        "requests": len(requests),
        "offload": hit.to_json(),
        "disk": disk.to_json(),
        "prompt_tokens_not_recomputed": hit.tokens,
        "chunks_promoted": promoted,
        "chunks_stored": stored,
        "promoted_gbps": round(res["promoted_bytes"] / wall / 1e9, 4) if wall else 0.0,
        "stored_gbps": round(res["stored_bytes"] / wall / 1e9, 4) if wall else 0.0,
        # What a drive must sustain at the real chunk size and the trace's own
        # pace (one hour of trace = one hour), averaged over the trace.
        "real_pace_read_gbps": round(promoted * real / trace_s / 1e9, 4) if trace_s else 0.0,
        "real_pace_write_gbps": round(stored * real / trace_s / 1e9, 4) if trace_s else 0.0,
        "vllm_thread_tier_us_per_chunk": (
            round(res["tier_on_sched_thread_s"] / chunks * 1e6, 2) if chunks else None
        ),
        "tier_cpu_us_per_chunk": round(res["tier_cpu_s"] / chunks * 1e6, 2) if chunks else None,
        "wrong_chunks": res["wrong_chunks"],
        "verified_chunks": hit.blocks - res["wrong_chunks"],
        "stores_waited_for_primary": res["store_waits"],
        "stores_skipped_primary_full": res["stores_skipped_primary_full"],
        "failed_jobs": res["failed_jobs"],
        "tier_stats": res["tier_stats"],
        "lag_s": _pcts_s(res["lags_s"]),
        "wall_s": round(wall, 3),
        "cpu_s": {
            "process": round(res["cpu_usr_s"] + res["cpu_sys_s"], 3),
            "scheduler_thread": round(res["sched_thread_s"], 3),
            "tier_on_scheduler_thread": round(res["tier_on_sched_thread_s"], 3),
            "tier": round(res["tier_cpu_s"], 3),
        },
    }


def _merge(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The replicas' results as one (sums; the longest wall time)."""
    out: dict[str, Any] = {}
    for key in ("hits", "hit_tokens", "disk_hits", "disk_tokens", "lags_s"):
        out[key] = [x for r in results for x in r[key]]
    for key in (
        "wrong_chunks",
        "store_waits",
        "stores_skipped_primary_full",
        "promoted_bytes",
        "stored_bytes",
        "cpu_usr_s",
        "cpu_sys_s",
        "sched_thread_s",
        "tier_on_sched_thread_s",
        "tier_cpu_s",
    ):
        out[key] = sum(r[key] for r in results)
    out["wall_s"] = max(r["wall_s"] for r in results)
    for key in ("failed_jobs", "tier_stats"):
        merged: dict[str, int] = {}
        for r in results:
            for k, v in r[key].items():
                merged[k] = merged.get(k, 0) + v
        out[key] = merged
    return out


def run_trace_level(
    args: argparse.Namespace, engine: str, report: dict[str, Any], log: Callable[[str], None]
) -> int:
    """Replay ``--trace`` across ``--replicas`` engine processes; fill
    ``report["trace"]``; print the tables (unless JSON) and plot the curve.

    Returns the exit code: 0, or 2 for a bad trace or option.
    """
    from nvmetier.config import parse_size

    n = args.replicas
    try:
        if not args.trace:
            raise ValueError("--level trace needs --trace FILE (Mooncake JSONL)")
        if n < 1:
            raise ValueError("--replicas must be >= 1")
        scale = parse_scale(args.scale)
        bpt = parse_size(args.bytes_per_token, "--bytes-per-token")
        bt = args.trace_block_tokens
        if bt < 1:
            raise ValueError("--trace-block-tokens must be >= 1")
        requests, notes = read_trace(args.trace, args.trace_requests)
        routes = route(
            requests, n, args.route, seed=args.seed, affinity_blocks=args.affinity_blocks
        )
        offsets = due_offsets_s(requests, args.speedup)
        capacity_arg = parse_size(args.capacity, "--capacity") if args.capacity else 0
        extra = parse_tier_options(args.tier_option or [])
    except (OSError, ValueError) as exc:
        print(f"nvmetier bench: {exc}", file=sys.stderr)
        return 2
    args._notes.extend(notes)
    real, scaled = chunk_sizes(bpt, bt, scale)
    eff_scale = scaled / real
    unique = len({b for r in requests for b in r.hash_ids})
    trace_s = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000.0
    capacity_real = capacity_arg or max(1, unique // 4) * real
    capacity_scaled = int(capacity_real * eff_scale)
    max_blocks = max(len(r.hash_ids) for r in requests)
    cpu_chunks = args.primary_chunks or max(64, 2 * max_blocks + 16)
    share = [[i for i, rr in enumerate(routes) if rr == rank] for rank in range(n)]
    log(
        f"trace: {args.trace}: {len(requests)} requests over {trace_s:.0f}s, "
        f"{sum(len(r.hash_ids) for r in requests)} blocks of {bt} tokens, {unique} distinct; "
        f"replayed at x{args.speedup:g} on {n} replicas ({args.route}: "
        f"{', '.join(str(len(s)) for s in share)} requests)"
    )
    log(
        f"chunk: {_bytes(real)} real ({bpt} B/token x {bt}), {_bytes(scaled)} replayed "
        f"(scale {eff_scale:.6g}); capacity {_bytes(capacity_real)} real = "
        f"{_bytes(capacity_scaled)} replayed; primary {cpu_chunks} chunks per replica"
    )
    root = os.path.join(args.dir, "trace")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root, exist_ok=True)
    ctx = _mp_context()
    import uuid

    base: dict[str, Any] = {
        "chunk_bytes": scaled,
        "cpu_chunks": cpu_chunks,
        "replicas": n,
        "engine_id": f"nvmetier-trace-{uuid.uuid4().hex[:8]}",
        "step_s": args.step_ms / 1000.0,
    }
    direct = bool(args.direct)
    t_setup = time.monotonic()
    sharing = (
        "single" if n == 1 else _probe_sharing(ctx, base, root + "-probe", engine, direct, extra)
    )
    per_store = capacity_scaled // n if sharing == "per-rank" else capacity_scaled
    tier = _tier_dict(root, per_store, engine, args.iodepth, direct, extra)
    what = "one store per rank" if sharing == "per-rank" else "one store for all ranks"
    log(f"stores: {sharing} ({what}), capacity_bytes {_bytes(per_store)} each")
    procs: list[tuple[Any, Any]] = []
    results: list[dict[str, Any]] = []
    infos: list[dict[str, Any]] = []
    try:
        for rank in range(n):
            tok = [requests[i].block_tokens(bt) for i in share[rank]]
            spec = dict(
                base,
                rank=rank,
                tier=tier,
                offsets_s=[offsets[i] for i in share[rank]],
                ids=[requests[i].hash_ids for i in share[rank]],
                tokens=tok,
            )
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_replica_main, args=(child, spec), name=f"replica-{rank}")
            proc.start()
            child.close()
            procs.append((proc, parent))
        for proc, conn in procs:
            infos.append(_recv(conn, proc, 600.0, "ready")[1])
        log(f"replicas ready in {time.monotonic() - t_setup:.1f}s; replaying")
        start = time.monotonic() + 0.5
        for _, conn in procs:
            conn.send(("go", start))
        budget = (offsets[-1] if offsets else 0.0) + 3600.0
        for proc, conn in procs:
            results.append(_recv(conn, proc, budget, "results")[1])
        for _, conn in procs:
            conn.send(("close",))
    finally:
        for proc, conn in procs:
            proc.join(120)
            if proc.is_alive():
                proc.terminate()
                proc.join(10)
            conn.close()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    # ---- what the tier did, next to the exact LRU of the same capacity
    dirs: dict[str, int] = {}
    for info in infos:
        dirs[info["store_dir"]] = max(dirs.get(info["store_dir"], 0), info["slots_total"])
    observed = "single" if n == 1 else ("shared" if len(dirs) == 1 else "per-rank")
    if observed != sharing:
        args._notes.append(f"the probe found {sharing} stores but the replay opened {observed}")
    total_slots = sum(dirs.values())
    own_slots = [
        info["slots_total"] if observed == "per-rank" else total_slots // n for info in infos
    ]
    subs = [[requests[i] for i in s] for s in share]
    bound_shared = lru_hits(requests, total_slots, bt)
    bound_split = _sum_hits([lru_hits(sub, c, bt) for sub, c in zip(subs, own_slots, strict=True)])
    bound_inf = lru_hits(requests, unique, bt)
    per = [
        _replica_figures(res, sub, bt, scaled, real, trace_s)
        for res, sub in zip(results, subs, strict=True)
    ]
    total = _replica_figures(_merge(results), requests, bt, scaled, real, trace_s)
    measured = total["offload"]["token_hit_ratio"]

    # ---- the capacity curve (no I/O): shared vs per-replica
    shared_prof = DepthProfile.of(requests, bt)
    split_prof = [DepthProfile.of(sub, bt) for sub in subs]
    lo = max(n, unique // 200)
    hi = max(unique * 1.05, total_slots * 1.1)
    pts = max(2, args.curve_points)
    caps = sorted({int(x) for x in np.rint(np.geomspace(lo, hi, pts))})
    curve = capacity_curve(shared_prof, split_prof, caps)
    out = {
        "trace": {
            "path": args.trace,
            "requests": len(requests),
            "blocks": sum(len(r.hash_ids) for r in requests),
            "distinct_blocks": unique,
            "input_tokens": sum(r.input_length for r in requests),
            "duration_s": round(trace_s, 3),
            "block_tokens": bt,
        },
        "replay": {
            "replicas": n,
            "route": args.route,
            "requests_per_replica": [len(s) for s in share],
            "speedup": args.speedup,
            "engine": engine,
            "tier_options": extra,
            "bytes_per_token": bpt,
            "chunk_bytes_real": real,
            "chunk_bytes_replayed": scaled,
            "scale": eff_scale,
            "capacity_bytes_real": capacity_real,
            "capacity_bytes_replayed": capacity_scaled,
            "tier_capacity_bytes_configured": per_store,
            "stores": observed,
            "store_slots": list(dirs.values()),
            "slots_total": total_slots,
            "slots_per_replica": own_slots,
            "capacity_bytes_real_effective": total_slots * real,
            "primary_chunks_per_replica": cpu_chunks,
        },
        "replicas": per,
        "total": total,
        "bound": {
            "shared": bound_shared.to_json(),
            "per_replica": bound_split.to_json(),
            "infinite": bound_inf.to_json(),
            "measured_over_shared_bound": (
                round(measured / bound_shared.token_ratio, 4) if bound_shared.token_ratio else None
            ),
        },
        "curve": {
            "capacity_blocks": caps,
            "capacity_bytes_real": [c * real for c in caps],
            **curve,
        },
    }
    report["trace"] = out
    if args.output_format != "json":
        print()
        print("\n".join(trace_table(out)))
    bad = total["wrong_chunks"]
    if bad:
        args._notes.append(f"{bad} promoted chunks did not verify byte for byte")
    if args.plot:
        log(plot_curve(out, args.plot))
    return 1 if bad else 0
