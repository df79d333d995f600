"""SIGSTOP of one sharer of a live shared store (issue 15): stopped is not dead.

A stopped process keeps its set mutexes, its OFD lock (it looks alive for
ever), its WRITING slots and its leases. The other sharers must see bounded
stalls only: a set mutex it holds costs one bounded wait (then misses and
dropped stores in that set), a key it is writing is waited for at most the
watch timeout, and its leases run out.

Trials: a survivor keeps one store open for the module; each trial starts a
victim on the same store (a separate vLLM instance, through vLLM's real
orchestrator: ``tests/vllm/sharer.py``) that stores and loads (journaled), and
SIGSTOPs it at a random point (while opening, storing or loading). For
``STOP_S`` the survivor keeps working, then checks, the victim still stopped:

- no operation of the survivor stalled (``OP_LIMIT_S`` per batch: a bounded
  wait is milliseconds; ``PHASE_LIMIT_S`` per check);
- every store the victim completed before the stop is a HIT, byte-exact;
- every store the survivor completed is still a HIT, and it can store and load
  new chunks;
- except in a set whose mutex the victim was stopped holding (the survivor's
  wait for it timed out): keys of that set are misses and stores into it are
  dropped, the bounded answer, and once the victim continues every one of
  those misses is a HIT again (no completed store is lost).

Then the victim continues (SIGCONT) and works ``RESUME_S`` more before it is
killed: no process ever loaded wrong bytes (its journal's ``W`` lines), and
what it stored after resuming is served to the survivor.

4 trials, or 24 with ``NVMETIER_SLOW=1``; besides them, one test stops a
sharer inside a set's critical section (holding the set mutex).
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from tests.vllm.conftest import nvme_tier
from tests.vllm.sharer import Sharer, read_journal, wait_stopped

SLOW = os.environ.get("NVMETIER_SLOW") == "1"
TRIALS = 24 if SLOW else 4
MODEL = "nvmetier/shared-model"
OP_LIMIT_S = 1.0
PHASE_LIMIT_S = 5.0
STOP_S = 1.0  # the survivor churns this long with the victim stopped
RESUME_S = 0.15  # the victim works this long after SIGCONT, then is killed
KINDS = ("store", "load", "open", "store", "load", "store")
BASE = list(range(64))
VICTIM_KEYS = 32
SURVIVOR_KEYS = 16
FRESH_KEYS = 8

pytestmark = pytest.mark.timeout(1800 if SLOW else 300)


@dataclasses.dataclass
class Trial:
    trial: int
    kind: str
    delay_s: float
    journaled: list[int] = dataclasses.field(default_factory=list)
    journaled_after: list[int] = dataclasses.field(default_factory=list)
    victim_wrong: list[int] = dataclasses.field(default_factory=list)
    churn: dict[str, Any] = dataclasses.field(default_factory=dict)
    journaled_load: dict[str, Any] = dataclasses.field(default_factory=dict)
    own_load: dict[str, Any] = dataclasses.field(default_factory=dict)
    fresh_store: dict[str, Any] = dataclasses.field(default_factory=dict)
    fresh_load: dict[str, Any] = dataclasses.field(default_factory=dict)
    resumed_load: dict[str, Any] = dataclasses.field(default_factory=dict)
    recheck: dict[str, Any] = dataclasses.field(default_factory=dict)
    check_s: float = 0.0
    # The victim was stopped inside a set's critical section: the survivor's
    # waits for that set timed out (misses and dropped stores in that set are
    # then the bounded answer, until the victim continues).
    held_set: bool = False

    def missed_while_stopped(self) -> list[int]:
        missed = self.journaled_load["miss"] + self.own_load["miss"]
        return sorted(set(missed + self.churn["journaled_missed"]))

    def parts(self) -> list[dict[str, Any]]:
        return [
            self.churn,
            self.journaled_load,
            self.own_load,
            self.fresh_store,
            self.fresh_load,
            self.resumed_load,
            self.recheck,
        ]

    def max_op_s(self) -> float:
        return max(p.get("max_op_s", 0.0) for p in self.parts())

    def wrong(self) -> list[int]:
        out = list(self.victim_wrong)
        for p in self.parts():
            out += p.get("wrong", [])
        return out


def _tier(root: str) -> dict[str, Any]:
    return nvme_tier(root, capacity_bytes="128MiB")


def _run_trial(
    i: int, survivor: Sharer, victim: Sharer, root: str, base: str, own: list[int]
) -> Trial:
    rng = random.Random(5000 + i)
    kind = KINDS[i % len(KINDS)]
    delay_s = {"open": rng.uniform(0.0, 0.03), "store": rng.uniform(0.0, 0.04)}.get(
        kind, rng.uniform(0.06, 0.25)
    )
    t = Trial(i, kind, delay_s)
    journal = os.path.join(base, f"journal{i}")
    open_kw = {"tier": _tier(root), "model": MODEL}
    if kind == "open":
        victim.send("open", **open_kw)
    else:
        victim.call("open", **open_kw)
        victim_keys = list(range(2_000_000 + 1000 * i, 2_000_000 + 1000 * i + VICTIM_KEYS))
        victim.send("victim", journal=journal, store_keys=victim_keys, load_keys=BASE)
    time.sleep(delay_s)
    timeouts = survivor.call("stats")["set_lock_timeouts"]
    victim.stop()
    t.churn = survivor.call(
        "churn",
        duration_s=STOP_S,
        store_keys=list(range(1_000_000 + 1000 * i, 1_000_000 + 1000 * i + SURVIVOR_KEYS)),
        load_keys=own,
        journal=journal if kind != "open" else None,
        timeout_s=STOP_S + PHASE_LIMIT_S,
    )
    own += t.churn["stored"]
    t.journaled = read_journal(journal).stored
    t0 = time.monotonic()
    t.journaled_load = survivor.call("promote", keys=t.journaled, timeout_s=PHASE_LIMIT_S)
    t.own_load = survivor.call("promote", keys=own, timeout_s=PHASE_LIMIT_S)
    fresh = list(range(3_000_000 + 1000 * i, 3_000_000 + 1000 * i + FRESH_KEYS))
    t.fresh_store = survivor.call("store", keys=fresh, timeout_s=PHASE_LIMIT_S)
    own += t.fresh_store["present"]
    t.fresh_load = survivor.call("promote", keys=fresh, timeout_s=PHASE_LIMIT_S)
    t.check_s = time.monotonic() - t0
    t.held_set = survivor.call("stats")["set_lock_timeouts"] > timeouts
    victim.resume()
    time.sleep(RESUME_S)
    victim.kill()
    j = read_journal(journal)
    t.victim_wrong = j.wrong
    t.journaled_after = [k for k in j.stored if k not in set(t.journaled)]
    t.resumed_load = survivor.call("promote", keys=t.journaled_after, timeout_s=PHASE_LIMIT_S)
    t.recheck = survivor.call("promote", keys=t.missed_while_stopped(), timeout_s=PHASE_LIMIT_S)
    return t


@pytest.fixture(scope="module")
def trials(tmp_path_factory: pytest.TempPathFactory) -> list[Trial]:
    base = str(tmp_path_factory.mktemp("sharing_sigstop"))
    root = os.path.join(base, "kv")
    survivor = Sharer("survivor")
    victims: list[Sharer] = []
    try:
        survivor.call("open", tier=_tier(root), model=MODEL)
        own = list(survivor.call("store", keys=BASE)["present"])
        assert own == BASE
        out: list[Trial] = []
        victims.append(Sharer("victim0"))
        for i in range(TRIALS):
            if i + 1 < TRIALS:
                victims.append(Sharer(f"victim{i + 1}"))
            out.append(_run_trial(i, survivor, victims[i], root, base, own))
            victims[i].close()
        return out
    finally:
        for v in victims:
            v.resume() if v.proc.is_alive() else None
            v.close()
        survivor.close()


def test_sigstop_trials_cover_stops_while_opening_storing_and_loading(trials) -> None:
    assert len(trials) == TRIALS
    assert {t.kind for t in trials} == {"store", "load", "open"}
    assert sum(len(t.journaled) for t in trials) > 0


def test_sigstop_survivor_stalls_are_bounded(trials) -> None:
    slow = {t.trial: round(t.max_op_s(), 3) for t in trials if t.max_op_s() > OP_LIMIT_S}
    assert not slow, f"survivor operations slower than {OP_LIMIT_S}s"
    long = {t.trial: round(t.check_s, 3) for t in trials if t.check_s > PHASE_LIMIT_S}
    assert not long, f"survivor checks slower than {PHASE_LIMIT_S}s"


def test_sigstop_survivor_kept_working_while_the_victim_was_stopped(trials) -> None:
    assert {t.trial: t.churn["ops"] for t in trials if t.churn["ops"] < 2} == {}


def test_sigstop_completed_stores_are_hits_while_the_victim_is_stopped(trials) -> None:
    """Every completed store (the victim's journaled ones, the survivor's own)
    is a HIT while the victim is stopped, unless it stopped inside a set's
    critical section: keys of that set are then misses (the bounded answer)."""
    missed = {t.trial: t.missed_while_stopped() for t in trials if not t.held_set}
    assert not {k: v for k, v in missed.items() if v}


def test_sigstop_no_completed_store_is_lost(trials) -> None:
    """Once the victim continued, every key missed while it was stopped is a HIT."""
    lost = {t.trial: t.recheck["miss"] for t in trials if t.recheck["miss"]}
    assert not lost


def test_sigstop_survivor_stores_and_loads_new_chunks_while_the_victim_is_stopped(
    trials,
) -> None:
    failed = {
        t.trial: (t.fresh_store["present"], t.fresh_load["miss"])
        for t in trials
        if not t.held_set and (len(t.fresh_store["present"]) < FRESH_KEYS or t.fresh_load["miss"])
    }
    assert not failed
    # In a set the stopped victim holds, a store is dropped; the others land.
    partial = {
        t.trial: t.fresh_store["present"]
        for t in trials
        if t.held_set and len(t.fresh_store["present"]) < FRESH_KEYS // 2
    }
    assert not partial


def test_sigstop_victims_stores_after_it_resumed_are_served(trials) -> None:
    missed = {t.trial: t.resumed_load["miss"] for t in trials if t.resumed_load["miss"]}
    assert not missed


def test_sigstop_nobody_ever_loads_wrong_bytes(trials) -> None:
    wrong = {t.trial: t.wrong() for t in trials if t.wrong()}
    assert not wrong


def test_a_sharer_stopped_holding_a_set_mutex_costs_others_a_bounded_wait(tmp_path) -> None:
    """Was a bug: set mutexes were waited for without bound, with the GIL
    held: a sharer stopped inside a set's critical section froze every other
    sharer's scheduler thread at its first key in that set. Now one bounded
    wait, then misses and dropped stores in that set only, and everything is
    back once the stopped sharer continues."""
    root = str(tmp_path / "kv")
    survivor, victim = Sharer("survivor"), Sharer("victim")
    try:
        survivor.call("open", tier=_tier(root), model=MODEL)
        victim.call("open", tier=_tier(root), model=MODEL)
        held = 100
        assert survivor.call("store", keys=[held])["present"] == [held]
        same_set = survivor.call("same_set_keys", i=held, n=4, start=10_000)
        victim.send("hold_set_then_stop", i=held)
        assert victim.proc.pid is not None
        wait_stopped(victim.proc.pid)
        t0 = time.monotonic()
        got = survivor.call("promote", keys=[held], timeout_s=PHASE_LIMIT_S)
        assert got["miss"] == [held] and not got["wrong"]  # a miss, not a hang
        stored = survivor.call("store", keys=same_set, timeout_s=PHASE_LIMIT_S)
        assert stored["present"] == []  # dropped, not waited for
        elsewhere = [k for k in range(20_000, 20_008) if k not in same_set]
        other = survivor.call("store", keys=elsewhere, timeout_s=PHASE_LIMIT_S)
        assert len(other["present"]) >= len(elsewhere) - 1  # other sets work as ever
        assert time.monotonic() - t0 < PHASE_LIMIT_S
        assert survivor.call("stats")["set_lock_timeouts"] >= 1
        victim.resume()
        assert victim.recv(timeout_s=PHASE_LIMIT_S) is None  # it released the mutex
        got = survivor.call("promote", keys=[held], timeout_s=PHASE_LIMIT_S)
        assert got["hit"] == [held] and not got["wrong"]
        stored = survivor.call("store", keys=same_set, timeout_s=PHASE_LIMIT_S)
        assert stored["present"] == same_set
    finally:
        victim.resume()
        victim.close()
        survivor.close()
