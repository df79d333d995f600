"""What the promotion guard costs vLLM's scheduler thread, per lookup.

Through vLLM's real orchestrator and CPU tier with ``NvmeTierManager``: prompts
whose chunks are all on disk (a warm restart), each looked up as vLLM's
connector walks a dense model (key after key until the first MISS, the key
positions recorded in the request's context as the connector does), one
request at a time, the step ended after each walk until the request loads.
Times every ``NvmeTierManager.lookup`` call (the guard's plan included, made at
the request's first lookup), less the timer's own cost, and reports the median
and p99 per call and the mean per chunk the tier answered.

Runs on any nvmetier checkout (only the harness and vLLM's public calls), so
the same script measures two commits:

    python tools/bench_guard.py --prompt-chunks 39 --cpu-chunks 13 --requests 200
    python tools/bench_guard.py --prompt-chunks 256 --cpu-chunks 256 --requests 1024

(the second: 262,144 stored keys, requests of 256.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

from nvmetier.vllm.harness import SimulatedEngine, key_of, make_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-chunks", type=int, default=39)
    ap.add_argument("--cpu-chunks", type=int, default=13)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--chunk-bytes", type=int, default=4096)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-guard-") as root:
        tier = {
            "type": "NvmeTierManager",
            "module_path": "nvmetier.vllm",
            "root_dir": root,
            # Room for every prompt twice over (no eviction while timing).
            "capacity_bytes": max(
                256 << 20, 2 * args.requests * args.prompt_chunks * (args.chunk_bytes + 4096)
            ),
        }
        n = args.prompt_chunks
        prompts = [[key_of(100_000 * (r + 1) + i) for i in range(n)] for r in range(args.requests)]
        first = SimulatedEngine(make_config([tier], chunk_bytes=args.chunk_bytes, cpu_chunks=4096))
        for keys in prompts:
            first.store_all(keys, batch=64)
        first.shutdown()
        eng = SimulatedEngine(
            make_config([tier], chunk_bytes=args.chunk_bytes, cpu_chunks=args.cpu_chunks)
        )
        nvme = eng.tiers[0]
        inner = nvme.lookup
        perf = time.perf_counter_ns
        timer = min(-(perf() - perf()) for _ in range(10_000))
        calls: list[int] = []

        def timed(key: bytes, ctx: ReqContext) -> LookupResult:
            t = perf()
            r = inner(key, ctx)
            calls.append(perf() - t - timer)
            return r

        nvme.lookup = timed  # type: ignore[method-assign]
        m = eng.manager
        loaded = 0
        wall = time.perf_counter()
        for r, keys in enumerate(prompts):
            ctx = ReqContext(req_id=f"r{r}")
            for i, key in enumerate(keys):
                ctx.set_offload_key_position(key, (i + 1) * 16)
            with m.lock:
                m.on_new_request(ctx)
            for _ in range(1000):
                with m.lock:
                    hits, pending = 0, False
                    for key in keys:
                        res = m.lookup(key, ctx)
                        if res is LookupResult.MISS:
                            break
                        hits += 1
                        pending |= res is not LookupResult.HIT
                    if not pending:
                        if hits:
                            m.prepare_load(keys[:hits], ctx)
                        m.on_schedule_end(ScheduleEndContext((ctx.req_id,), ()))
                        break
                    m.on_schedule_end(ScheduleEndContext((), ()))
                nvme.store.wait_idle(timeout_s=10.0)
            with m.lock:
                if hits:
                    m.complete_load(keys[:hits], ctx)
                m.on_request_finished(ctx)
            loaded += hits
        wall = time.perf_counter() - wall
        eng.shutdown()
    calls.sort()
    out = {
        "prompt_chunks": n,
        "cpu_chunks": args.cpu_chunks,
        "requests": args.requests,
        "tier_lookups": len(calls),
        "chunks_loaded": loaded,
        "lookup_p50_us": round(statistics.median(calls) / 1e3, 3),
        "lookup_p99_us": round(calls[int(0.99 * (len(calls) - 1))] / 1e3, 3),
        "lookup_mean_us": round(sum(calls) / len(calls) / 1e3, 3),
        "tier_us_per_chunk_loaded": round(sum(calls) / max(1, loaded) / 1e3, 3),
        "timer_ns": timer,
        "wall_s": round(wall, 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
