"""``Table.touch(keys, loaded)``: a finished request's refresh of the disk's
recency, less the chunks its own loads marked (native/nvt_refresh.c).

The contract, checked against a plain model of per-set LRU order:

- a load (``load_ops``) marks its keys used, last to first;
- ``touch(keys)`` marks every READY key in order (the later, the more recent);
- ``touch(keys, loaded)`` leaves a key of a ``loaded`` job list (the same
  object) as its load left it, unless its set also holds a key of ``keys``
  that no load took, or the loads left the set's keys in another order than
  the refresh's (several jobs: a later one marked chunks after an earlier
  one's head): there it marks every key of ``keys`` in that set, in order,
  as ``touch(keys)`` would. A key only equal to a loaded one (another
  object) is marked. It returns the READY keys marked plus the keys left to
  their load's mark.

A set's order is read the way eviction reads it: new keys stored into the
set one at a time evict the least recently used first.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import xxhash

from tests.unit.mem_table import MemTable

_table = pytest.importorskip("nvmetier._table")

WAYS = 8


class Table(MemTable):
    """A real slot table of `sets` sets of WAYS ways, in memory."""

    def __init__(self, sets: int) -> None:
        super().__init__(sets * WAYS, WAYS, prefix="nvt-refresh-")
        self.sets = sets
        self.fresh = 0

    def set_of(self, key: bytes) -> int:
        return xxhash.xxh3_64_intdigest(key, 0) % self.sets

    def load(self, keys: list[bytes]) -> None:
        """A load's table side: its ops built (each key marked), then
        completed (their leases released)."""
        self.job += 1
        packed, missing = self.t.load_ops(
            self.job, keys, np.zeros(len(keys), dtype=np.int64), False
        )
        assert missing is None
        self.complete(packed)

    def fresh_key_in(self, s: int) -> bytes:
        while True:
            self.fresh += 1
            key = b"fresh-%d" % self.fresh
            if self.set_of(key) == s:
                return key

    def lru_order(self, s: int, held: list[bytes]) -> list[bytes]:
        """The keys of `held` in set `s`, least recently used first (read by
        evicting them all: the table is spent afterwards)."""
        left = [k for k in held if self.set_of(k) == s]
        out: list[bytes] = []
        while left:
            self.store([self.fresh_key_in(s)])
            present = self.t.contains_many(left)
            gone = [k for k, p in zip(left, present, strict=True) if not p]
            assert len(gone) <= 1, "one store evicts one key"
            out += gone
            left = [k for k, p in zip(left, present, strict=True) if p]
        return out


class Model:
    """Per-set LRU order: a list per set, least recent first."""

    def __init__(self, set_of) -> None:
        self.set_of = set_of
        self.order: dict[int, list[bytes]] = {}

    def mark(self, key: bytes) -> None:
        lst = self.order.setdefault(self.set_of(key), [])
        if key in lst:
            lst.remove(key)
        lst.append(key)

    def refresh(self, keys: list[bytes], loaded_jobs: list[list[bytes]]) -> tuple[int, int]:
        """``touch(keys, loaded_jobs)``: (keys marked, keys left to their load)."""
        loaded_ids = {id(k) for job in loaded_jobs for k in job}
        # The loads' marks, replayed: jobs in order, each last to first.
        last: dict[bytes, int] = {}
        clock = 0
        for job in loaded_jobs:
            for k in reversed(job):
                clock += 1
                last[k] = clock
        full = {self.set_of(k) for k in keys if id(k) not in loaded_ids}
        # A set whose loads left its keys in another order than the refresh
        # (from its end: each older than the one after it) is marked in full.
        seen: set[bytes] = set()
        newest: dict[int, int] = {}
        for k in reversed(keys):
            s = self.set_of(k)
            if id(k) not in loaded_ids or s in full or k in seen:
                continue
            seen.add(k)
            if last[k] >= newest.get(s, 1 << 62):
                full.add(s)
            else:
                newest[s] = last[k]
        marked = left = 0
        for k in keys:
            if id(k) not in loaded_ids or self.set_of(k) in full:
                self.mark(k)
                marked += 1
            else:
                left += 1
        return marked, left


def _keys(n: int, tag: str) -> list[bytes]:
    return [b"%s-%d" % (tag.encode(), i) for i in range(n)]


@pytest.mark.parametrize("seed", range(40))
def test_refresh_leaves_what_loads_marked_and_keeps_the_requests_order(seed: int) -> None:
    rng = random.Random(seed)
    sets = rng.choice([1, 2, 4, 8])
    t = Table(sets)
    try:
        model = Model(t.set_of)
        # Up to half of each set: the request's chunks and others'.
        capacity = sets * WAYS // 2
        request = _keys(rng.randint(1, capacity - 1), f"req{seed}")
        others = _keys(capacity - len(request), f"oth{seed}")
        every = request + others
        rng.shuffle(every)
        # Stored in a random order, counted per set so that none overflows.
        stored = []
        per_set: dict[int, int] = {}
        for k in every:
            s = t.set_of(k)
            if per_set.get(s, 0) < WAYS - 1:
                per_set[s] = per_set.get(s, 0) + 1
                stored.append(k)
        for k in stored:
            t.store([k])
            model.mark(k)
        request = [k for k in request if k in stored]
        if not request:
            return
        # The request's loads: runs of its chunks, each marked last to first.
        loaded_jobs: list[list[bytes]] = []
        i = 0
        while i < len(request):
            n = rng.randint(1, 4)
            if rng.random() < 0.6:
                job = request[i : i + n]
                t.load(job)
                for k in reversed(job):
                    model.mark(k)
                loaded_jobs.append(job)
            i += n
        # Others used meanwhile.
        for k in rng.sample(
            [k for k in stored if k not in request], k=min(3, len(stored) - len(request))
        ):
            t.load([k])
            model.mark(k)
        # The refresh: tail first, head last; some keys only equal copies.
        refresh = list(reversed(request))
        refresh = [bytes(bytearray(k)) if rng.random() < 0.2 else k for k in refresh]
        marked, left = model.refresh(refresh, loaded_jobs)
        assert t.t.touch(refresh, loaded_jobs) == marked + left
        for s in range(sets):
            assert t.lru_order(s, stored) == model.order.get(s, []), f"set {s}"
    finally:
        t.close()


def test_a_request_all_loaded_is_not_marked_again() -> None:
    # One set: the loaded request, then another key stored after its load.
    # The refresh leaves the request's keys older than that key.
    t = Table(1)
    try:
        req = _keys(4, "r")
        t.store(req)
        t.load(req)
        later = b"later"
        t.store([later])
        assert t.t.touch(list(reversed(req)), [req]) == 4
        order = t.lru_order(0, [*req, later])
        assert order == [*reversed(req), later]  # head marked last by its load
        # Without `loaded` (or with only equal copies), all marked after `later`.
        t2 = Table(1)
        try:
            t2.store(req)
            t2.load(req)
            t2.store([later])
            copies = [bytes(bytearray(k)) for k in req]
            assert t2.t.touch(list(reversed(req)), [copies]) == 4
            assert t2.lru_order(0, [*req, later]) == [later, *list(reversed(req))]
        finally:
            t2.close()
    finally:
        t.close()


def test_a_key_no_load_took_marks_its_whole_set_in_order() -> None:
    t = Table(1)
    try:
        head = _keys(3, "h")
        computed = b"computed-tail"
        t.store([*head, computed])
        t.load(head)
        t.store([b"later"])
        refresh = [computed, *reversed(head)]
        assert t.t.touch(refresh, [head]) == 4
        # Every key of the request marked now, in the refresh's order.
        assert t.lru_order(0, [*head, computed, b"later"]) == [b"later", computed, *reversed(head)]
    finally:
        t.close()


def test_bad_arguments_are_refused_before_any_mark() -> None:
    t = Table(1)
    try:
        req = _keys(2, "r")
        t.store(req)
        with pytest.raises(TypeError, match="sequence of key sequences"):
            t.t.touch(req, 5)
        with pytest.raises(TypeError, match="sequence of key sequences"):
            t.t.touch(req, [5])
        with pytest.raises(TypeError, match="must be bytes"):
            t.t.touch([*req, "str"], [req[:1]])
        with pytest.raises(TypeError, match="1 or 2 arguments"):
            t.t.touch()
        assert t.t.touch(req, None) == 2
        assert t.t.touch(req, []) == 2
        assert t.t.touch([], [req]) == 0
    finally:
        t.close()


def _request_order(order: list[bytes], request: set[bytes]) -> list[bytes]:
    return [k for k in order if k in request]


@pytest.mark.parametrize("seed", range(60))
def test_the_requests_order_in_each_set_is_a_full_refreshs(seed: int) -> None:
    """The contract itself: whatever the request's loads (several jobs, in
    any order, overlapping, a key twice, equal copies), its chunks end in
    each set in the order ``touch(keys)`` would leave them."""
    rng = random.Random(1000 + seed)
    sets = rng.choice([1, 1, 2, 4])
    request = _keys(rng.randint(2, sets * (WAYS - 1)), f"c{seed}")
    per_set: dict[int, int] = {}
    kept = []
    for k in request:
        s = xxhash.xxh3_64_intdigest(k, 0) % sets
        if per_set.get(s, 0) < WAYS - 1:
            per_set[s] = per_set.get(s, 0) + 1
            kept.append(k)
    request = kept
    jobs: list[list[bytes]] = []
    for _ in range(rng.randint(1, 4)):
        a = rng.randrange(len(request))
        job = request[a : a + rng.randint(1, 4)]
        if rng.random() < 0.2:
            job = job + job[:1]  # a key twice in one job
        if rng.random() < 0.2:
            job = [bytes(bytearray(k)) for k in job]  # equal copies only
        jobs.append(job)
    refresh = list(reversed(request))
    if rng.random() < 0.3:
        refresh.append(refresh[rng.randrange(len(refresh))])  # a key twice
    wanted = set(request)
    orders = []
    for loaded in (None, jobs):
        t = Table(sets)
        try:
            t.store(request)
            for job in jobs:
                t.load(job)
            t.t.touch(refresh, loaded)
            orders.append([_request_order(t.lru_order(s, request), wanted) for s in range(sets)])
        finally:
            t.close()
    assert orders[1] == orders[0]


def test_a_later_job_of_the_requests_tail_leaves_its_set_marked_in_full() -> None:
    # Two loads of one request: its head, then (a later step) its tail. The
    # tail's marks came last: the refresh marks the set again, head last.
    t = Table(1)
    try:
        req = _keys(4, "r")
        t.store(req)
        head, tail = req[:2], req[2:]
        t.load(head)
        t.load(tail)
        assert t.t.touch(list(reversed(req)), [head, tail]) == 4
        assert t.lru_order(0, req) == list(reversed(req))
    finally:
        t.close()


def test_an_allocation_failure_marks_nothing_and_raises() -> None:
    # Each allocation point of the refresh failing in turn: MemoryError and
    # no mark, or (past its last point) the refresh as without failures.
    req = _keys(6, "a")
    failed = 0
    for point in range(16):
        t = Table(1)
        try:
            t.store(req)
            t.load(req[:3])
            t.store([b"later"])
            _table._fail_allocs(point, 1)
            try:
                t.t.touch([b"computed", *reversed(req)], [req[:3]])
            except MemoryError:
                failed += 1
                _table._fail_allocs(0, 0)
                # Nothing marked: the tail as stored, the head as loaded,
                # then `later`.
                assert t.lru_order(0, [*req, b"later"]) == [
                    *req[3:],
                    *reversed(req[:3]),
                    b"later",
                ]
                continue
            _table._fail_allocs(0, 0)
            assert t.lru_order(0, [*req, b"later"]) == [b"later", *reversed(req)]
            break
        finally:
            _table._fail_allocs(0, 0)
            t.close()
    assert failed >= 4  # every table of the refresh
