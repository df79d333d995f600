"""One store per node, shared live by every vLLM process (issue 10).

Each sharer is a separate process running vLLM's real tiering orchestrator
(``tests/vllm/sharer.py``); data-parallel ranks (same model, ``dp_index``
0..N-1) and separate instances (``dp_size=1`` each) open the same
``root_dir`` and stay open while they store and load each other's chunks.
Every chunk loaded is compared with the bytes its writer stored.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from nvmetier.config import parse_size
from nvmetier.files import store_held
from tests.vllm import conftest
from tests.vllm.sharer import (
    OP_TIMEOUT_S,
    RemoteError,
    Sharer,
    call_all,
    call_each,
    disk_bytes,
    files_under,
)

pytestmark = pytest.mark.timeout(120)

MODEL = "nvmetier/shared-model"


def nvme_tier(root: str, **kw: Any) -> dict[str, Any]:
    """The suite's tier dict (``conftest.nvme_tier``) with a 16 MiB store."""
    return conftest.nvme_tier(root, **{"capacity_bytes": "16MiB", **kw})


@pytest.fixture
def start() -> Iterator[Callable[[int], list[Sharer]]]:
    """Start sharer processes (ended at teardown, whatever their state)."""
    made: list[Sharer] = []

    def build(n: int) -> list[Sharer]:
        new = [Sharer(f"sharer{len(made) + i}") for i in range(n)]
        made.extend(new)
        return new

    yield build
    for s in made:
        s.close()


@pytest.fixture
def root(tmp_path) -> str:
    return str(tmp_path / "kv")


def open_all(sharers: Sequence[Sharer], root: str, mode: str = "instances", **tier_kw: Any) -> None:
    """Open every sharer's engine at once: DP ranks of one model, or
    separate instances of it."""
    n = len(sharers)

    def kwargs(i: int) -> dict[str, Any]:
        kw: dict[str, Any] = {"tier": nvme_tier(root, **tier_kw), "model": MODEL}
        if mode == "dp":
            kw.update(dp_index=i, dp_size=n)
        return kw

    call_each(sharers, "open", kwargs)


