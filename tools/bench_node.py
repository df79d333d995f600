#!/usr/bin/env python3
"""Node scale: the tier level and the vLLM level beside fio at 1, 2, 4, 8 drives.

Owns: the plan (drive counts, bytes per run, what is skipped and why), the
runs (one ``nvmetier bench`` process per drive count and level, JSON out),
the time budget, and the node table and JSON file. ``scripts/bench-node.sh``
prepares the interpreter, the extensions and fio, then runs this; it runs
alone too, with an interpreter that imports nvmetier. Standard library only
(the plan and ``--dry-run`` need nothing else). One thread; blocks on each
run in turn.

Each drive count N gets N RAM-backed loop drives (``--loop-drives N``, root)
or the first N of ``--drives``, ``--io-workers N`` (one I/O worker per drive)
and fio with one job per drive (``--compare-fio``, run with the tier level:
the vLLM level is compared with the same fio rows). CPU per GB is the whole
bench process at the tier level (only the tier runs in it), the tier's alone
at the vLLM level (``_TierClock``: its threads plus vLLM's thread inside its
methods), and fio's own at fio.

Budget: the runs share ``--budget-s`` (default 390 s: with the setup, under
a minute, the whole command stays under 8 minutes). Each run's bytes are cut,
when needed, to what the rate measured so far moves in its share of the time
left; a run that would move under 64 MiB a drive is skipped, with why.

Rounds (``--rounds N``): each run is ``nvmetier bench --rounds N``, the tier
(or vLLM) and fio alternated N times, the order rotated each round, because
one round on a loop drive says little (fio's own GB/s moves by up to 25%
between rounds). A row then gives the median over the rounds, its range, and
the median of the per-round ratios to fio. ``--bytes-per-drive`` is a round's; the
budget holds the N rounds together (a run's bytes are cut to what N rounds
move in its share).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from statistics import median
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20
GiB = 1 << 30
LEVELS = ("tier", "vllm")
# Bytes each drive moves per run (a store pass then a load pass of them).
FULL_PER_DRIVE = 2 * GiB
QUICK_PER_DRIVE = 256 * MiB
# Below this per drive, a run says more about start-up than about bandwidth.
FLOOR_PER_DRIVE = 64 * MiB
# A guess for the first run's rate, before any is measured (bytes/s of wall
# time for a whole run, store and load passes and fio included).
FIRST_RATE = 300 * MiB
# Seconds a run costs whatever its bytes (the interpreter, drives made and
# removed; vLLM's import and the lookup timing at the vllm level), and how
# much slower the vllm level moves bytes than the tier level before it is
# measured (2.4x on 2 loaded cores).
FIXED_S = {"tier": 3.0, "vllm": 20.0}
VLLM_SLOWER = 3.0
# The vllm level's CPU primary tier, per drive: a load batch is at most the
# primary, so a fixed primary would give each drive less to read per batch as
# drives are added (512 MiB over 8 drives is 64 MiB each, and the batch's
# ramp and drain then cost more than its transfer). A node with 8 drives has a
# CPU tier of tens of GiB; this keeps each drive's batch the same at any count.
PRIMARY_PER_DRIVE = 512 * MiB


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": MiB, "g": GiB, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 512m, 2g)") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench-node",
        description="The tier level and the vLLM level beside fio at 1, 2, 4, 8 drives "
        "(RAM-backed loop drives, or the drives given): GB/s and CPU per GB.",
    )
    p.add_argument(
        "--drives",
        default=None,
        metavar="DIR,DIR,...",
        help="folders on the drives to use, one per drive (e.g. /mnt/nvme0,/mnt/nvme1); "
        "default: make RAM-backed loop drives (root)",
    )
    p.add_argument("--counts", default="1,2,4,8", help="drive counts (capped at what it has)")
    p.add_argument("--levels", default="tier,vllm", help="tier, vllm or both")
    p.add_argument("--bs", default="2m", type=parse_size, help="chunk size")
    p.add_argument(
        "--bytes-per-drive",
        default=None,
        type=parse_size,
        help=f"bytes each drive moves per run and round (default {FULL_PER_DRIVE >> 20} MiB, "
        f"--quick {QUICK_PER_DRIVE >> 20} MiB), cut to fit --budget-s",
    )
    p.add_argument("--quick", action="store_true", help="small runs: a check that it works")
    p.add_argument("--budget-s", type=float, default=390.0, help="seconds for all the runs")
    p.add_argument("--engine", default="auto", help="uring, threads, or auto (uring if usable)")
    p.add_argument("--fs-tier", action="store_true", help="vllm level: vLLM's fs tier beside")
    p.add_argument(
        "--load-requests",
        type=int,
        default=2,
        help="vllm level: requests in flight while loading, each of 1/K of the primary "
        "(default 2: the next request's promotions start while one drains, as vLLM "
        "schedules several; 1: one at a time)",
    )
    p.add_argument(
        "--primary-per-drive",
        default=PRIMARY_PER_DRIVE,
        type=parse_size,
        help="vllm level: CPU primary tier per drive (the primary is N times this at N "
        f"drives; default {PRIMARY_PER_DRIVE >> 20} MiB)",
    )
    p.add_argument(
        "--fio",
        default="auto",
        help="auto (the fio on PATH), none (no fio rows), or the path of a fio executable",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="each run's targets (ours and fio) alternated this many times, the order "
        "rotated; rows give medians, ranges and the median per-round ratio to fio",
    )
    p.add_argument("--out", default=None, help="the JSON file (default bench-out/node-UTC.json)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the JSON; run none")
    p.add_argument("--keep-reports", action="store_true", help="keep each run's bench JSON")
    return p


def _mem_available() -> int:
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def _loop_drives_why_not() -> str | None:
    if os.geteuid() != 0:
        return "loop drives need root (losetup, mount): run as root or give --drives"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"loop drives need {tool}, which is not installed: give --drives"
    return None


def _vllm_why_not() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return (
            f"vLLM is not importable by {sys.executable} (torch is too big to carry): "
            "run in an environment with vllm>=0.32 installed (PYTHON=.../bin/python "
            "scripts/bench-node.sh) for the vllm level, or carry the folder "
            "scripts/bench-node-vllm-pack.sh makes where torch is installed"
        )
    # Found is not importable: a carried vLLM can lack a dependency, or meet a
    # torch it does not work with. Import what the vllm level imports, apart.
    probe = "import nvmetier.vllm.harness"
    try:
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           cwd=ROOT, timeout=300)  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"importing vLLM with {sys.executable} took over 300 s"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no message"])[-1]
        return (
            f"vLLM is found but does not import with {sys.executable} ({last}); with "
            "scripts/bench-node-vllm-pack.sh's carry on a GPU machine, VLLM_TARGET_DEVICE=cpu"
        )
    return None


def _fio_what(choice: str) -> tuple[str | None, str]:
    if choice == "none":
        return None, "--fio none: fio rows are missing"
    if choice != "auto" and (os.path.basename(choice) != "fio" or not os.access(choice, os.X_OK)):
        raise SystemExit(
            f"bench-node: --fio {choice}: not an executable named fio (give its path, "
            "e.g. bench-node-pack/bin/fio, or auto or none)"
        )
    path = shutil.which("fio") if choice == "auto" else os.path.abspath(choice)
    if path is None:
        return None, (
            "fio is not on PATH and no pack brought one (scripts/bench-node-pack.sh): "
            "fio rows are missing"
        )
    try:
        ver = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
        return path, f"{path} ({ver.stdout.strip() or 'version unknown'})"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{path} does not run ({exc}): fio rows are missing"


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """What will run: counts, bytes, levels, and every skip with its reason."""
    notes: list[str] = []
    skipped: list[dict[str, str]] = []
    try:
        counts = sorted({int(c) for c in args.counts.split(",") if c.strip()})
    except ValueError:
        raise SystemExit(
            f"bench-node: --counts {args.counts!r}: use integers, e.g. 1,2,4,8"
        ) from None
    if not counts or counts[0] < 1:
        raise SystemExit(f"bench-node: --counts {args.counts!r}: drive counts are >= 1")
    levels = [lv.strip() for lv in args.levels.split(",") if lv.strip()]
    bad = [lv for lv in levels if lv not in LEVELS]
    if bad or not levels:
        raise SystemExit(f"bench-node: --levels {args.levels!r}: use tier, vllm or tier,vllm")
    if args.load_requests < 1:
        raise SystemExit(
            f"bench-node: --load-requests {args.load_requests}: requests in flight are >= 1"
        )
    if args.primary_per_drive < args.bs * args.load_requests:
        raise SystemExit(
            f"bench-node: --primary-per-drive {args.primary_per_drive}: less than one chunk "
            f"per request in flight (--bs {args.bs} x --load-requests {args.load_requests})"
        )
    if args.bs % 4096:
        raise SystemExit(f"bench-node: --bs {args.bs} is not a multiple of 4096")
    if args.rounds < 1:
        raise SystemExit(f"bench-node: --rounds {args.rounds}: give 1 or more (1: one round)")
    per_drive = args.bytes_per_drive or (QUICK_PER_DRIVE if args.quick else FULL_PER_DRIVE)
    per_drive = max(args.bs, per_drive // args.bs * args.bs)
    cpus = os.cpu_count() or 1
    if args.drives:
        drives = [d.strip() for d in args.drives.split(",") if d.strip()]
        missing = [d for d in drives if not os.path.isdir(d)]
        if missing:
            raise SystemExit(
                f"bench-node: --drives {', '.join(missing)}: not a directory (mount the "
                "drive and make the folder first)"
            )
        cap, why = len(drives), f"{len(drives)} drive(s) given"
        kind = "given drives: " + ", ".join(drives)
    else:
        drives = []
        why_not = _loop_drives_why_not()
        if why_not and not args.dry_run:
            raise SystemExit(f"bench-node: {why_not}")
        if why_not:
            notes.append(why_not)
        # The tmpfs behind the drives holds the tier's bytes and fio's: keep
        # both (and a margin) within half of the memory available.
        mem = _mem_available()
        primary = args.primary_per_drive if "vllm" in levels else 0
        by_mem = max(1, int(mem * 0.5 // (3 * per_drive + primary + 256 * MiB))) if mem else 8
        # One I/O worker per drive (and one fio job per drive): a core each.
        by_cpu = cpus
        cap = min(by_mem, by_cpu)
        why = f"{cpus} CPUs, {mem / GiB:.0f} GiB available"
        kind = "RAM-backed loop drives (tmpfs images, losetup --direct-io=on, ext4)"
    kept = [c for c in counts if c <= cap]
    for c in counts:
        if c > cap:
            skipped.append({"what": f"{c} drives", "why": f"capped at {cap} ({why})"})
    if not kept:
        kept = [cap]
    if "vllm" in levels:
        why_vllm = _vllm_why_not()
        if why_vllm:
            levels = [lv for lv in levels if lv != "vllm"]
            skipped.append({"what": "vllm level", "why": why_vllm})
    fio_path, fio_desc = _fio_what(args.fio)
    if fio_path is None:
        skipped.append({"what": "fio", "why": fio_desc})
    runs = [
        {"drives": n, "level": lv, "planned_bytes": per_drive * n, "fio": bool(fio_path)}
        for n in kept
        for lv in levels
    ]
    return {
        "drive_kind": kind,
        "drives": drives,
        "counts": kept,
        "levels": levels,
        "bs": args.bs,
        "bytes_per_drive": per_drive,
        "budget_s": args.budget_s,
        "rounds": args.rounds,
        "fio": fio_desc,
        "fio_path": fio_path,
        "python": sys.executable,
        "cpus": cpus,
        "runs": runs,
        "skipped": skipped,
        "notes": notes,
    }


def _engine(choice: str) -> str:
    if choice != "auto":
        return choice
    probe = "from nvmetier.engine import uring_status; print(uring_status()[0])"
    r = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=False
    )
    return "uring" if r.stdout.strip() == "True" else "threads"


def _size(n: int) -> str:
    """``2m``, ``256k`` or bytes: how ``nvmetier bench`` reads a size."""
    for shift, unit in ((30, "g"), (20, "m"), (10, "k")):
        if n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def bench_argv(args: argparse.Namespace, p: dict[str, Any], run: dict[str, Any], size: int,
               engine: str) -> list[str]:  # fmt: skip
    n, level = run["drives"], run["level"]
    argv = [
        "--level", level, "--rw", "rw", "--bs", _size(args.bs), "--size", _size(size),
        "--engine", engine, "--io-workers", str(n), "--output-format", "json",
        "--profile",
    ]  # fmt: skip
    if p["drives"]:
        argv += ["--dirs", ",".join(p["drives"][:n])]
    else:
        argv += ["--loop-drives", str(n)]
    # fio runs once per drive count: with the tier level, or with the vllm
    # level when the tier level is not run.
    if run["fio"] and (level == "tier" or "tier" not in p["levels"]):
        argv.append("--compare-fio")
    if level == "vllm":
        argv += ["--lookups", "2000", "--primary", _size(args.primary_per_drive * n)]
        argv += ["--load-requests", str(args.load_requests)]
        if not args.fs_tier:
            argv.append("--no-fs-tier")
    if args.rounds > 1:
        argv += ["--rounds", str(args.rounds)]
    return argv


def rows_of(report: dict[str, Any], n: int, level: str) -> list[dict[str, Any]]:
    """One row per target: store and load GB/s and CPU s/GB. With several
    rounds (``--rounds``), each figure is the median over the rounds, with
    the GB/s range and, where fio ran in the same report, the median of the
    per-round ratios to fio (each round's GB/s over fio's in that round)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in report.get("results", []):
        side = "store" if r["phase"] == "write" else "load"
        groups.setdefault((r["target"], side), []).append(r)
    by: dict[str, dict[str, Any]] = {}
    for (target, side), rs in groups.items():
        if target == "fio":
            kind = "fio"
        elif "tier_s_per_gb" in rs[0]["cpu"]:
            kind = "tier"
        else:
            kind = "process"
        row = by.setdefault(
            target,
            {"drives": n, "level": level, "target": target, "cpu_of": kind, "errors": 0},
        )
        gbps = [r["bw_gbps"] for r in rs]
        s_per_gb = [
            r["cpu"]["tier_s_per_gb"]
            if kind == "tier"
            else r["cpu"]["usr_s_per_gb"] + r["cpu"]["sys_s_per_gb"]
            for r in rs
        ]
        row[f"{side}_gbps"] = round(median(gbps), 3)
        row[f"{side}_cpu_s_per_gb"] = round(median(s_per_gb), 4)
        row[f"{side}_bytes"] = rs[0]["bytes"]  # a round's
        row["errors"] += sum(r.get("errors", 0) for r in rs)
        extras = [r.get("extra", {}) for r in rs]
        if len(rs) > 1:
            row[f"{side}_rounds"] = len(rs)
            row[f"{side}_gbps_range"] = [round(min(gbps), 3), round(max(gbps), 3)]
            fio = {
                f.get("extra", {}).get("round"): f["bw_gbps"] for f in groups.get(("fio", side), [])
            }
            ratios = [
                r["bw_gbps"] / fio[e.get("round")]
                for r, e in zip(rs, extras, strict=True)
                if target != "fio" and fio.get(e.get("round"))
            ]
            if ratios:
                row[f"{side}_vs_fio"] = round(median(ratios), 2)
                row[f"{side}_vs_fio_rounds"] = [round(x, 2) for x in ratios]
        # One XXH3 pass over the bytes, measured in the run.
        xxh3 = [e["xxh3_s_per_gb"] for e in extras if e.get("xxh3_s_per_gb") is not None]
        if xxh3:
            row["xxh3_s_per_gb"] = round(median(xxh3), 4)
        profs = [e["cpu_profile"] for e in extras if e.get("cpu_profile")]
        if profs:  # --profile: the tier's threads split, XXH3 cold apart (item 2's floor)
            beyond = [
                x["beyond_its_xxh3_s_per_gb"]
                for x in profs
                if x.get("beyond_its_xxh3_s_per_gb") is not None
            ]
            if beyond:
                row[f"{side}_beyond_xxh3_s_per_gb"] = round(median(beyond), 4)
            within = [x.get("within_floor") for x in profs]
            # Several rounds: within only if within in every round.
            row[f"{side}_within_floor"] = (
                within[0] if len(within) == 1 else all(w is True for w in within)
            )
            row["xxh3_cold_s_per_gb"] = round(
                median([x["xxh3"]["cold_s_per_gb"] for x in profs]), 4
            )
    return list(by.values())


