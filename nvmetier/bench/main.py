"""The ``nvmetier bench`` command line: options, dispatch to a level, the report.

Owns: ``build_parser``, ``main`` and the level dispatch. Runs on the calling
thread and blocks for the length of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from nvmetier.bench.common import LEVELS, RW_MODES, _bs, _parse_bs_list
from nvmetier.bench.engine import run_engine_level
from nvmetier.bench.fio import fio_engine, run_fio
from nvmetier.bench.machine import machine_info
from nvmetier.bench.parties import load_bounds
from nvmetier.bench.peers import (
    DEFAULT_BACKENDS,
    LMCACHE_BACKENDS,
    PeerError,
    lmcache_env_path,
    rotation,
    run_peer,
    setup_lmcache,
)
from nvmetier.bench.reopen import run_reopen
from nvmetier.bench.report import (
    PhaseResult,
    PlotError,
    _bytes,
    _phase_line,
    check_plot,
    cpu_table,
    median_summary,
    plot,
    summarize,
    summary_table,
)
from nvmetier.bench.tier import run_tier_level, tier_target
from nvmetier.bench.trace import ROUTES, run_trace_level
from nvmetier.bench.vllm import run_vllm_level
from nvmetier.config import parse_size
from nvmetier.fsck import EXIT_OPERATIONAL


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nvmetier bench",
        description="fio-style benchmark of nvmetier (engine, tier, through vLLM) "
        "with vLLM's fs tier and fio beside it.",
    )
    p.add_argument("--level", choices=LEVELS, default="tier")
    p.add_argument(
        "--summarize",
        nargs="+",
        metavar="JSON",
        help="print median tables of earlier --output-format json reports (with --plot: "
        "plot the medians) and exit",
    )
    p.add_argument(
        "--rw",
        choices=RW_MODES,
        default="rw",
        help="rw = a write pass then a read pass (not fio's mixed rw)",
    )
    p.add_argument("--bs", default="64k,256k,2m", help="block/chunk sizes, comma-separated")
    p.add_argument("--iodepth", type=int, default=32)
    p.add_argument("--size", default="1g", help="bytes per size, per target (per job)")
    p.add_argument("--runtime", type=float, default=0.0, help="cap per phase in seconds (0: none)")
    p.add_argument("--numjobs", type=int, default=1, help="engine/tier levels: parallel jobs")
    p.add_argument(
        "--engine",
        default="threads",
        help="threads, uring, or a comma-separated list (uring is skipped if unusable)",
    )
    p.add_argument("--direct", type=int, choices=(0, 1), default=1)
    p.add_argument(
        "--checksum",
        type=int,
        choices=(0, 1),
        default=1,
        help="engine level: 0 skips the per-op XXH3 (the raw I/O cost, as fio)",
    )
    p.add_argument("--dir", default=None, help="folder for the files (default: a temp dir under .)")
    p.add_argument(
        "--loop-drives",
        type=int,
        default=0,
        metavar="N",
        help="root: create N RAM-backed loop drives (tmpfs images, losetup --direct-io=on, "
        "ext4), stripe the tier over them and run fio with one job per drive; removed at "
        "the end, on Ctrl-C and on SIGTERM/SIGHUP (--dir is ignored)",
    )
    p.add_argument(
        "--loop-drive-size",
        default=None,
        help="size of each loop drive (default: 3 x --size / N + 256 MiB, at least 1 GiB)",
    )
    p.add_argument(
        "--dirs",
        default=None,
        metavar="DIR,DIR,...",
        help="folders on the drives you have, one per drive (e.g. /mnt/nvme0,/mnt/nvme1): "
        "stripe the tier over them and run fio with one job per drive, as --loop-drives "
        "does with the drives it makes (--dir is ignored)",
    )
    p.add_argument(
        "--io-workers",
        default="auto",
        help="tier and vllm levels: the tier's io_workers (an integer or auto)",
    )
    p.add_argument(
        "--serve-prompts", type=int, default=5, help="serve level: prompts per way (TTFT)"
    )
    p.add_argument(
        "--serve-prompt-tokens", type=int, default=2048, help="serve level: tokens per prompt"
    )
    p.add_argument(
        "--serve-model",
        default=None,
        metavar="DIR",
        help="serve level: model folder (default: the random-weight bench model, made "
        "once under --dir)",
    )
    p.add_argument("--output-format", choices=("normal", "json"), default="normal")
    p.add_argument("--compare-fio", action="store_true", help="run fio with the same parameters")
    p.add_argument("--no-fs-tier", action="store_true", help="vllm level: skip vLLM's fs tier")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of GB/s vs bs")
    p.add_argument("--keep", action="store_true", help="keep the files it created")
    p.add_argument("--no-drop-caches", action="store_true")
    p.add_argument("--primary", default="512m", help="vllm level: CPU primary tier size")
    p.add_argument(
        "--store-batch",
        type=int,
        default=16,
        help="vllm level: chunks per store request (one cascade job each)",
    )
    p.add_argument(
        "--step-ms",
        type=float,
        default=1.0,
        help="vllm and trace levels: pause between simulated engine steps while waiting on "
        "transfers (vLLM 0.33's engine core sleeps 1 ms after a step that ran no model)",
    )
    p.add_argument(
        "--retry-ms",
        type=float,
        default=5.0,
        help="vllm level: pause before re-scanning keys a tier answered RETRY (a step)",
    )
    p.add_argument(
        "--load-requests",
        type=int,
        default=1,
        help="vllm level: requests in flight in the load phase, each of 1/K of --primary "
        "(1: one request of the whole primary at a time, each waited out before the next)",
    )
    p.add_argument("--job-chunks", type=int, default=1, help="tier level: chunks per job")
    p.add_argument(
        "--primary-shm",
        default="/dev/shm",
        help="tier level: the tmpfs folder(s) the primary's file is made in, comma-separated "
        "(each is a target; e.g. a tmpfs mounted huge=within_size beside /dev/shm)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="engine/tier/vllm levels: run every target this many times per size, "
        "alternated, the order rotated each round; tables give medians (min-max) and "
        "the median of per-round ratios",
    )
    p.add_argument(
        "--peers",
        choices=("none", "lmcache"),
        default="none",
        help="tier level: also run LMCache 0.5.6's disk backends (in their own environment, "
        "built on first use: see docs/bench.md) beside the tier and fio",
    )
    p.add_argument(
        "--peer-backends",
        default=",".join(DEFAULT_BACKENDS),
        help=f"with --peers lmcache: which of {', '.join(LMCACHE_BACKENDS)}",
    )
    p.add_argument(
        "--staging",
        default="auto",
        help="tier level: the tier's staging (auto, on, off), or a comma-separated list to "
        "run each (targets other than auto are named nvmetier-ENGINE-staging-MODE)",
    )
    p.add_argument("--lookups", type=int, default=20000, help="vllm level: lookups timed")
    p.add_argument("--slots", default="1m", help="reopen level: slots in the store (1m = 2^20)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="reopen level: cProfile the open; tier and vllm levels: the tier's CPU per GB "
        "by thread (user/system), hashing and staging copies (native counters), against "
        "one XXH3 pass measured in the same run",
    )
    t = p.add_argument_group(
        "trace level",
        "replay a Mooncake-format trace (JSONL: timestamp ms, input_length, output_length, "
        "hash_ids) through vLLM's orchestrator on --replicas engine processes; --plot "
        "writes the capacity curve",
    )
    t.add_argument("--trace", default=None, metavar="FILE", help="the trace (.jsonl[.gz|.xz])")
    t.add_argument("--trace-requests", type=int, default=0, help="replay the first N only")
    t.add_argument("--replicas", type=int, default=1, help="data-parallel engine processes")
    t.add_argument("--route", choices=ROUTES, default="round-robin")
    t.add_argument(
        "--affinity-blocks",
        type=int,
        default=2,
        help="affinity route: requests whose first N block ids match go to one replica",
    )
    t.add_argument("--seed", type=int, default=0, help="random route: the seed")
    t.add_argument(
        "--speedup", type=float, default=1.0, help="replay the timestamps N times faster"
    )
    t.add_argument("--trace-block-tokens", type=int, default=512, help="tokens per hash id")
    t.add_argument(
        "--bytes-per-token",
        default="128k",
        help="KV bytes per token: 2 x layers x KV heads x head dim x dtype bytes "
        "(128k: Llama-3.1-8B in bf16)",
    )
    t.add_argument(
        "--scale",
        default="1/1024",
        help="replayed chunk size / real chunk size (the disk holds scale x capacity)",
    )
    t.add_argument(
        "--capacity",
        default=None,
        help="tier capacity at the real chunk size, all replicas together "
        "(default: a quarter of the trace's distinct blocks)",
    )
    t.add_argument(
        "--primary-chunks",
        type=int,
        default=0,
        help="CPU primary rows per replica (0: twice the longest prompt)",
    )
    t.add_argument("--curve-points", type=int, default=40, help="points of the capacity curve")
    t.add_argument(
        "--tier-option",
        action="append",
        metavar="KEY=VALUE",
        help="trace and vllm levels: another key of the tier's config (repeatable), e.g. ways=8",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.plot:
        # A missing matplotlib (or output directory) is said before the run, not after it.
        try:
            check_plot(args.plot)
        except PlotError as exc:
            print(f"nvmetier bench: {exc}", file=sys.stderr)
            return EXIT_OPERATIONAL
    if args.summarize:
        try:
            lines, rc = summarize(args.summarize, args.plot)
        except PlotError as exc:
            print(f"nvmetier bench: {exc}", file=sys.stderr)
            return EXIT_OPERATIONAL
        print("\n".join(lines), file=sys.stderr if rc else sys.stdout)
        return rc
    try:
        args.size = parse_size(args.size, "--size")
        args.primary = parse_size(args.primary, "--primary")
        args.slots = parse_size(args.slots, "--slots")
        bss = _parse_bs_list(args.bs)
    except ValueError as exc:
        print(f"nvmetier bench: {exc}", file=sys.stderr)
        return 2
    if args.io_workers != "auto":
        try:
            args.io_workers = int(args.io_workers)
        except ValueError:
            print("nvmetier bench: --io-workers must be an integer or auto", file=sys.stderr)
            return 2
    if args.loop_drives < 0:
        print("nvmetier bench: --loop-drives must be >= 0", file=sys.stderr)
        return 2
    if args.dirs and args.loop_drives:
        print("nvmetier bench: use --dirs or --loop-drives, not both", file=sys.stderr)
        return 2
    if args.iodepth < 1 or args.numjobs < 1:
        print("nvmetier bench: --iodepth and --numjobs must be >= 1", file=sys.stderr)
        return 2
    if args.level == "vllm" and args.numjobs != 1:
        print(
            "nvmetier bench: the vllm level drives one orchestrator; use --numjobs 1",
            file=sys.stderr,
        )
        return 2
    for bs in bss:
        if bs % 4096:
            print(f"nvmetier bench: --bs {bs} is not a multiple of 4096", file=sys.stderr)
            return 2
    if args.rounds < 1:
        print("nvmetier bench: --rounds must be >= 1", file=sys.stderr)
        return 2
    if args.load_requests < 1:
        print(
            f"nvmetier bench: --load-requests {args.load_requests}: requests in flight "
            "are >= 1 (e.g. --load-requests 2)",
            file=sys.stderr,
        )
        return 2
    args.peer_list = [b.strip() for b in args.peer_backends.split(",") if b.strip()]
    if args.peers != "none":
        if args.level != "tier":
            print("nvmetier bench: --peers runs at --level tier only", file=sys.stderr)
            return 2
        bad_peers = [b for b in args.peer_list if b not in LMCACHE_BACKENDS]
        if bad_peers or not args.peer_list:
            print(
                f"nvmetier bench: --peer-backends {args.peer_backends!r}: use "
                + ", ".join(LMCACHE_BACKENDS),
                file=sys.stderr,
            )
            return 2
    args.staging_modes = [m.strip() for m in args.staging.split(",") if m.strip()]
    bad = [m for m in args.staging_modes if m not in ("auto", "on", "off")]
    if bad or not args.staging_modes:
        print(f"nvmetier bench: --staging {args.staging!r}: use auto, on or off", file=sys.stderr)
        return 2
    quiet = args.output_format == "json"

    def log(msg: str) -> None:
        print(msg, file=sys.stderr if quiet else sys.stdout, flush=True)

    if args.loop_drives:
        from nvmetier.bench.drives import DriveSetupError, Interrupted, loop_drives

        size = (
            parse_size(args.loop_drive_size, "--loop-drive-size")
            if args.loop_drive_size
            else max(1 << 30, 3 * args.size // args.loop_drives + (256 << 20))
        )
        try:
            with loop_drives(args.loop_drives, size, log) as mounts:
                args.dir = mounts[0]
                args.dirs = mounts
                return _main_in(args, argv, bss, log, quiet, made_dir=False)
        except DriveSetupError as exc:
            print(f"nvmetier bench: {exc}", file=sys.stderr)
            return 2
        except (KeyboardInterrupt, Interrupted) as exc:
            print(f"nvmetier bench: interrupted ({exc or 'Ctrl-C'})", file=sys.stderr)
            return 130
    if args.dirs:
        dirs = [d.strip() for d in args.dirs.split(",") if d.strip()]
        for d in dirs:
            if not os.path.isdir(d):
                print(
                    f"nvmetier bench: --dirs {d}: not a directory (mount the drive and make "
                    "the folder first)",
                    file=sys.stderr,
                )
                return 2
        args.dir = dirs[0]
        args.dirs = dirs
        return _main_in(args, argv, bss, log, quiet, made_dir=False)
    made_dir = args.dir is None
    if made_dir:
        args.dir = tempfile.mkdtemp(prefix="nvmetier-bench-", dir=os.getcwd())
    else:
        os.makedirs(args.dir, exist_ok=True)
    args.dirs = [args.dir]
    return _main_in(args, argv, bss, log, quiet, made_dir)


def _main_in(
    args: argparse.Namespace,
    argv: list[str] | None,
    bss: list[int],
    log: Callable[[str], None],
    quiet: bool,
    made_dir: bool,
) -> int:
    args._notes = []
    report: dict[str, Any] = {
        "command": "nvmetier bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "level": args.level,
        "params": {
            "rw": args.rw,
            "bs": bss,
            "iodepth": args.iodepth,
            "size": args.size,
            "runtime": args.runtime,
            "numjobs": args.numjobs,
            "direct": args.direct,
            "dir": args.dir,
            "dirs": args.dirs,
            "loop_drives": args.loop_drives,
            "io_workers": args.io_workers,
        },
        "machine": machine_info(args.dir),
    }
    try:
        rc = _run(args, bss, report, log)
    except PlotError as exc:
        # The run finished, only its plot failed: still print the report.
        print(f"nvmetier bench: {exc}", file=sys.stderr)
        args._notes.append(str(exc))
        rc = EXIT_OPERATIONAL
    finally:
        import gc

        gc.unfreeze()  # let extension objects die normally at exit
        if made_dir and not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    report["notes"] = args._notes
    if quiet:
        print(json.dumps(report, indent=2, default=str))
    else:
        for n in args._notes:
            print("note:", n)
    return rc


def _engines(args: argparse.Namespace, log: Callable) -> list[str]:
    from nvmetier.engine import uring_status

    out = []
    for e in (x.strip() for x in args.engine.split(",") if x.strip()):
        if e not in ("threads", "uring"):
            raise ValueError(f"--engine {e!r}: use threads or uring")
        if e == "uring":
            ok, why = uring_status()
            if not ok:
                msg = f"skipping --engine uring: io_uring engine unusable here ({why})"
                args._notes.append(msg)
                log("note: " + msg)
                continue
        out.append(e)
    return out


def _run(args: argparse.Namespace, bss: list[int], report: dict[str, Any], log: Callable) -> int:
    m = report["machine"]
    if args.level == "trace":
        log(
            f"machine: {m['host_cpus']} CPUs ({m['cpu_model']}), {m['memory']} RAM, "
            f"kernel {m['kernel']}, {m['filesystem']}"
        )
        try:
            engines = _engines(args, log)
        except ValueError as exc:
            print(f"nvmetier bench: {exc}", file=sys.stderr)
            return 2
        if not engines:
            print("nvmetier bench: no usable --engine", file=sys.stderr)
            return 2
        return run_trace_level(args, engines[0], report, log)
    log(
        f"nvmetier bench: level={args.level} rw={args.rw} bs={','.join(_bs(b) for b in bss)} "
        f"iodepth={args.iodepth} size={_bytes(args.size)} direct={args.direct} dir={args.dir}"
    )
    log(
        f"machine: {m['host_cpus']} CPUs ({m['cpu_model']}), {m['memory']} RAM, "
        f"kernel {m['kernel']}, {m['filesystem']}"
    )
    if args.level == "reopen":
        report["reopen"] = run_reopen(args, log)
        return 0
    if args.level == "serve":
        from nvmetier.bench.serve import run_serve_level

        report["serve"] = run_serve_level(args, log)
        return 0
    try:
        engines = _engines(args, log)
    except ValueError as exc:
        print(f"nvmetier bench: {exc}", file=sys.stderr)
        return 2
    fio = None
    if args.compare_fio:
        engine, extra, desc = fio_engine(args.dir)
        if engine is None:
            args._notes.append(f"--compare-fio skipped: {desc}")
            log("note: " + args._notes[-1])
        else:
            fio = (engine, extra)
            report["fio_engine"] = desc
            log(f"fio: {desc}")
    peer_py = None
    if args.peers == "lmcache":
        env = lmcache_env_path()
        try:
            peer_py = setup_lmcache(env, log)
        except PeerError as exc:
            print(
                f"nvmetier bench: --peers lmcache: LMCache cannot be installed in {env}: {exc}",
                file=sys.stderr,
            )
            return 3
        report["peers"] = {"lmcache_env": str(env), "backends": args.peer_list}
        log(f"peers: LMCache 0.5.6 from {env}: {', '.join(args.peer_list)}")
    results: list[PhaseResult] = []
    lookups: dict[str, Any] = {}
    runs = _targets(args, engines, fio, peer_py, lookups, log)
    report["rounds"] = []
    for bs in bss:
        for rnd in range(args.rounds):
            order = rotation(runs, rnd)
            report["rounds"].append(
                {
                    "bs": bs,
                    "round": rnd,
                    "order": [name for name, _ in order],
                    "loadavg": _loadavg(),
                    "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                }
            )
            if args.rounds > 1:
                log(
                    f"round {rnd + 1}/{args.rounds} bs={_bs(bs)}: {' > '.join(n for n, _ in order)}"
                )
            for _name, fn in order:
                for r in fn(bs):
                    r.extra["round"] = rnd
                    results.append(r)
    report["results"] = [r.to_json() for r in results]
    table, rows = summary_table(results, bss)
    report["summary"] = rows
    med_lines: list[str] = []
    if args.rounds > 1:
        med_lines, med_rows = median_summary(results, bss)
        report["medians"] = med_rows
    if lookups:
        report["lookup_latency"] = lookups
    bound_lines, bound_rows = load_bounds(results, os.cpu_count() or 1)
    if bound_rows:
        report["load_bounds"] = bound_rows
        for line in bound_lines:
            log(line)
    if args.output_format != "json":
        print()
        print("\n".join(table))
        print()
        print("\n".join(cpu_table(results)))
        if med_lines:
            print()
            print("\n".join(med_lines))
        for name, lk in lookups.items():
            print(f"lookup {name}: hit {lk['hit_ns']} miss {lk['miss_ns']} results {lk['results']}")
    if args.plot:
        title = (
            f"nvmetier bench --level {args.level}, iodepth {args.iodepth}, "
            f"{_bytes(args.size)} per size, direct={args.direct}"
        )
        log(plot(_medians(results) if args.rounds > 1 else results, args.plot, title))
    return 0


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def _medians(results: list[PhaseResult]) -> list[PhaseResult]:
    """One result per (target, phase, bs) at the median GB/s, for the plot."""
    import dataclasses
    import statistics

    groups: dict[tuple[str, str, int], list[PhaseResult]] = {}
    for r in results:
        groups.setdefault((r.target, r.phase, r.bs), []).append(r)
    return [
        dataclasses.replace(
            v[0], bytes=round(statistics.median(x.bw_gbps for x in v) * 1e9), runtime_s=1.0
        )
        for v in groups.values()
    ]


Target = tuple[str, Callable[[int], list[PhaseResult]]]


def _targets(
    args: argparse.Namespace,
    engines: list[str],
    fio: tuple[str, list[str]] | None,
    peer_py: Any,
    lookups: dict[str, Any],
    log: Callable[[str], None],
) -> list[Target]:
    """What one round runs, in the first round's order: (name, run(bs))."""
    out: list[Target] = []
    for e in engines:
        if args.level == "engine":

            def engine(bs: int, e: str = e) -> list[PhaseResult]:
                return run_engine_level(args, bs, e, log)

            out.append((f"engine-{e}", engine))
        elif args.level == "tier":
            for shm in [d.strip() for d in args.primary_shm.split(",") if d.strip()]:
                for mode in args.staging_modes:

                    def tier(
                        bs: int, e: str = e, mode: str = mode, shm: str = shm
                    ) -> list[PhaseResult]:
                        args.staging_mode = mode
                        args.primary_shm_dir = shm
                        return run_tier_level(args, bs, e, log)

                    out.append((tier_target(e, mode, shm), tier))
        else:

            def vllm(bs: int, e: str = e) -> list[PhaseResult]:
                res, lk = run_vllm_level(args, bs, f"nvmetier-{e}", log)
                if lk is not None:
                    lookups[f"nvmetier-{e}/{_bs(bs)}"] = lk.to_json()
                return res

            out.append((f"nvmetier-{e}", vllm))
    if args.level == "vllm" and not args.no_fs_tier:
        out.append(("fs", lambda bs: run_vllm_level(args, bs, "fs", log)[0]))
    if peer_py is not None:
        for b in args.peer_list:

            def peer(bs: int, b: str = b) -> list[PhaseResult]:
                try:
                    res = run_peer(peer_py, b, args, bs, log)
                except PeerError as exc:
                    args._notes.append(str(exc))
                    log("note: " + str(exc))
                    return []
                for r in res:
                    log(_phase_line(r))
                return res

            out.append((f"lmcache-{b}", peer))
    if fio is not None:
        # Our tiers place chunks by key hash: compare with fio's random pattern.
        rand = args.rw.startswith("rand") or args.level in ("tier", "vllm")
        eng, extra = fio
        out.append(
            ("fio", lambda bs: run_fio(args, bs, args.rw, rand, eng, extra, log, args.level))
        )
    return out
