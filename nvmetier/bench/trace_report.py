"""The ``trace`` level's report: the Markdown tables (``trace_table``) and the
capacity plot (``plot_curve``) of a replay's result (``bench/trace.py``).

Pure functions of that result; run on the calling thread (matplotlib only
for the plot).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from nvmetier.bench.report import _bytes, pyplot, save_figure


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def trace_table(out: dict[str, Any]) -> list[str]:
    """The trace report as Markdown tables."""
    rp = out["replay"]
    lines = [
        "| replica | requests | block hit (disk) | token hit (disk) | tokens not recomputed "
        "| promoted GB/s | stored GB/s | vLLM-thread tier CPU us/chunk | tier CPU us/chunk "
        "| lag p99 s | verified |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = [(str(i), r) for i, r in enumerate(out["replicas"])] + [("total", out["total"])]
    for name, r in rows:
        o, d = r["offload"], r["disk"]
        lines.append(
            f"| {name} | {r['requests']} | {_pct(o['block_hit_ratio'])} "
            f"({_pct(d['block_hit_ratio'])}) | {_pct(o['token_hit_ratio'])} "
            f"({_pct(d['token_hit_ratio'])}) | {r['prompt_tokens_not_recomputed']} | "
            f"{r['promoted_gbps']:.3f} | {r['stored_gbps']:.3f} | "
            f"{r['vllm_thread_tier_us_per_chunk']} | {r['tier_cpu_us_per_chunk']} | "
            f"{r['lag_s'].get('p99', 0):.3f} | {r['verified_chunks']}/{o['hit_blocks']} |"
        )
    b, tot = out["bound"], out["total"]
    lines += [
        "",
        f"exact LRU of the same capacity ({rp['slots_total']} slots = "
        f"{_bytes(rp['capacity_bytes_real_effective'])} at {_bytes(rp['chunk_bytes_real'])} "
        f"chunks; stores: {rp['stores']}):",
        "",
        "| | block hit | token hit |",
        "|---|---|---|",
        f"| measured (primary + disk) | {_pct(out['total']['offload']['block_hit_ratio'])} "
        f"| {_pct(out['total']['offload']['token_hit_ratio'])} |",
        f"| exact LRU, one shared store | {_pct(b['shared']['block_hit_ratio'])} "
        f"| {_pct(b['shared']['token_hit_ratio'])} |",
        f"| exact LRU, one store per replica ({rp['slots_per_replica'][0]} slots each) "
        f"| {_pct(b['per_replica']['block_hit_ratio'])} "
        f"| {_pct(b['per_replica']['token_hit_ratio'])} |",
        f"| any cache of unbounded size | {_pct(b['infinite']['block_hit_ratio'])} "
        f"| {_pct(b['infinite']['token_hit_ratio'])} |",
        "",
        f"tier: {tot['tier_stats'].get('evictions', 0)} evictions, "
        f"{tot['tier_stats'].get('stores_dropped_set_busy', 0)} stores dropped (set busy), "
        f"{tot['tier_stats'].get('stores_dropped_queue_full', 0)} (queue full), "
        f"{tot['tier_stats'].get('checksum_failures', 0)} checksum failures; failed jobs "
        f"{tot['failed_jobs']}; lag behind the trace p50 {tot['lag_s'].get('p50', 0):.3f} s",
        f"real-size drive load at the trace's pace: read "
        f"{out['total']['real_pace_read_gbps']:.3f} GB/s, write "
        f"{out['total']['real_pace_write_gbps']:.3f} GB/s",
    ]
    return lines


def plot_curve(out: dict[str, Any], path: str) -> str:
    """The capacity curve (token hit ratio against capacity at the real chunk
    size, shared vs per-replica) with the measured point. Returns a message.

    Raises:
        PlotError: matplotlib is missing or PATH cannot be written.
    """
    plt = pyplot(path)
    import matplotlib.ticker

    c, rp, b = out["curve"], out["replay"], out["bound"]
    top = max(c["capacity_bytes_real"])
    unit, div = next(
        (u, d)
        for u, d in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1.0))
        if top >= d
    )
    x = np.asarray(c["capacity_bytes_real"], dtype=np.float64) / div
    n = rp["replicas"]
    fig, ax = plt.subplots(figsize=(8, 4.6))
    ax.plot(x, c["shared_token_ratio"], label=f"exact LRU, one store shared by {n} replicas")
    if n > 1:
        ax.plot(
            x,
            c["per_replica_token_ratio"],
            label=f"exact LRU, {n} stores of 1/{n} each",
            linestyle="--",
        )
    ax.axhline(
        b["infinite"]["token_hit_ratio"], color="grey", linestyle=":", label="unbounded cache"
    )
    ax.plot(
        [rp["capacity_bytes_real_effective"] / div],
        [out["total"]["offload"]["token_hit_ratio"]],
        marker="o",
        color="black",
        linestyle="none",
        label=f"measured through vLLM ({rp['stores']} stores)",
    )
    ax.set_xscale("log")
    ax.set_xlabel(f"tier capacity, {unit} (chunks of {_bytes(rp['chunk_bytes_real'])})")
    ax.set_ylabel("prompt tokens served from the tier")
    ax.set_ylim(0, max(0.05, b["infinite"]["token_hit_ratio"] * 1.1))
    ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    t = out["trace"]
    ax.set_title(
        f"{os.path.basename(t['path'])}: {t['requests']} requests, {n} replicas ({rp['route']})",
        fontsize=9,
    )
    fig.tight_layout()
    save_figure(fig, path)
    return f"wrote {path}"