def add_fio_ratios(rows: list[dict[str, Any]]) -> None:
    """``store_vs_fio``/``load_vs_fio``: GB/s over fio's at the same drive count
    (a row whose rounds ran beside fio keeps its median per-round ratio)."""
    fio = {r["drives"]: r for r in rows if r["target"] == "fio"}
    for r in rows:
        f = fio.get(r["drives"])
        if f is None or r is f:
            continue
        for side in ("store", "load"):
            ours, theirs = r.get(f"{side}_gbps"), f.get(f"{side}_gbps")
            if ours is not None and theirs:
                r.setdefault(f"{side}_vs_fio", round(ours / theirs, 2))


def table(rows: list[dict[str, Any]]) -> list[str]:
    head = ("drives", "level", "target", "store GB/s", "load GB/s", "store s/GB", "load s/GB",
            "CPU of", "store/fio", "load/fio", "XXH3 s/GB", "XXH3 cold",
            "beyond XXH3 st/ld")  # fmt: skip
    body = [
        (
            str(r["drives"]),
            r["level"],
            r["target"],
            *(
                f"{r[k]:.2f}" if isinstance(r.get(k), float | int) else "-"
                for k in ("store_gbps", "load_gbps")
            ),
            *(
                f"{r[k]:.3f}" if isinstance(r.get(k), float | int) else "-"
                for k in ("store_cpu_s_per_gb", "load_cpu_s_per_gb")
            ),
            r["cpu_of"],
            *(
                f"{r[k]:.2f}" if isinstance(r.get(k), float | int) else "-"
                for k in ("store_vs_fio", "load_vs_fio")
            ),
            f"{r['xxh3_s_per_gb']:.3f}" if "xxh3_s_per_gb" in r else "-",
            f"{r['xxh3_cold_s_per_gb']:.3f}" if "xxh3_cold_s_per_gb" in r else "-",
            "/".join(
                f"{r[k]:.3f}" if isinstance(r.get(k), float | int) else "-"
                for k in ("store_beyond_xxh3_s_per_gb", "load_beyond_xxh3_s_per_gb")
            ),
        )
        for r in rows
    ]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    return [
        "  ".join(
            c.ljust(w) if i < 3 else c.rjust(w)
            for i, (c, w) in enumerate(zip(x, widths, strict=True))
        )
        for x in [head, *body]
    ]


