"""The ``nvmetier`` command: ``fsck``, ``info``, ``purge``, ``rekey`` and ``bench``.

Owns: argument parsing, output and exit codes. Runs on the main thread and
blocks. Every user error is printed as one line, ``nvmetier: error: ...``,
without a traceback. Exit codes follow e2fsck: 0 clean, 1 errors corrected,
4 errors left uncorrected, 8 operational error, 16 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from nvmetier.errors import NvmeTierError
from nvmetier.fsck import EXIT_OPERATIONAL, EXIT_USAGE, FsckOperationalError

PROG = "nvmetier"

_FSCK_EPILOG = """\
ROOT is the tier's root_dir as configured in vLLM (every store under it is
checked) or one store directory. Only the main root_dir's data file is known
from ROOT; data files of other root_dir entries of a striped store are not
checked. A store in use by a running process is not checked (exit 8).

exit codes (OR-ed over the stores, as e2fsck):
  0   no errors
  1   errors found and corrected (--repair)
  4   errors left uncorrected
  8   operational error: not a store, store in use, unreadable
  16  usage error
"""

_INFO_EPILOG = """\
Reads without taking the store's lock: a store in use is reported as such and
its numbers are a snapshot. Also reports whether the io_uring engine and
O_DIRECT are usable on this machine (O_DIRECT probed in ROOT).
"""


_PURGE_EPILOG = """\
A purge clears the index records of the chunks it removes (their keys leave
the index at once); their bytes stay in the data files until their slots are
reused. Attached processes emit the removals as KV events (removed=True).

exit codes (OR-ed over the stores):
  0   every store purged
  4   a store, or some of its sets, left: held by a stopped or hung process,
      or exclusively (sharing: 'process', fsck --repair); run it again later
  8   operational error: not a store root, no store of --model, unreadable
  16  usage error
