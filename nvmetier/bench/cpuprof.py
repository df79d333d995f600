"""``--profile`` for the tier and vllm levels: where the tier's CPU goes.

Owns ``CpuProfile`` (per-thread user and system CPU from
``/proc/self/task/*/stat`` around one phase, and the native counters of
hashing and copying, ``nvmetier._table/_uring.hash_profile``) and
``xxh3_floor`` (one XXH3 pass over the phase's chunk size, warm and cold,
with the tier's own native build, measured in the same run). Runs on the
benchmark's thread; reads ``/proc`` and never blocks otherwise. The native
counters cost nothing while off: they are switched on only for a profiled
phase.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from nvmetier.bench.machine import vllm_like_primary
from nvmetier.thread_cpu import thread_times

GB = 1e9


def _native_modules() -> list[Any]:
    mods = []
    from nvmetier import _table

    mods.append(_table)
    with contextlib.suppress(ImportError):
        from nvmetier import _uring

        mods.append(_uring)
    return mods


def xxh3_floor(bs: int, cold_bytes: int = 256 << 20) -> dict[str, Any]:
    """CPU s/GB of one XXH3 pass over ``bs``-byte chunks with the tier's own
    native build: ``warm`` (one chunk hashed again and again, in cache) and
    ``cold`` (each chunk of a ``cold_bytes`` region, larger than the caches
    and in 4 KiB pages as vLLM's CPU tier is, hashed once: as a chunk just
    DMA'd or written long ago is)."""
    from nvmetier import _table

    warm_chunk = memoryview(os.urandom(bs))
    n = max(4, cold_bytes // bs)
    t0 = time.thread_time()
    for i in range(n):
        _table.xxh3(warm_chunk, i)
    warm = (time.thread_time() - t0) / (n * bs / GB)
    # The memory the tier hashes: a /dev/shm region in 4 KiB pages, as vLLM's.
    big = vllm_like_primary(max(bs, cold_bytes // bs * bs), tag="xxh3-floor")
    view = memoryview(big)
    t0 = time.thread_time()
    for i, off in enumerate(range(0, len(big), bs)):
        _table.xxh3(view[off : off + bs], i)
    cold = (time.thread_time() - t0) / (len(big) / GB)
    view.release()
    big.close()
    return {
        "impl": _table.xxh3_impl(),
        "warm_s_per_gb": round(warm, 4),
        "cold_s_per_gb": round(cold, 4),
    }


class CpuProfile:
    """User and system CPU by thread, and the native hash/copy counters,
    between construction and ``report``. ``inside_s`` (vLLM level) is the
    scheduler thread's time inside the tier's methods: the main thread
    counts for that much and no more; at the tier level the main thread
    drives the store and counts whole."""

    def __init__(self, bs: int, phase_bytes: int = 256 << 20) -> None:
        # The XXH3 pass over as many bytes as the phase moves (32-256 MiB).
        self.floor = xxh3_floor(bs, min(256 << 20, max(32 << 20, phase_bytes)))
        self._mods = _native_modules()
        self._main = threading.get_native_id()
        for m in self._mods:
            m.hash_profile(True)
        self._t0 = thread_times()

    def report(
        self, moved_bytes: int, log: Callable, inside_s: float | None = None
    ) -> dict[str, Any]:
        t1 = thread_times()
        native: dict[str, int] = {}
        for m in self._mods:
            for k, v in m.hash_profile_read().items():
                native[k] = native.get(k, 0) + int(v)
            m.hash_profile(False)
        gb = max(moved_bytes, 1) / GB
        by_name: dict[str, list[float]] = {}
        main_u = main_s = 0.0
        for tid, (name, u, s, t) in t1.items():
            _n, u0, s0, t0 = self._t0.get(tid, (name, 0.0, 0.0, 0.0))
            # The precise total, split as the (coarse) ticks split it.
            ticks = (u - u0) + (s - s0)
            share = (u - u0) / ticks if ticks > 0 else 1.0
            du, ds = (t - t0) * share, (t - t0) * (1.0 - share)
            if tid == self._main:
                main_u, main_s = du, ds
                continue
            if du + ds <= 0:
                continue
            row = by_name.setdefault(name, [0.0, 0.0])
            row[0] += du
            row[1] += ds
        if inside_s is None:  # tier level: the main thread is the tier's caller
            by_name["main (caller)"] = [main_u, main_s]
        tier_u = sum(r[0] for r in by_name.values())
        tier_s = sum(r[1] for r in by_name.values())
        inside = inside_s or 0.0
        hash_s = native.get("hash_ns", 0) / 1e9
        copy_hash_s = native.get("copy_hash_ns", 0) / 1e9
        copy_s = native.get("copy_ns", 0) / 1e9
        total = tier_u + tier_s + inside
        out: dict[str, Any] = {
            "gb": round(gb, 3),
            "tier_s_per_gb": round(total / gb, 4),
            "user_s_per_gb": round(tier_u / gb, 4),
            "system_s_per_gb": round(tier_s / gb, 4),
            "scheduler_inside_tier_s_per_gb": round(inside / gb, 4),
            "hash_s_per_gb": round(hash_s / gb, 4),
            "copy_hash_s_per_gb": round(copy_hash_s / gb, 4),
            "copy_s_per_gb": round(copy_s / gb, 4),
            "other_user_s_per_gb": round(max(0.0, tier_u - hash_s - copy_hash_s - copy_s) / gb, 4),
            "native_bytes": {
                k: native.get(k, 0) for k in ("hash_bytes", "copy_hash_bytes", "copy_bytes")
            },
            "threads": {
                name: {
                    "user_s": round(u, 3),
                    "sys_s": round(s, 3),
                    "s_per_gb": round((u + s) / gb, 4),
                }
                for name, (u, s) in sorted(by_name.items())
            },
            "main_thread": {"user_s": round(main_u, 3), "sys_s": round(main_s, 3)},
            "xxh3": self.floor,
        }
        floor = self.floor["cold_s_per_gb"]
        out["floor_s_per_gb"] = round(floor + 0.02, 4)
        out["within_floor"] = total / gb <= floor + 0.02
        other = max(0.0, total - inside - hash_s - copy_hash_s - copy_s)
        out["other_s_per_gb"] = round(other / gb, 4)
        # What the tier spends beyond one XXH3 pass over the bytes it moved, that
        # pass timed where the tier makes it (the same bytes, in the same state).
        beyond = (total - hash_s - copy_hash_s) / gb if hash_s + copy_hash_s else None
        out["beyond_its_xxh3_s_per_gb"] = round(beyond, 4) if beyond is not None else None
        log(
            f"  cpu profile per GB ({gb:.2f} GB): tier {total / gb:.3f} = hash "
            f"{hash_s / gb:.3f} + copy+hash {copy_hash_s / gb:.3f} + copy {copy_s / gb:.3f} + "
            f"other {other / gb:.3f} + vLLM thread in tier {inside / gb:.3f} (tier threads' "
            f"user {tier_u / gb:.3f}, system {tier_s / gb:.3f}); beyond its own XXH3 pass: "
            + (f"{beyond:.3f}" if beyond is not None else "-")
            + f"; one XXH3 pass apart ({self.floor['impl']}): warm "
            f"{self.floor['warm_s_per_gb']:.3f}, cold {floor:.3f} (tier "
            + ("within" if out["within_floor"] else "above")
            + " cold + 0.02)"
        )
        log(
            "  cpu profile by thread (user/sys s): "
            + ", ".join(f"{k} {v[0]:.3f}/{v[1]:.3f}" for k, v in sorted(by_name.items()))
            + f"; main thread {main_u:.3f}/{main_s:.3f}"
        )
        return out