def bytes_that_fit(
    left: float, run: dict[str, Any], todo: list[dict[str, Any]], rate: dict[str, float]
) -> int:
    """What ``run`` may move in its share of the ``left`` seconds: the time
    for moving bytes (``left`` less the fixed cost of this run and of every
    run still ``todo``), shared in proportion to planned bytes, at the rate
    measured so far for its level (bytes per second of moving time; a guess
    before the first)."""
    level = run["level"]
    ahead = [run, *todo]
    moving = left - sum(FIXED_S[r["level"]] for r in ahead)
    share = moving * run["planned_bytes"] / sum(r["planned_bytes"] for r in ahead)
    guess = rate.get(level)
    if guess is None:
        guess = rate.get("tier", FIRST_RATE) / (VLLM_SLOWER if level == "vllm" else 1.0)
    return int(guess * max(0.0, share))


def run_all(args: argparse.Namespace, p: dict[str, Any], out: dict[str, Any]) -> None:
    engine = _engine(args.engine)
    out["engine"] = engine
    print(f"bench-node: engine {engine}; load average {_loadavg()}", flush=True)
    t_start = time.monotonic()
    rate: dict[str, float] = {}  # bytes per wall second of a whole run, per level
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if p["fio_path"]:  # the bench runs the first fio on PATH: this one
        env["PATH"] = os.path.dirname(p["fio_path"]) + os.pathsep + env.get("PATH", "")
    todo = list(p["runs"])
    while todo:
        run = todo.pop(0)
        n, level = run["drives"], run["level"]
        left = args.budget_s - (time.monotonic() - t_start)
        fits = bytes_that_fit(left, run, todo, rate)
        size = min(run["planned_bytes"], fits // args.rounds) // (args.bs * n) * (args.bs * n)
        floor = max(FLOOR_PER_DRIVE // args.bs * args.bs, args.bs) * n
        record: dict[str, Any] = {**run, "bytes": size, "loadavg_before": _loadavg()}
        out["runs"].append(record)
        if size < min(floor, run["planned_bytes"]):
            record["skipped"] = (
                f"out of time: {left:.0f} s left of --budget-s {args.budget_s:.0f} would move "
                f"{fits // args.rounds >> 20} MiB"
                + (f" a round ({args.rounds} rounds)" if args.rounds > 1 else "")
                + f", under {floor >> 20} MiB"
            )
            out["skipped"].append(
                {"what": f"{level} level at {n} drives", "why": record["skipped"]}
            )
            print(f"bench-node: skip {level} at {n} drives: {record['skipped']}", flush=True)
            continue
        if size < run["planned_bytes"]:
            record["cut"] = f"{run['planned_bytes'] >> 20} MiB cut to {size >> 20} MiB to fit"
        argv = bench_argv(args, p, run, size, engine)
        record["command"] = "nvmetier bench " + " ".join(argv)
        each = f" x {args.rounds} rounds" if args.rounds > 1 else ""
        print(f"bench-node: {n} drive(s), {level} level, {size >> 20} MiB{each}: "
              f"{record['command']}", flush=True)  # fmt: skip
        t0 = time.monotonic()
        with tempfile.TemporaryFile("w+") as so, tempfile.TemporaryFile("w+") as se:
            code = "import sys; from nvmetier.bench import main; sys.exit(main(sys.argv[1:]))"
            rc = subprocess.run(
                [sys.executable, "-c", code, *argv], stdout=so, stderr=se, cwd=ROOT, env=env
            ).returncode
            so.seek(0)
            se.seek(0)
            stdout, stderr = so.read(), se.read()
        wall = time.monotonic() - t0
        record.update(rc=rc, wall_s=round(wall, 2), loadavg_after=_loadavg())
        report: dict[str, Any] = {}
        with contextlib.suppress(ValueError):
            report = json.loads(stdout[stdout.index("{") :]) if "{" in stdout else {}
        if rc != 0 or not report.get("results"):
            record["error"] = stderr.strip()[-2000:] or f"exit status {rc}"
            print(f"bench-node: {level} at {n} drives failed (rc {rc}):\n{record['error']}",
                  flush=True)  # fmt: skip
            continue
        rate[level] = size * args.rounds / max(1.0, wall - FIXED_S[level])
        out.setdefault("machine", report.get("machine"))
        record["notes"] = report.get("notes", [])
        record["fio_engine"] = report.get("fio_engine")
        if args.keep_reports:
            record["report"] = report
        new = rows_of(report, n, level)
        out["rows"] += new
        print("\n".join("  " + line for line in table(new)[1:]), flush=True)
    out["wall_s"] = round(time.monotonic() - t_start, 1)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    p = plan(args)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = args.out or os.path.join(ROOT, "bench-out", f"node-{stamp}.json")
    out: dict[str, Any] = {
        "command": "scripts/bench-node.sh " + " ".join(argv if argv is not None else sys.argv[1:]),
        "utc": stamp,
        "dry_run": args.dry_run,
        "loadavg": _loadavg(),
        "plan": {k: v for k, v in p.items() if k not in ("skipped", "notes")},
        "skipped": list(p["skipped"]),
        "notes": list(p["notes"]),
        "runs": [],
        "rows": [],
    }
    print(
        f"bench-node: {p['drive_kind']}; drive counts {','.join(map(str, p['counts']))}; "
        f"levels {','.join(p['levels']) or 'none'}; bs {args.bs >> 10} KiB; "
        f"{p['bytes_per_drive'] >> 20} MiB per drive per run"
        f"{f' and round, {args.rounds} rounds' if args.rounds > 1 else ''}; "
        f"budget {args.budget_s:.0f} s; "
        f"{p['cpus']} CPUs; load average {out['loadavg']}; fio: {p['fio']}",
        flush=True,
    )
    for s in p["skipped"]:
        print(f"bench-node: skipped: {s['what']}: {s['why']}", flush=True)
    for note in p["notes"]:
        print(f"bench-node: note: {note}", flush=True)
    if args.dry_run:
        engine = args.engine if args.engine != "auto" else "ENGINE"
        for run in p["runs"]:
            argv_ = bench_argv(args, p, run, run["planned_bytes"], engine)
            print(f"bench-node: would run: nvmetier bench {' '.join(argv_)}", flush=True)
            out["runs"].append({**run, "command": "nvmetier bench " + " ".join(argv_)})
    elif p["levels"]:
        run_all(args, p, out)
    add_fio_ratios(out["rows"])  # before the JSON is written: it keeps the ratios too
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=2, default=str)
    if out["rows"]:
        print()
        print("\n".join(table(out["rows"])))
        print()
        print(
            "CPU of: process = the whole bench process (the tier level runs only the tier); "
            "tier = the tier's threads plus vLLM's thread inside its methods; fio = fio's own. "
            "store/fio, load/fio: GB/s over fio's at the same drive count (fio: one job per "
            "drive). XXH3 s/GB: one XXH3 pass over the bytes, measured in the run (the floor "
            "of a checksummed store or a verified load), warm (vllm level); XXH3 cold: the "
            "same pass over bytes not in cache, as the I/O workers meet them; beyond XXH3 "
            "st/ld: the tier's CPU per GB beyond its own XXH3 pass (--profile), stores/loads "
            "(issue 29 item 2 asks the tier to stay within XXH3 cold + 0.02)."
            + (
                f" {args.rounds} rounds: every figure is the median over the rounds; store/fio "
                "and load/fio the median of the per-round ratios where fio ran in the same "
                "run (the JSON keeps each round's ratio and the GB/s range)."
                if args.rounds > 1
                else ""
            )
        )
    for r in out["rows"]:
        if r.get("errors"):
            print(
                f"missed: {r['drives']} drive(s), {r['level']} level, {r['target']}: "
                f"{r['errors']} chunks not moved (misses or failures; its GB/s counts only "
                "the bytes moved: see the run's report)"
            )
    for s in out["skipped"]:
        print(f"skipped: {s['what']}: {s['why']}")
    print(f"bench-node: JSON in {path}" + (f" ({out['wall_s']} s)" if "wall_s" in out else ""))
    failed = [r for r in out["runs"] if "error" in r]
    return 1 if failed or (not args.dry_run and not out["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