"""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors and the e2fsck usage exit code."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{PROG}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Check, inspect and benchmark nvmetier stores "
        "(the NVMe secondary tier of vLLM's KV-cache offloading).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser(
        "fsck",
        help="check (and repair) stores",
        description="Check the stores under ROOT: superblock, file sizes, every index record,\n"
        "and with --deep the payload checksum of every live slot.",
        epilog=_FSCK_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("root", metavar="ROOT", help="a root_dir or one store directory")
    p.add_argument(
        "--deep", action="store_true", help="read every live slot and verify its checksum"
    )
    p.add_argument(
        "--key-file",
        metavar="PATH",
        help="the encryption key file of an encrypted store: --deep verifies each chunk's "
        "authentication tag with it",
    )
    p.add_argument(
        "--repair",
        action="store_true",
        help="zero the index records that fail (they become misses); good records are "
        "never written",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    p = sub.add_parser(
        "info",
        help="show what a store holds and what this machine supports",
        description="Show the layout identity, capacity, occupancy, record ages and shutdown\n"
        "state of the stores under ROOT, and the I/O engines usable on this machine.",
        epilog=_INFO_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("root", metavar="ROOT", help="a root_dir or one store directory")
    p.add_argument(
        "--retention",
        metavar="DUR",
        help="measure record ages against this retention (e.g. '24h'; default: the "
        "retention of the latest process to open each store)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    p = sub.add_parser(
        "purge",
        help="remove chunks from the stores under ROOT, live",
        description="Remove chunks from the stores under ROOT (a root_dir, or one store\n"
        "directory): those stored DUR ago or longer, or all of them. Safe while vLLM\n"
        "processes use the stores: they see misses, never purged bytes.",
        epilog=_PURGE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("root", metavar="ROOT", help="a root_dir or one store directory")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--older-than", metavar="DUR", help="remove chunks stored DUR ago or longer ('24h', '90s')"
    )
    what.add_argument("--all", action="store_true", help="remove every chunk")
    p.add_argument("--model", metavar="NAME", help="only the stores of this model")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    p = sub.add_parser(
        "rekey",
        help="rotate the key file of the encrypted stores under ROOT, live",
        description="Rewrap the store key of every encrypted store under ROOT from the key\n"
        "file --key-file to --new-key-file, live and in seconds (no data is rewritten):\n"
        "afterwards the old key file opens nothing in them, the new one everything.\n"
        "Processes attached keep running; start the next ones with the new key file.",
        epilog="exit codes (OR-ed over the stores): 0 every encrypted store rekeyed; 4 a\n"
        "store not rekeyed (another key wraps it, or unreadable); 8 operational error\n"
        "(not a store root, no encrypted store, a key file unusable); 16 usage error",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("root", metavar="ROOT", help="a root_dir or one store directory")
    p.add_argument("--key-file", required=True, metavar="OLD", help="the key file in use")
    p.add_argument("--new-key-file", required=True, metavar="NEW", help="the key file to use")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    p = sub.add_parser(
        "budget",
        help="show or change the disk budget every store under ROOT shares",
        description="Show the root budget of ROOT (a root_dir) and each store's share of it,\n"
        "or record a new one. A lower budget is recorded once what ROOT holds fits\n"
        "under it: stores with no process attached give way, least recently used\n"
        "first; stores in use are never removed (the budget is then not recorded).",
        epilog="exit codes: 0 shown or recorded; 4 not recorded (stores in use hold more);\n"
        "8 operational error (not a directory, unreadable record); 16 usage error",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("root", metavar="ROOT", help="a root_dir")
    change = p.add_mutually_exclusive_group()
    change.add_argument("--set", metavar="SIZE", help="record this budget ('500GiB')")
    change.add_argument("--unset", action="store_true", help="remove the budget (unbounded)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    # Parsed by hand in main(): every argument goes to nvmetier.bench.main,
    # including --help. Registered here so the top-level help lists it.
    sub.add_parser(
        "bench",
        help="run the I/O benchmark (arguments go to it; 'nvmetier bench --help')",
        add_help=False,
    )
    return parser


def _cmd_fsck(args: argparse.Namespace) -> int:
    from nvmetier import fsck

    try:
        keys = None
        if args.key_file is not None:
            from nvmetier import crypto

            keys = crypto.KeySet.from_file(args.key_file)
        results = fsck.fsck(
            args.root,
            deep=args.deep,
            repair=args.repair,
            stream=fsck.progress_stream(),
            keys=keys,
        )
    except FsckOperationalError as exc:
        if args.json:
            print(
                json.dumps(
                    {
                        "root": args.root,
                        "exit_code": EXIT_OPERATIONAL,
                        "error": str(exc),
                        "stores": [],
                    }
                )
            )
        raise
    code = fsck.overall_exit(results)
    if args.json:
        out = {
            "root": args.root,
            "deep": args.deep,
            "repair": args.repair,
            "exit_code": code,
            "stores": [r.to_json() for r in results],
        }
        print(json.dumps(out, indent=2))
    else:
        print("\n\n".join(fsck.format_result(r) for r in results))
    for r in results:
        if r.operational_error is not None:
            print(f"{PROG}: error: {r.operational_error}", file=sys.stderr)
    return code


def _duration_arg(value: str | None, flag: str) -> float | None:
    from nvmetier.config import parse_duration
    from nvmetier.errors import ConfigError

    if value is None:
        return None
    try:
        return parse_duration(value, flag)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from exc


def _cmd_info(args: argparse.Namespace) -> int:
    from nvmetier import info

    report = info.info(args.root, retention_s=_duration_arg(args.retention, "--retention"))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(info.format_info(report))
    return 0


def _cmd_purge(args: argparse.Namespace) -> int:
    from nvmetier import purge

    older = _duration_arg(args.older_than, "--older-than")
    try:
        results = purge.purge(args.root, older_than_s=older, model=args.model)
    except purge.PurgeOperationalError as exc:
        if args.json:
            print(json.dumps({"root": args.root, "exit_code": EXIT_OPERATIONAL, "error": str(exc)}))
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_OPERATIONAL
    code = purge.overall_exit(results)
    if args.json:
        out = {
            "root": args.root,
            "older_than_s": older,
            "all": bool(args.all),
            "model": args.model,
            "exit_code": code,
            "stores": [r.to_json() for r in results],
        }
        print(json.dumps(out, indent=2))
    else:
        print("\n".join(purge.format_result(r) for r in results))
    return code


def _cmd_rekey(args: argparse.Namespace) -> int:
    from nvmetier import rekey

    try:
        results = rekey.rekey(args.root, args.key_file, args.new_key_file)
    except (NvmeTierError, FsckOperationalError) as exc:
        if args.json:
            print(json.dumps({"root": args.root, "exit_code": EXIT_OPERATIONAL, "error": str(exc)}))
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_OPERATIONAL
    code = rekey.overall_exit(results)
    if args.json:
        out = {"root": args.root, "exit_code": code, "stores": [r.to_json() for r in results]}
        print(json.dumps(out, indent=2))
    else:
        print("\n".join(rekey.format_result(r) for r in results))
    return code


def _cmd_budget(args: argparse.Namespace) -> int:
    from nvmetier import budget
    from nvmetier.config import parse_size
    from nvmetier.errors import ConfigError

    code, message, removed = 0, None, []
    if args.set is not None or args.unset:
        try:
            size = None if args.unset else parse_size(args.set, "--set")
        except ConfigError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        recorded, shares, message = budget.set_budget(args.root, size)
        removed = [s.name for s in shares]
        code = 0 if recorded else 4
    elif not os.path.isdir(args.root):
        print(f"{PROG}: error: {args.root!r} is not a directory; give a root_dir", file=sys.stderr)
        return EXIT_OPERATIONAL
    report = budget.report(args.root)
    if args.json:
        print(json.dumps({**report, "exit_code": code, "message": message, "removed": removed}))
        return code
    if message:
        print(message)
    for name in removed:
        print(f"  removed (gave way): {name}")
    print(format_budget(report))
    return code


def format_budget(report: dict[str, Any]) -> str:
    """The root budget and each store's share, for a person."""
    from nvmetier.config import format_size
    from nvmetier.info import _when

    now = time.time_ns()
    b = report["budget_bytes"]
    lines = [
        f"root budget:       {format_size(b) if b else 'none (unbounded)'}"
        + (f", {report['used_pct']:.1f}% used" if b else ""),
        f"on disk:           {format_size(report['used_bytes'])} (allocated blocks of every "
        "file under the root)",
    ]
    if report.get("error"):
        lines.append(f"error:             {report['error']}")
    for s in report["stores"]:
        pct = s["share_of_budget_pct"]
        who = (
            f"in use by pid {', '.join(map(str, s['pids'])) or 'unknown'}" if s["live"] else "idle"
        )
        lines.append(
            f"  {s['name']} ({s['kind']}, {s['model'] or '-'}): {format_size(s['disk_bytes'])}"
            + (f" ({pct:.1f}% of the budget)" if pct is not None else "")
            + f", {who}, last use {_when(s['last_use_ns'] or None, now)}"
        )
    return "\n".join(lines)