def key_range(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def soon(delay_s: float = 0.2) -> float:
    """A start time every sharer waits for (a barrier on the shared clock)."""
    return time.monotonic() + delay_s


# ---------------------------------------------------------------- sharing
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("mode", ["dp", "instances"])
def test_every_sharer_hits_every_chunk_another_stored_byte_exact(start, root, mode, n) -> None:
    sharers = start(n)
    open_all(sharers, root, mode)
    own = [key_range(1000 * i, 32) for i in range(n)]
    at = soon()
    stored = call_each(sharers, "store", lambda i: {"keys": own[i], "start_at": at})
    assert [r["present"] for r in stored] == own
    # Every sharer, all still open, loads every other sharer's chunks.
    others = [[k for j in range(n) if j != i for k in own[j]] for i in range(n)]
    loaded = call_each(sharers, "promote", lambda i: {"keys": others[i]})
    assert [r["miss"] for r in loaded] == [[]] * n
    assert [r["wrong"] for r in loaded] == [[]] * n


def test_a_finished_store_is_a_hit_for_the_next_lookup_of_another_process(start, root) -> None:
    a, b = start(2)
    open_all([a, b], root)
    for i in range(12):
        writer, reader = (a, b) if i % 2 == 0 else (b, a)
        keys = key_range(100 * i, 4)
        assert writer.call("store", keys=keys)["present"] == keys
        got = reader.call("promote", keys=keys)
        assert (got["miss"], got["wrong"]) == ([], []), f"round {i}"


@pytest.mark.parametrize("mode", ["dp", "instances"])
def test_sharers_gauge_counts_the_attached_processes(start, root, mode) -> None:
    sharers = start(3)
    open_all(sharers, root, mode)
    assert [s["sharers"] for s in call_all(sharers, "stats")] == [3, 3, 3]
    sharers[0].call("close")
    assert [s["sharers"] for s in call_all(sharers[1:], "stats")] == [2, 2]


def test_same_keys_stored_at_once_leave_one_copy(start, root) -> None:
    sharers = start(4)
    open_all(sharers, root)
    keys: list[int] = []
    for rnd in range(4):
        part = key_range(10_000 * rnd, 32)
        keys += part
        # Small batches so the four processes' store jobs interleave.
        at = soon()
        stored = call_all(sharers, "store", keys=part, batch=2, start_at=at)
        # Each process's store jobs finished: the chunks are there for all.
        assert [r["present"] for r in stored] == [part] * 4, f"round {rnd}"
    assert [s["slots_used"] for s in call_all(sharers, "stats")] == [len(keys)] * 4
    loaded = call_all(sharers, "promote", keys=keys)
    assert [(r["miss"], r["wrong"]) for r in loaded] == [([], [])] * 4


# ---------------------------------------------------------------- capacity
@pytest.mark.parametrize("mode", ["dp", "instances"])
def test_writers_under_eviction_pressure_stay_within_capacity_and_load_exact_bytes(
    start, root, mode
) -> None:
    capacity = "4MiB"
    sharers = start(4)
    open_all(sharers, root, mode, capacity_bytes=capacity)
    slots_total = call_all(sharers, "stats")[0]["slots_total"]
    per_writer = slots_total  # together four times what the store holds
    own = [key_range(100_000 * (i + 1), per_writer) for i in range(4)]
    every = [k for keys in own for k in keys]
    at = soon()
    for i, s in enumerate(sharers):
        s.send("mixed", store_keys=own[i], load_keys=every, seed=i, start_at=at)
    peak = 0
    deadline = time.monotonic() + OP_TIMEOUT_S
    while not all(s.conn.poll(0) for s in sharers):
        peak = max(peak, disk_bytes(root))
        assert time.monotonic() < deadline, "writers did not finish"
        time.sleep(0.005)
    results = [s.recv() for s in sharers]
    peak = max(peak, disk_bytes(root))
    assert peak <= parse_size(capacity)
    assert [r["wrong"] for r in results] == [[]] * 4
    # Some chunks were loaded back (most by a process other than the writer).
    assert sum(r["hit"] for r in results) > 0
    for stats in call_all(sharers, "stats"):
        assert stats["slots_used"] <= stats["slots_total"] == slots_total


def test_eviction_is_lru_over_every_sharers_accesses(start, root) -> None:
    # A fills half the store; B reads every other one of those chunks; then A
    # stores 5/8 of a store's worth of new chunks. In each set LRU evicts the
    # chunks nobody read first, so B's reads protect what B read: simulated
    # exact LRU keeps ~83% of the read chunks and ~47% of the others (the
    # difference was >= 0.25 for 300 random set assignments); an eviction
    # blind to B's reads keeps both alike (~65%).
    a, b = start(2)
    open_all([a, b], root, capacity_bytes="32MiB")
    n = a.call("stats")["slots_total"]
    old = key_range(0, n // 2)
    touched, untouched = old[::2], old[1::2]
    assert a.call("store", keys=old)["present"] == old
    assert b.call("promote", keys=touched)["miss"] == []
    time.sleep(0.05)
    a.call("store", keys=key_range(1_000_000, 5 * n // 8))
    kept_touched = len(b.call("promote", keys=touched)["hit"]) / len(touched)
    kept_untouched = len(b.call("promote", keys=untouched)["hit"]) / len(untouched)
    assert kept_touched >= kept_untouched + 0.15, (kept_touched, kept_untouched)


@pytest.mark.parametrize("mode", ["dp", "instances"])
def test_sharers_together_use_one_capacity_on_disk(start, root, mode) -> None:
    capacity = "8MiB"
    sharers = start(4)
    open_all(sharers, root, mode, capacity_bytes=capacity)
    call_each(sharers, "store", lambda i: {"keys": key_range(1000 * i, 16)})
    assert disk_bytes(root) <= parse_size(capacity)


# ---------------------------------------------------------------- isolation
def test_sharing_process_refuses_a_second_process(start, root) -> None:
    a, b = start(2)
    a.call("open", tier=nvme_tier(root, sharing="process"), model=MODEL)
    with pytest.raises(RemoteError) as err:
        b.call("open", tier=nvme_tier(root, sharing="process"), model=MODEL)
    assert err.value.kind == "nvmetier.errors.StoreLockedError"
    assert "in use" in err.value.message
    # The first process is unaffected.
    keys = key_range(0, 8)
    assert a.call("store", keys=keys)["present"] == keys


# ---------------------------------------------------------------- hash seeds
# vLLM's engine core builds the scheduler (and so the tiers) first and only
# then calls init_none_hash: "vllm_order" opens the tier before the seed is
# drawn, as a real engine does; "seed_first" draws it before.
ORDERS = ["vllm_order", "seed_first"]


def open_with_seed(
    s: Sharer, root: str, order: str, algo: str = "xxhash", pythonhashseed: str | None = None
) -> str:
    """Open ``s``'s engine and initialise vLLM's NONE_HASH seed as the
    engine core does, in ``order``; returns ``get_none_hash_seed()``."""
    kw = {"algo": algo, "pythonhashseed": pythonhashseed}
    seed = s.call("init_seed", **kw) if order == "seed_first" else ""
    s.call("open", tier=nvme_tier(root), model=MODEL)
    if order == "vllm_order":
        seed = s.call("init_seed", **kw)
    return str(seed)


def is_random(seed: str) -> bool:
    """os.urandom(32).hex(): not vLLM's fixed default ``vllm-none-hash``."""
    return len(seed) == 64 and seed != "vllm-none-hash"


def seed_warnings(s: Sharer) -> list[str]:
    return [msg for _name, msg in s.call("logged_warnings") if "PYTHONHASHSEED" in msg]


@pytest.mark.parametrize("order", ORDERS)
def test_random_hash_seed_warns_once_and_leaves_nothing_on_disk(start, root, order) -> None:
    (r,) = start(1)
    assert is_random(open_with_seed(r, root, order))
    keys = key_range(0, 32)
    r.call("store", keys=keys)
    # Its own chunks are served while it runs (a private store).
    got = r.call("promote", keys=keys)
    assert (got["miss"], got["wrong"]) == ([], [])
    assert len(seed_warnings(r)) == 1
    r.exit()
    assert files_under(root) == []


@pytest.mark.parametrize("order", ORDERS)
def test_random_hash_seed_store_of_a_killed_process_is_reclaimed_by_the_next_start(
    start, root, order
) -> None:
    victim, later = start(2)
    assert is_random(open_with_seed(victim, root, order))
    victim.call("store", keys=key_range(0, 32))
    victim.kill()
    assert files_under(root) != []  # its whole preallocated store is left
    # Its io_uring rings keep its lock until their queued I/O drained (the
    # kernel tears them down just after the exit): reclaim comes after that.
    deadline = time.monotonic() + 10.0
    while any(store_held(os.path.join(root, d)) for d in os.listdir(root)):
        assert time.monotonic() < deadline, "a dead process's lock never dropped"
        time.sleep(0.01)
    assert is_random(open_with_seed(later, root, order))
    later.call("store", keys=key_range(100, 8))
    later.exit()
    assert files_under(root) == []


@pytest.mark.parametrize("order", ORDERS)
def test_random_hash_seed_stores_nothing_in_the_shared_store(start, root, order) -> None:
    shared, r = start(2)
    shared.call("init_seed", algo="sha256", pythonhashseed=None)
    shared.call("open", tier=nvme_tier(root), model=MODEL)
    base = key_range(0, 16)
    assert shared.call("store", keys=base)["present"] == base
    before = files_under(root)
    assert is_random(open_with_seed(r, root, order))
    private = key_range(5000, 32)
    r.call("store", keys=private)
    assert shared.call("promote", keys=private)["hit"] == []
    assert shared.call("stats")["slots_used"] == len(base)
    r.exit()
    assert files_under(root) == before
    got = shared.call("promote", keys=base)
    assert (got["miss"], got["wrong"]) == ([], [])


@pytest.mark.parametrize("order", ORDERS)
def test_xxhash_with_pythonhashseed_set_shares_the_store(start, root, order) -> None:
    shared, x = start(2)
    shared.call("open", tier=nvme_tier(root), model=MODEL)
    assert open_with_seed(x, root, order, pythonhashseed="0") == "0"
    keys = key_range(0, 16)
    assert x.call("store", keys=keys)["present"] == keys
    got = shared.call("promote", keys=keys)
    assert (got["miss"], got["wrong"]) == ([], [])
    assert seed_warnings(x) == []
