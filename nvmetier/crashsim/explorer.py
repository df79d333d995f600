"""The explorer: every crash state a recording allows, each checked.

Owns: the choice of states (``choices_at``), their deduplication, the
sample that is opened as a restart (``explore``) and the report. Runs on
the caller's thread and blocks (seconds to minutes).

At every point of the recording (after each operation) it takes the states
the persistence model (``model``) allows there: the killed-process state
(everything written kept), and power-loss states: what was synced, plus a
prefix of the name changes not yet made durable by a directory fsync, plus
any subset of the unsynced 4 KiB pages. The subsets are exhaustive while
``(prefix choices) x 2^pages`` stays within ``per_point``; past it a
structured set (none, all, each file's pages alone, all but each file's)
and random subsets drawn from ``random.Random(seed + point)``. Equal
states (most points change nothing durable) are checked once. Every state
gets the media checks (``checks.check_media``); a sample of ``restarts``
states, drawn with the same seed, is also opened as a restart, alternating
the engines and ``verify_checksums``.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import shutil
import tempfile
from typing import Any

from nvmetier.crashsim import checks
from nvmetier.crashsim.model import Choice, FsModel, materialize, state_digest
from nvmetier.crashsim.recorder import read_log
from nvmetier.crashsim.workloads import spec_of


@dataclasses.dataclass
class Finding:
    choice: Choice
    problems: list[str]
    rec_dir: str

    def replay_command(self) -> str:
        return f"python -m nvmetier.crashsim replay {self.rec_dir} {self.choice.describe()}"

    def __str__(self) -> str:
        return f"{'; '.join(self.problems)}\n  replay: {self.replay_command()}"


@dataclasses.dataclass
class Report:
    workload: str
    ops: int
    points: int
    states: int  # distinct states given the media checks
    restarts: int  # of them, opened as a restart
    seed: int
    findings: list[Finding]
    refused: int = 0  # restarts that refused the state (each also a violation)
    served: int = 0  # chunks the restarts' loads returned (each checked)

    def summary(self) -> str:
        return (
            f"crashsim {self.workload}: {self.ops} ops, {self.points} points, "
            f"{self.states} distinct crash states checked, {self.restarts} opened as a "
            f"restart ({self.refused} refused, {self.served} "
            f"chunks served and checked; seed {self.seed}), {len(self.findings)} violations"
        )


def choices_at(model: FsModel, per_point: int, rng: random.Random) -> list[Choice]:
    """The crash states to try at ``model.point``."""
    point = model.point
    out = [Choice(point, volatile=True)]
    n_ns = len(model.pending_ns)
    units = model.units()
    n = len(units)
    if (n_ns + 1) << n <= per_point:
        for k in range(n_ns + 1):
            for mask in range(1 << n):
                out.append(Choice(point, k, frozenset(i for i in range(n) if mask >> i & 1)))
        return out
    every = frozenset(range(n))
    by_file: dict[int, set[int]] = {}
    for i, u in enumerate(units):
        by_file.setdefault(u.inode, set()).add(i)
    for k in sorted({0, n_ns}):
        out.append(Choice(point, k, frozenset()))
        out.append(Choice(point, k, every))
        for mine in by_file.values():
            out.append(Choice(point, k, frozenset(mine)))
            out.append(Choice(point, k, every - mine))
    for _ in range(max(0, per_point - len(out))):
        out.append(
            Choice(
                point,
                rng.randint(0, n_ns),
                frozenset(i for i in range(n) if rng.random() < 0.5),
            )
        )
    return out


def _sample(
    ops: list[dict[str, Any]], states: list[Choice], budget: int, rng: random.Random
) -> list[Choice]:
    """``budget`` of ``states`` (in point order): those at a point right after
    a sync, a name change or a note first (where orders matter), then any."""
    marks = ("fsync", "fsync_dir", "rename", "link", "unlink", "create", "note")
    first = [i for i, c in enumerate(states) if c.point and ops[c.point - 1]["op"] in marks]
    chosen = set(first)
    rest = [i for i in range(len(states)) if i not in chosen]
    rng.shuffle(first)
    rng.shuffle(rest)
    keep = sorted((first + rest)[:budget])
    return [states[i] for i in keep]


def _oracle(ops: list[dict[str, Any]], point: int) -> tuple[dict[bytes, set[str]], set[bytes]]:
    """Keys -> digests of every payload stored before ``point``, and the
    keys a finished purge removed (not stored again since)."""
    oracle: dict[bytes, set[str]] = {}
    purged: set[bytes] = set()
    for op in itertools.islice(ops, point):
        if op["op"] != "note":
            continue
        if op["kind"] == "stored":
            k = bytes.fromhex(op["key"])
            oracle.setdefault(k, set()).add(op["digest"])
            purged.discard(k)
        elif op["kind"] == "purged":
            purged.update(bytes.fromhex(h) for h in op["keys"])
    return oracle, purged


def _uring_available() -> bool:
    from nvmetier.engine import uring_status

    return bool(uring_status()[0])


def check_choice(
    model: FsModel,
    ops: list[dict[str, Any]],
    spec: dict[str, Any],
    choice: Choice,
    work: str,
    restart: tuple[str, bool] | None,
    served: list[int] | None = None,
) -> list[str]:
    """Materialise ``choice`` (at ``model.point``) under ``work`` and check it."""
    root = os.path.join(work, "state")
    shutil.rmtree(root, ignore_errors=True)
    materialize(model.files(choice), root)
    oracle, purged = _oracle(ops, choice.point)
    facts: dict[str, int] = {}
    problems = checks.check_media(root, spec, choice.volatile, work, purged, facts)
    if restart is not None and not problems:
        engine, verify = restart
        problems = checks.check_restart(
            root, spec, oracle, purged, engine=engine, verify=verify, served=served, facts=facts
        )
    return problems


def explore(
    rec_dir: str,
    *,
    per_point: int = 24,
    restarts: int = 12,
    states_budget: int = -1,
    seed: int = 31,
    stop_after: int = 3,
    work_dir: str | None = None,
) -> Report:
    """Explore the recording in ``rec_dir``.

    Args:
        per_point: at most this many power-loss states per point (all of
            them while the subsets fit).
        restarts: states opened as a restart (-1: every state).
        states_budget: distinct states checked at all (-1: every one);
            past it a sample drawn with ``seed``, the killed-process states
            and the states right after a sync or a name change first.
        seed: of the random subsets and of the restart sample (printed).
        stop_after: stop once this many violations were found (0: never).
    """
    ops = read_log(rec_dir)
    spec = spec_of(rec_dir)
    engines = ["threads", "uring"] if _uring_available() else ["threads"]
    # Pass 1: the distinct states, in order.
    model = FsModel(rec_dir, ops)
    seen: set[str] = set()
    states: list[Choice] = []
    for point in range(len(ops) + 1):
        if point and ops[point - 1].get("more"):
            continue  # inside one diff: not an instant the run passed through
        model.advance(point)
        for ch in choices_at(model, per_point, random.Random(seed * 1_000_003 + point)):
            d = state_digest(model.files(ch))
            if d not in seen:
                seen.add(d)
                states.append(ch)
    rng = random.Random(seed)
    if 0 <= states_budget < len(states):
        states = _sample(ops, states, states_budget, rng)
    pick = set(range(len(states)))
    if 0 <= restarts < len(states):
        pick = set(rng.sample(range(len(states)), restarts))
    # Pass 2: check each, in point order (one forward replay).
    findings: list[Finding] = []
    model = FsModel(rec_dir, ops)
    if work_dir is None and os.path.isdir("/dev/shm"):
        work_dir = "/dev/shm"  # states are small and many: memory, not the disk
    work = tempfile.mkdtemp(prefix="crashsim-", dir=work_dir)
    n_restarts = 0
    served: list[int] = []
    try:
        for n, ch in enumerate(states):
            model.advance(ch.point)
            restart = None
            if n in pick:
                restart = (engines[n_restarts % len(engines)], n_restarts // len(engines) % 2 == 0)
                n_restarts += 1
            problems = check_choice(model, ops, spec, ch, work, restart, served)
            if problems:
                findings.append(Finding(ch, problems, rec_dir))
                if stop_after and len(findings) >= stop_after:
                    break
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return Report(
        spec["workload"],
        len(ops),
        len(ops) + 1,
        len(states),
        n_restarts,
        seed,
        findings,
        refused=served.count(-1),
        served=sum(n for n in served if n > 0),
    )
