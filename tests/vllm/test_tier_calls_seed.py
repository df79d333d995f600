"""The native tier calls (``SubmitStore``, ``FinishedJobs``, ``ScheduleEnd``)
on the random block-hash seed path, in one process under vLLM's real
orchestrator.

vLLM builds the tiers before it draws its block-hash seed, so a tier built
with ``PYTHONHASHSEED`` unset opens the shared store and moves to a private
one at its first data-path call. Whichever call comes first (a store, a
lookup, a step with nothing to do, a step timed by the bench's
``_TierClock``), no chunk reaches the shared store, the instance's native
callables end up on the private store's calls (the same objects as before:
a wrapper of them stays valid), and the chunks are served back from it.
About 2 s.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from nvmetier._table import FinishedJobs, ScheduleEnd, SubmitStore
from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_offload.base import LookupResult

from nvmetier.vllm.harness import key_of
from tests.vllm.conftest import nvme_tier

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("first", ["store", "lookup", "step", "clocked-store"])
def test_a_random_seed_drawn_after_the_tier_moves_every_native_call_to_the_private_store(
    tmp_path, make_engine, monkeypatch, first: str
) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.setattr(kv_cache_utils, "_NONE_HASH_SEED", None)  # not drawn yet
    root = str(tmp_path / "kv")
    eng = make_engine([nvme_tier(root)])
    tier: Any = eng.tiers[0]
    shared = tier.store
    assert not tier.private_store
    natives = {
        name: vars(tier)[name] for name in ("get_finished_jobs", "on_schedule_end", "submit_store")
    }
    assert isinstance(natives["get_finished_jobs"], FinishedJobs)
    assert isinstance(natives["on_schedule_end"], ScheduleEnd)
    assert isinstance(natives["submit_store"], SubmitStore)
    shared_dirs = set(os.listdir(root))
    # EngineCore draws the seed now: xxhash, no PYTHONHASHSEED -> random.
    monkeypatch.setattr(kv_cache_utils, "_NONE_HASH_SEED", os.urandom(32).hex())
    keys = [key_of(i) for i in range(24)]
    if first == "lookup":
        assert set(eng.promote(keys[:4]).values()) == {LookupResult.MISS}
    elif first == "step":
        eng.step()
    elif first == "clocked-store":
        from nvmetier.bench.clock import _TierClock

        clock = _TierClock(tier)
    eng.store_all(keys)
    assert tier.private_store and tier.store is not shared
    # The same native objects, now on the private store's calls.
    for name, native in natives.items():
        own = vars(tier)[name]
        assert own is native or getattr(own, "__wrapped__", None) is native
    assert natives["submit_store"].submit == tier._submit_store
    assert natives["submit_store"].once is None
    assert natives["get_finished_jobs"].poll == tier._poll
    assert natives["on_schedule_end"].release == tier._release
    if first == "clocked-store":
        assert clock.by_method["submit_store"][1] > 0
        assert clock.by_method["get_finished_jobs"][1] > 0
        clock.remove()
        assert vars(tier)["submit_store"] is natives["submit_store"]
    # Nothing of ours in the shared store: its directory, created for
    # nothing, is gone; the chunks are in the private store and served.
    assert tier.store.stats()["slots_used"] == len(keys)
    assert os.listdir(root) == [tier.store_name] and tier.store_name not in shared_dirs
    eng.reset_primary()
    got = eng.promote(keys)
    assert set(got.values()) == {LookupResult.HIT}
    assert eng.verify(keys) == len(keys)
