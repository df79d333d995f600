"""SIGKILL of one sharer of a live shared store, at random points (issue 10).

A survivor process keeps one store open for the whole module; each trial
starts a victim process on the same store (a separate vLLM instance of the
same model, through vLLM's real orchestrator: ``tests/vllm/sharer.py``),
lets it store and load while the survivor does the same, and SIGKILLs it:
while it opens the store, while it stores, or while it loads. The survivor
keeps working for a while after the kill, then checks:

- no operation of the survivor stalled (``OP_LIMIT_S`` per store or load
  batch, ``PHASE_LIMIT_S`` for the whole check);
- every store the victim completed (journaled ``S``: its store job finished
  and the tier held the chunk) is a HIT for the survivor, byte-exact, both
  live while the victim runs and after the kill;
- every store the survivor completed is still a HIT, and it can store and
  load new chunks;
- no process ever loaded wrong bytes (the victim journals ``W`` lines too);
- the ``sharers`` gauge no longer counts the dead victim.

The store is large enough (128 MiB, ~8000 slots for ~1200 keys in all) that
no set fills up, so every completed store must still be there. The trials run
once per module (20, or 200 with ``NVMETIER_SLOW=1``); each test asserts one
property over all of them.
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
from tests.vllm.sharer import Sharer, read_journal

SLOW = os.environ.get("NVMETIER_SLOW") == "1"
TRIALS = 200 if SLOW else 20
MODEL = "nvmetier/shared-model"
OP_LIMIT_S = 1.0  # one store or load batch of the survivor (~1 ms unloaded)
PHASE_LIMIT_S = 5.0  # the survivor's whole check after a kill
# Per five trials: two kills while storing, two while loading, one while opening.
KINDS = ("store", "load", "store", "load", "open")
BASE = list(range(64))  # the survivor's chunks stored before the trials
VICTIM_KEYS = 32  # stored by each victim, two per job
SURVIVOR_KEYS = 16  # stored by the survivor during each trial
FRESH_KEYS = 8  # stored by the survivor after each kill

pytestmark = pytest.mark.timeout(1800 if SLOW else 180)


@dataclasses.dataclass
class Trial:
    trial: int
    kind: str
    delay_s: float
    submitted: list[int] = dataclasses.field(default_factory=list)
    journaled: list[int] = dataclasses.field(default_factory=list)
    victim_wrong: list[int] = dataclasses.field(default_factory=list)
    churn: dict[str, Any] = dataclasses.field(default_factory=dict)
    journaled_load: dict[str, Any] = dataclasses.field(default_factory=dict)
    unjournaled_load: dict[str, Any] = dataclasses.field(default_factory=dict)
    own_load: dict[str, Any] = dataclasses.field(default_factory=dict)
    fresh_store: dict[str, Any] = dataclasses.field(default_factory=dict)
    fresh_load: dict[str, Any] = dataclasses.field(default_factory=dict)
    check_s: float = 0.0
    sharers: int | None = None

    def max_op_s(self) -> float:
        parts = (
            self.churn,
            self.journaled_load,
            self.unjournaled_load,
            self.own_load,
            self.fresh_store,
            self.fresh_load,
        )
        return max(p.get("max_op_s", 0.0) for p in parts)

    def wrong(self) -> list[int]:
        out = list(self.victim_wrong) + list(self.churn.get("wrong", []))
        for p in (self.journaled_load, self.unjournaled_load, self.own_load, self.fresh_load):
            out += p.get("wrong", [])
        return out


def _tier(root: str) -> dict[str, Any]:
    return nvme_tier(root, capacity_bytes="128MiB")


def _run_trial(
    i: int, survivor: Sharer, victim: Sharer, root: str, base: str, own: list[int]
) -> Trial:
    rng = random.Random(3000 + i)
    kind = KINDS[i % len(KINDS)]
    # open: while attaching; store: within the ~16 store jobs of the
    # victim (a few ms each); load: after them, while it only loads.
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
    churn_s = delay_s + 0.15  # the survivor goes on 150 ms past the kill
    survivor.send(
        "churn",
        duration_s=churn_s,
        store_keys=list(range(1_000_000 + 1000 * i, 1_000_000 + 1000 * i + SURVIVOR_KEYS)),
        load_keys=own,
        journal=journal if kind != "open" else None,
    )
    time.sleep(delay_s)
    victim.kill()
    t.churn = survivor.recv(timeout_s=churn_s + PHASE_LIMIT_S)
    own += t.churn["stored"]

    j = read_journal(journal)
    t.submitted, t.journaled, t.victim_wrong = j.submitted, j.stored, j.wrong
    t0 = time.monotonic()
    t.journaled_load = survivor.call("promote", keys=t.journaled, timeout_s=PHASE_LIMIT_S)
    t.unjournaled_load = survivor.call(
        "promote",
        keys=[k for k in t.submitted if k not in set(t.journaled)],
        timeout_s=PHASE_LIMIT_S,
    )
    t.own_load = survivor.call("promote", keys=own, timeout_s=PHASE_LIMIT_S)
    fresh = list(range(3_000_000 + 1000 * i, 3_000_000 + 1000 * i + FRESH_KEYS))
    t.fresh_store = survivor.call("store", keys=fresh, timeout_s=PHASE_LIMIT_S)
    own += t.fresh_store["present"]
    t.fresh_load = survivor.call("promote", keys=fresh, timeout_s=PHASE_LIMIT_S)
    t.check_s = time.monotonic() - t0
    t.sharers = survivor.call("stats", timeout_s=PHASE_LIMIT_S).get("sharers")
    return t


@pytest.fixture(scope="module")
def trials(tmp_path_factory: pytest.TempPathFactory) -> list[Trial]:
    base = str(tmp_path_factory.mktemp("sharing_sigkill"))
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
            # The next victim forks while this trial runs; it opens the
            # store only when its trial starts.
            if i + 1 < TRIALS:
                victims.append(Sharer(f"victim{i + 1}"))
            out.append(_run_trial(i, survivor, victims[i], root, base, own))
            victims[i].close()
        return out
    finally:
        for v in victims:
            v.close()
        survivor.close()


def test_sigkill_trials_cover_kills_while_opening_storing_and_loading(trials) -> None:
    assert len(trials) == TRIALS
    mid_store = [t.trial for t in trials if t.kind == "store" and len(t.submitted) < VICTIM_KEYS]
    in_loads = [t.trial for t in trials if len(t.journaled) == VICTIM_KEYS]
    assert mid_store, "no victim was killed before it stored all its chunks"
    assert in_loads, "no victim was killed while only loading"
    assert sum(len(t.journaled) for t in trials) > 0


def test_sigkill_survivor_never_stalls(trials) -> None:
    slow = {t.trial: round(t.max_op_s(), 3) for t in trials if t.max_op_s() > OP_LIMIT_S}
    assert not slow, f"survivor operations slower than {OP_LIMIT_S}s"
    long = {t.trial: round(t.check_s, 3) for t in trials if t.check_s > PHASE_LIMIT_S}
    assert not long, f"survivor checks slower than {PHASE_LIMIT_S}s"


def test_sigkill_survivor_kept_working_during_the_kill(trials) -> None:
    assert {t.trial: t.churn["ops"] for t in trials if t.churn["ops"] < 2} == {}


def test_sigkill_victims_completed_stores_are_hits_for_the_survivor_live(trials) -> None:
    missed = {t.trial: t.churn["journaled_missed"] for t in trials if t.churn["journaled_missed"]}
    assert not missed


def test_sigkill_victims_completed_stores_are_still_served_after_the_kill(trials) -> None:
    missed = {t.trial: t.journaled_load["miss"] for t in trials if t.journaled_load["miss"]}
    assert not missed


def test_sigkill_survivor_loses_none_of_its_completed_stores(trials) -> None:
    lost = {t.trial: t.own_load["miss"] for t in trials if t.own_load["miss"]}
    assert not lost


def test_sigkill_survivor_stores_and_loads_new_chunks_after_the_kill(trials) -> None:
    failed = {
        t.trial: (t.fresh_store["present"], t.fresh_load["miss"])
        for t in trials
        if len(t.fresh_store["present"]) < FRESH_KEYS or t.fresh_load["miss"]
    }
    assert not failed


def test_sigkill_nobody_ever_loads_wrong_bytes(trials) -> None:
    wrong = {t.trial: t.wrong() for t in trials if t.wrong()}
    assert not wrong


def test_sigkill_dead_sharer_is_not_counted_in_the_sharers_gauge(trials) -> None:
    assert {t.trial: t.sharers for t in trials if t.sharers != 1} == {}
