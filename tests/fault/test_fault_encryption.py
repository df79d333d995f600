"""An encrypted store shared live by several vLLM processes (issue 23):
sharers with the same key serve each other's chunks byte-exact, a sharer
with another key (a rolling key rotation) sees only misses and its own
chunks, and a sealing writer killed mid-store leaves nothing wrong: every
chunk anyone loads is the one stored, and fsck --deep with the key is clean.

Every sharer is a separate vLLM instance (``tests/vllm/sharer.py``)."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")
pytest.importorskip("nvmetier._crypto")

from tests.vllm.conftest import new_key, nvme_tier
from tests.vllm.sharer import Sharer, read_journal

pytestmark = pytest.mark.timeout(300)

MODEL = "nvmetier/sealed-model"
BASE = list(range(48))


def _tier(root: str, key_path: str) -> dict[str, Any]:
    return nvme_tier(root, capacity_bytes="128MiB", encryption={"key_file": key_path})


@pytest.fixture
def sharers():
    made: list[Sharer] = []

    def make(name: str) -> Sharer:
        s = Sharer(name)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def test_sharers_with_one_key_serve_each_others_sealed_chunks(tmp_path, sharers) -> None:
    root, key = str(tmp_path / "kv"), new_key(tmp_path, "key")
    a, b = sharers("a"), sharers("b")
    a.call("open", tier=_tier(root, key), model=MODEL)
    b.call("open", tier=_tier(root, key), model=MODEL)
    assert a.call("store", keys=BASE)["present"] == BASE
    got = b.call("promote", keys=BASE)
    assert got["hit"] == BASE and not got["wrong"]


def test_a_sharer_with_another_key_is_refused_and_the_first_keeps_serving(
    tmp_path, sharers
) -> None:
    root = str(tmp_path / "kv")
    old, new = new_key(tmp_path, "old"), new_key(tmp_path, "new")
    a, b = sharers("old-key"), sharers("new-key")
    a.call("open", tier=_tier(root, old), model=MODEL)
    assert a.call("store", keys=BASE)["present"] == BASE
    with pytest.raises(Exception, match="nvmetier rekey"):
        b.call("open", tier=_tier(root, new), model=MODEL)
    got = a.call("promote", keys=BASE)
    assert got["hit"] == BASE and not got["wrong"]
    assert a.call("stats")["auth_failures"] == 0


def test_a_sealing_writer_killed_mid_store_leaves_nothing_wrong(tmp_path, sharers) -> None:
    root, key = str(tmp_path / "kv"), new_key(tmp_path, "key")
    journal = str(tmp_path / "journal")
    survivor, victim = sharers("survivor"), sharers("victim")
    survivor.call("open", tier=_tier(root, key), model=MODEL)
    victim.call("open", tier=_tier(root, key), model=MODEL)
    assert survivor.call("store", keys=BASE)["present"] == BASE
    victim.send("victim", journal=journal, store_keys=list(range(2000, 2400)), load_keys=BASE)
    time.sleep(0.5)
    victim.kill()
    stored = read_journal(journal)
    assert read_journal(journal).wrong == []
    got = survivor.call("promote", keys=BASE + stored.stored)
    assert not got["wrong"]
    # Every completed store is served. (Once, on two xdist workers, the
    # stores of this victim were misses here, not seen again in 28 reruns:
    # the survivor's counters say why if it happens again.)
    missed = sorted(set(stored.stored) - set(got["hit"]))
    assert not missed, (
        f"completed stores not served: {missed} of {len(stored.stored)}; "
        f"misses {got['miss']}; survivor's counters {survivor.call('stats')}"
    )
    fresh = list(range(5000, 5016))
    assert survivor.call("store", keys=fresh)["present"] == fresh
    survivor.call("close")
    proc = subprocess.run(
        [sys.executable, "-m", "nvmetier.cli", "fsck", "--deep", "--key-file", key, root],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tags verified" in proc.stdout
