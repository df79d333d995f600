"""Results and their presentation: phase records, tables, plots, ``--summarize``.

Owns: ``PhaseResult``/``LookupStats`` and their JSON form, the text tables, the
GB/s plot and the median summary of earlier JSON reports, and what ``--plot``
needs (``pyplot``, ``check_plot``, ``PlotError``). Pure functions of their
inputs on the calling thread; ``plot`` and ``summarize`` read or write files.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from nvmetier.bench.common import GB, PCTS, _bs
from nvmetier.config import format_size


@dataclasses.dataclass
class PhaseResult:
    """One measured phase: a target (ours / fs / fio) moving bytes one way."""

    level: str
    target: str  # "nvmetier-threads", "nvmetier-uring", "fs", "fio"
    phase: str  # "write" (store) or "read" (load)
    bs: int
    bytes: int
    runtime_s: float
    ops: int
    clat_ns: dict[str, float]
    cpu_usr_s: float
    cpu_sys_s: float
    errors: int = 0
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    # vllm level: CPU seconds of the tier alone (see ``_TierClock``).
    tier_cpu_s: float | None = None

    def tier_cpu_per_gb(self) -> float | None:
        gb = self.bytes / GB
        if self.tier_cpu_s is None or gb <= 0:
            return None
        return self.tier_cpu_s / gb

    @property
    def bw_gbps(self) -> float:
        return self.bytes / self.runtime_s / GB if self.runtime_s > 0 else 0.0

    @property
    def iops(self) -> float:
        return self.ops / self.runtime_s if self.runtime_s > 0 else 0.0

    def cpu_per_gb(self) -> tuple[float, float]:
        gb = self.bytes / GB
        if gb <= 0:
            return 0.0, 0.0
        return self.cpu_usr_s / gb, self.cpu_sys_s / gb

    def to_json(self) -> dict[str, Any]:
        usr, sys_ = self.cpu_per_gb()
        return {
            "level": self.level,
            "target": self.target,
            "phase": self.phase,
            "bs": self.bs,
            "bytes": self.bytes,
            "runtime_s": round(self.runtime_s, 6),
            "ops": self.ops,
            "iops": round(self.iops, 1),
            "bw_bytes": round(self.bytes / self.runtime_s) if self.runtime_s > 0 else 0,
            "bw_gbps": round(self.bw_gbps, 4),
            "clat_ns": {k: round(v) for k, v in self.clat_ns.items()},
            "cpu": {
                "usr_s": round(self.cpu_usr_s, 4),
                "sys_s": round(self.cpu_sys_s, 4),
                "usr_s_per_gb": round(usr, 4),
                "sys_s_per_gb": round(sys_, 4),
                **(
                    {
                        "tier_s": round(self.tier_cpu_s, 4),
                        "tier_s_per_gb": round(self.tier_cpu_per_gb() or 0.0, 4),
                    }
                    if self.tier_cpu_s is not None
                    else {}
                ),
            },
            "errors": self.errors,
            **({"extra": self.extra} if self.extra else {}),
        }


def _percentiles(lat_s: Sequence[float] | np.ndarray) -> dict[str, float]:
    arr = np.asarray(lat_s, dtype=np.float64)
    if arr.size == 0:
        return {}
    vals = np.percentile(arr, PCTS)
    return {f"p{p:g}": float(v) * 1e9 for p, v in zip(PCTS, vals, strict=True)}


@dataclasses.dataclass
class LookupStats:
    hit_ns: dict[str, float]
    miss_ns: dict[str, float]
    results: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return {
            "hit_ns": {k: round(v) for k, v in self.hit_ns.items()},
            "miss_ns": {k: round(v) for k, v in self.miss_ns.items()},
            "results": self.results,
        }


def _phase_name(level: str, phase: str) -> str:
    """``store``/``load`` at the vllm level (vLLM's words), else ``write``/``read``."""
    if level == "vllm":
        return "store" if phase == "write" else "load"
    return phase


def _phase_line(r: PhaseResult) -> str:
    usr, sys_ = r.cpu_per_gb()
    c = r.clat_ns
    lat = ""
    if c:
        lat = "clat " + " ".join(f"{k}={_ns(v)}" for k, v in c.items())
    name = _phase_name(r.level, r.phase)
    return (
        f"{r.level:>6} {r.target:<17} {name:<5} bs={_bs(r.bs):<7} "
        f"bw={r.bw_gbps:6.3f}GB/s iops={r.iops:9.0f} {_bytes(r.bytes)} in {r.runtime_s:.2f}s "
        f"cpu usr={usr:.3f} sys={sys_:.3f} s/GB "
        + (f"tier={tier:.3f} s/GB " if (tier := r.tier_cpu_per_gb()) is not None else "")
        + lat
        + (f" errors={r.errors}" if r.errors else "")
    )


def _ns(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:.2f}ms"
    if v >= 1e3:
        return f"{v / 1e3:.0f}us"
    return f"{v:.0f}ns"


def _bytes(n: int) -> str:
    return format_size(n).replace(" ", "")


def _find(results: list[PhaseResult], target: str, phase: str, bs: int) -> PhaseResult | None:
    for r in results:
        if r.target == target and r.phase == phase and r.bs == bs:
            return r
    return None


def summary_table(results: list[PhaseResult], bss: list[int]) -> tuple[list[str], list[dict]]:
    """Side-by-side GB/s per chunk size, with ratios to fio and to the fs tier."""
    targets = []
    for r in results:
        if r.target not in targets:
            targets.append(r.target)
    ours = [t for t in targets if t.startswith("nvmetier")]
    lines = []
    rows: list[dict] = []
    head = "| phase | bs | " + " | ".join(f"{t} GB/s" for t in targets)
    ratios = []
    for o in ours:
        if "fio" in targets:
            ratios.append((o, "fio"))
        if "fs" in targets:
            ratios.append((o, "fs"))
    head += "".join(f" | {a}/{b}" for a, b in ratios) + " |"
    lines.append(head)
    lines.append("|" + "---|" * (2 + len(targets) + len(ratios)))
    for phase in ("write", "read"):
        for bs in bss:
            cells = []
            row: dict[str, Any] = {"phase": phase, "bs": bs}
            have = False
            for t in targets:
                found = _find(results, t, phase, bs)
                cells.append(f"{found.bw_gbps:.3f}" if found else "-")
                if found:
                    row[t] = round(found.bw_gbps, 4)
                    have = True
            if not have:
                continue
            for a, b in ratios:
                ra, rb = _find(results, a, phase, bs), _find(results, b, phase, bs)
                if ra and rb and rb.bw_gbps > 0:
                    q = ra.bw_gbps / rb.bw_gbps
                    cells.append(f"{q:.2f}")
                    row[f"{a}/{b}"] = round(q, 3)
                else:
                    cells.append("-")
            pname = _phase_name(results[0].level, phase)
            lines.append(f"| {pname} | {_bs(bs)} | " + " | ".join(cells) + " |")
            rows.append(row)
    return lines, rows


def cpu_table(results: list[PhaseResult]) -> list[str]:
    lines = [
        "| target | phase | bs | GB/s | IOPS | clat p50 | p90 | p99 | p99.9 "
        "| CPU usr+sys s/GB | tier CPU s/GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        usr, sys_ = r.cpu_per_gb()
        c = r.clat_ns
        tier = r.tier_cpu_per_gb()
        lines.append(
            f"| {r.target} | {r.phase} | {_bs(r.bs)} | {r.bw_gbps:.3f} | {r.iops:.0f} | "
            + " | ".join(_ns(c[k]) if k in c else "-" for k in ("p50", "p90", "p99", "p99.9"))
            + f" | {usr:.3f}+{sys_:.3f} | "
            + ("-" if tier is None else f"{tier:.3f}")
            + " |"
        )
    return lines


# matplotlib is an optional dependency: the ``bench`` extra.
BENCH_EXTRA_HINT = "pip install 'nvmetier[bench]'"


class PlotError(Exception):
    """``--plot PATH`` cannot be honoured: matplotlib is missing, or PATH cannot be written."""


def pyplot(path: str) -> Any:
    """matplotlib's pyplot on the non-interactive Agg backend.

    Raises:
        PlotError: matplotlib is not installed (the message names the extra to install).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotError(
            f"--plot {path}: matplotlib is not installed ({exc}); "
            f"install it with {BENCH_EXTRA_HINT}, or run without --plot"
        ) from exc
    return plt


def check_plot(path: str) -> None:
    """Fail before a run whose plot could not be written, not after it.

    Raises:
        PlotError: matplotlib is missing, or PATH's directory does not exist.
    """
    pyplot(path)
    where = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(where):
        raise PlotError(f"--plot {path}: directory {where} does not exist; create it first")


def save_figure(fig: Any, path: str) -> None:
    """``fig.savefig(path)``, an OSError turned into a PlotError naming the file."""
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise PlotError(f"--plot {path}: cannot write the plot ({exc.strerror or exc})") from exc
    finally:
        pyplot(path).close(fig)


def plot(results: list[PhaseResult], path: str, title: str) -> str:
    """Throughput vs chunk size, store and load panels. Returns a message.

    Raises:
        PlotError: matplotlib is missing or PATH cannot be written.
    """
    plt = pyplot(path)
    targets = []
    for r in results:
        if r.target not in targets:
            targets.append(r.target)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    level = results[0].level if results else ""
    for ax, phase in zip(axes, ("write", "read"), strict=True):
        for t in targets:
            pts = sorted((r.bs, r.bw_gbps) for r in results if r.target == t and r.phase == phase)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=t)
        ax.set_xscale("log", base=2)
        bss = sorted({r.bs for r in results})
        ax.set_xticks(bss)
        ax.set_xticklabels([_bs(b) for b in bss])
        ax.set_xlabel("chunk size (bs)")
        name = _phase_name(level, phase)
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[0].legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)
    return f"wrote {path}"


def _result_from_json(d: dict[str, Any]) -> PhaseResult:
    cpu = d.get("cpu", {})
    return PhaseResult(
        level=d["level"],
        target=d["target"],
        phase=d["phase"],
        bs=int(d["bs"]),
        bytes=int(d["bytes"]),
        runtime_s=float(d["runtime_s"]),
        ops=int(d["ops"]),
        clat_ns=dict(d.get("clat_ns", {})),
        cpu_usr_s=float(cpu.get("usr_s", 0.0)),
        cpu_sys_s=float(cpu.get("sys_s", 0.0)),
        errors=int(d.get("errors", 0)),
        extra=dict(d.get("extra", {})),
        tier_cpu_s=cpu.get("tier_s"),
    )


def summarize(paths: Sequence[str], plot_path: str | None = None) -> tuple[list[str], int]:
    """Median tables over several ``--output-format json`` reports.

    For each (target, phase, bs): the median GB/s with (min-max), the ratios
    of the medians (each of our engines to fio, to the fs tier, and uring to
    threads), and the median CPU per GB (whole process, and the tier's own at
    the vllm level). With ``plot_path``, the medians are plotted.

    Returns the report lines and an exit code (2: a file is unreadable).
    """
    import statistics

    runs: dict[tuple[str, str, int], list[PhaseResult]] = {}
    order: list[str] = []
    level = ""
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                report = json.load(f)
            results = [_result_from_json(r) for r in report["results"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return [f"nvmetier bench: cannot read {path}: {exc}"], 2
        for r in results:
            level = r.level
            if r.target not in order:
                order.append(r.target)
            runs.setdefault((r.target, r.phase, r.bs), []).append(r)
    bss = sorted({bs for _, _, bs in runs})
    med: dict[tuple[str, str, int], float] = {
        k: statistics.median(r.bw_gbps for r in v) for k, v in runs.items()
    }
    ours = [t for t in order if t.startswith("nvmetier")]
    pairs: list[tuple[str, str]] = [(o, ref) for o in ours for ref in ("fio", "fs") if ref in order]
    if "nvmetier-uring" in order and "nvmetier-threads" in order:
        pairs.append(("nvmetier-uring", "nvmetier-threads"))
    short = {t: t.removeprefix("nvmetier-") for t in order}
    lines = [f"{len(paths)} reports; GB/s median (min-max); ratios divide the medians", ""]
    lines.append(
        "| phase | bs | "
        + " | ".join(short[t] for t in order)
        + "".join(f" | {short[a]}/{short[b]}" for a, b in pairs)
        + " |"
    )
    lines.append("|" + "---|" * (2 + len(order) + len(pairs)))
    for phase in ("write", "read"):
        for bs in bss:
            if not any((t, phase, bs) in runs for t in order):
                continue
            cells = []
            for t in order:
                v = runs.get((t, phase, bs))
                if not v:
                    cells.append("-")
                    continue
                bws = [r.bw_gbps for r in v]
                cells.append(f"{med[(t, phase, bs)]:.3f} ({min(bws):.2f}-{max(bws):.2f})")
            for a, b in pairs:
                ma, mb = med.get((a, phase, bs)), med.get((b, phase, bs))
                cells.append(f"{ma / mb:.2f}" if ma and mb else "-")
            lines.append(f"| {_phase_name(level, phase)} | {_bs(bs)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "CPU s/GB (usr+sys), median: whole process, and (vllm level) the tier's own",
        "",
    ]
    both = ("nvmetier-uring", "nvmetier-threads")
    with_ratio = all(t in order for t in both)
    lines.append(
        "| phase | bs | "
        + " | ".join(f"{short[t]}" for t in order)
        + (" | uring/threads |" if with_ratio else " |")
    )
    lines.append("|" + "---|" * (2 + len(order) + with_ratio))

    def cpu_of(v: list[PhaseResult]) -> tuple[float, float | None]:
        proc = statistics.median(sum(r.cpu_per_gb()) for r in v)
        tiers = [x for r in v if (x := r.tier_cpu_per_gb()) is not None]
        return proc, statistics.median(tiers) if tiers else None

    for phase in ("write", "read"):
        for bs in bss:
            cells = []
            cpu: dict[str, tuple[float, float | None]] = {}
            for t in order:
                v = runs.get((t, phase, bs))
                if not v:
                    cells.append("-")
                    continue
                cpu[t] = proc, tier = cpu_of(v)
                cells.append(f"{proc:.2f}" + (f" (tier {tier:.2f})" if tier is not None else ""))
            if with_ratio and all(t in cpu for t in both):
                (pu, tu), (pt, tt) = cpu[both[0]], cpu[both[1]]
                q = f"{pu / pt:.2f}" if pt else "-"
                if tu is not None and tt:
                    q += f" (tier {tu / tt:.2f})"
                cells.append(q)
            elif with_ratio:
                cells.append("-")
            if any(c != "-" for c in cells):
                lines.append(
                    f"| {_phase_name(level, phase)} | {_bs(bs)} | " + " | ".join(cells) + " |"
                )
    if plot_path:
        medians = [
            dataclasses.replace(v[0], bytes=round(med[k] * GB), runtime_s=1.0)
            for k, v in runs.items()
        ]
        lines += ["", plot(medians, plot_path, f"median of {len(paths)} runs")]
    return lines, 0


def median_summary(results: list[PhaseResult], bss: list[int]) -> tuple[list[str], list[dict]]:
    """Medians over the rounds of one alternated run (``extra["round"]``).

    One row per (phase, bs, target): GB/s median (min-max), CPU s/GB median,
    the median of the per-round ratios to fio (each round's target over that
    round's fio: the two ran minutes apart, so the disk's drift cancels), and
    for our targets the median per-round ratio to the fastest LMCache backend
    of that round.
    """
    import statistics

    by: dict[tuple[str, str, int], dict[int, PhaseResult]] = {}
    order: list[str] = []
    for r in results:
        if r.target not in order:
            order.append(r.target)
        by.setdefault((r.target, r.phase, r.bs), {})[int(r.extra.get("round", 0))] = r
    peers = [t for t in order if t.startswith("lmcache-")]
    level = results[0].level if results else ""
    lines = [
        "Medians over the rounds: GB/s median (min-max); ratios are medians of per-round ratios",
        "",
        "| phase | bs | target | GB/s | CPU s/GB | x fio | x best LMCache |",
        "|---|---|---|---|---|---|---|",
    ]
    rows: list[dict] = []
    for phase in ("write", "read"):
        for bs in bss:
            for t in order:
                runs = by.get((t, phase, bs))
                if not runs:
                    continue
                bws = [r.bw_gbps for r in runs.values()]
                cpu = statistics.median(sum(r.cpu_per_gb()) for r in runs.values())
                fio = by.get(("fio", phase, bs), {})
                q_fio = [
                    r.bw_gbps / fio[k].bw_gbps
                    for k, r in runs.items()
                    if k in fio and fio[k].bw_gbps > 0
                ]
                q_peer: list[float] = []
                if t.startswith("nvmetier") and peers:
                    for k, r in runs.items():
                        best = max(
                            (
                                by[(p, phase, bs)][k].bw_gbps
                                for p in peers
                                if k in by.get((p, phase, bs), {})
                            ),
                            default=0.0,
                        )
                        if best > 0:
                            q_peer.append(r.bw_gbps / best)
                row: dict[str, Any] = {
                    "phase": phase,
                    "bs": bs,
                    "target": t,
                    "rounds": len(bws),
                    "gbps_median": round(statistics.median(bws), 4),
                    "gbps_min": round(min(bws), 4),
                    "gbps_max": round(max(bws), 4),
                    "cpu_s_per_gb": round(cpu, 4),
                }
                if q_fio and t != "fio":
                    row["x_fio"] = round(statistics.median(q_fio), 3)
                if q_peer:
                    row["x_best_lmcache"] = round(statistics.median(q_peer), 3)
                rows.append(row)
                lines.append(
                    f"| {_phase_name(level, phase)} | {_bs(bs)} | {t} | "
                    f"{row['gbps_median']:.3f} ({row['gbps_min']:.2f}-{row['gbps_max']:.2f}) | "
                    f"{cpu:.3f} | "
                    + (f"{row['x_fio']:.2f}" if "x_fio" in row else "-")
                    + " | "
                    + (f"{row['x_best_lmcache']:.2f}" if "x_best_lmcache" in row else "-")
                    + " |"
                )
    return lines, rows
