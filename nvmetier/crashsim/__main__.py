"""``python -m nvmetier.crashsim``: record a workload, explore a recording,
or replay one crash state a person wants to look at.

    python -m nvmetier.crashsim record WORKLOAD OUT [--plant BUG]
    python -m nvmetier.crashsim explore REC [--seed N] [--per-point N] [--restarts N]
    python -m nvmetier.crashsim replay REC --point N (--volatile | --ns K --units 1,2|none)
        [--out DIR] [--engine threads|uring] [--verify | --no-verify]

``replay`` writes the state's files under ``--out`` (a temporary directory
by default, printed) and runs every check on it, printing what fails. Runs
on the main thread and blocks.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from nvmetier.crashsim import workloads


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("_run", "_step"):
        workloads.run_in_child(argv[1], argv[2], step=argv[0] == "_step")
        return 0
    p = argparse.ArgumentParser(prog="python -m nvmetier.crashsim")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="record a workload")
    r.add_argument("workload", choices=sorted(workloads.WORKLOADS))
    r.add_argument("out")
    r.add_argument("--plant", action="append", default=[])
    e = sub.add_parser("explore", help="check every crash state of a recording")
    e.add_argument("rec")
    e.add_argument("--seed", type=int, default=31)
    e.add_argument("--per-point", type=int, default=24)
    e.add_argument("--restarts", type=int, default=12)
    y = sub.add_parser("replay", help="materialise and check one crash state")
    y.add_argument("rec")
    y.add_argument("--point", type=int, required=True)
    y.add_argument("--volatile", action="store_true")
    y.add_argument("--ns", type=int, default=0)
    y.add_argument("--units", default="none")
    y.add_argument("--out")
    y.add_argument("--engine", default="threads", choices=("threads", "uring"))
    y.add_argument("--verify", action=argparse.BooleanOptionalAction, default=False)
    a = p.parse_args(argv)
    from nvmetier.crashsim import explorer
    from nvmetier.crashsim.model import Choice, FsModel
    from nvmetier.crashsim.recorder import read_log

    if a.cmd == "record":
        print(workloads.record(a.workload, a.out, a.plant))
        return 0
    if a.cmd == "explore":
        rep = explorer.explore(a.rec, seed=a.seed, per_point=a.per_point, restarts=a.restarts)
        print(rep.summary())
        for f in rep.findings:
            print(f)
        return 1 if rep.findings else 0
    ops = read_log(a.rec)
    units = frozenset() if a.units == "none" else frozenset(int(u) for u in a.units.split(","))
    choice = Choice(a.point, a.ns, units, a.volatile)
    model = FsModel(a.rec, ops)
    model.advance(a.point)
    if a.point:
        last = {k: v for k, v in ops[a.point - 1].items() if k != "blob"}
        print(f"crash after op {a.point - 1} of {len(ops)}: {last}")
    print("killed process: everything written is kept" if a.volatile else "power loss:")
    for i, u in enumerate(model.units()):
        print(f"unit {i}: op {u.op} {ops[u.op]['path']} offset {u.offset} (+{len(u.data)})")
    for i, (at, op, _t) in enumerate(model.pending_ns):
        print(f"name change {i}: op {at} {op['op']} {op['path']} {op.get('dst', '')}")
    work = a.out or tempfile.mkdtemp(prefix="crashsim-replay-")
    os.makedirs(work, exist_ok=True)
    spec = workloads.spec_of(a.rec)
    problems = explorer.check_choice(model, ops, spec, choice, work, (a.engine, a.verify))
    print(f"state written to {os.path.join(work, 'state')}")
    for line in problems:
        print(f"VIOLATION: {line}")
    print("ok" if not problems else f"{len(problems)} violation(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