def _cmd_bench(argv: list[str]) -> int:
    try:
        from nvmetier import bench
    except ImportError as exc:
        print(f"{PROG}: error: the benchmark is not available ({exc})", file=sys.stderr)
        return EXIT_OPERATIONAL
    code = bench.main(argv)
    return int(code or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``nvmetier`` console script. Returns the exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        if args_list and args_list[0] == "bench":
            return _cmd_bench(args_list[1:])
        args = build_parser().parse_args(args_list)
        if args.command == "fsck":
            return _cmd_fsck(args)
        if args.command == "info":
            return _cmd_info(args)
        if args.command == "purge":
            return _cmd_purge(args)
        if args.command == "rekey":
            return _cmd_rekey(args)
        if args.command == "budget":
            return _cmd_budget(args)
        raise AssertionError(f"unhandled command {args.command!r}")
    except BrokenPipeError:
        # stdout closed early (``| head``): nothing more to say, and Python
        # must not complain again when it flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_OPERATIONAL
    except (NvmeTierError, OSError) as exc:
        msg = str(exc)
        if isinstance(exc, OSError) and exc.strerror:
            where = f"{exc.filename!r}: " if exc.filename else ""
            msg = f"{where}{exc.strerror}"
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return EXIT_OPERATIONAL
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
