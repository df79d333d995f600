"""nvmetier._table.HotRequest: the promotion guard's hot request, callable as
the tier's lookup(key, ctx) (native/nvt_hot_request.c).

The contract: a key of ``leased`` asked with the hot ``ctx`` (by identity)
leaves ``leased``, is appended to ``hits`` and is answered ``hit``, once;
every other call goes to ``fallback(key, ctx)`` with its arguments unchanged.
"""

from __future__ import annotations

import gc
import weakref

import pytest
from nvmetier._table import HotRequest


class Ctx:
    def __init__(self, req_id: str) -> None:
        self.req_id = req_id


def test_fresh_state_is_cold() -> None:
    hot = HotRequest()
    assert hot.ctx is None and hot.rnd is None and hot.req_id == ""
    assert hot.leased == set() and hot.planned == set() and hot.hits == []
    assert hot.n_leased == 0 and hot.fallback is None and hot.hit is True
    with pytest.raises(TypeError):
        HotRequest(1)


def test_leased_key_of_the_hot_request_is_a_hit_once() -> None:
    calls = []
    hot = HotRequest()
    hot.fallback = lambda key, ctx: calls.append((key, ctx)) or "fallback"
    hot.hit = "HIT"
    ctx = Ctx("r1")
    hot.ctx = ctx
    hot.leased = {b"a", b"b"}
    assert hot(b"a", ctx) == "HIT"
    assert hot.leased == {b"b"} and hot.hits == [b"a"]
    # Asked again: no longer leased, the fallback decides (the guard's MISS).
    assert hot(b"a", ctx) == "fallback"
    assert calls == [(b"a", ctx)]
    assert hot(b"b", ctx) == "HIT"
    assert hot.hits == [b"a", b"b"] and hot.leased == set()


def test_other_context_or_key_goes_to_the_fallback() -> None:
    seen = []
    hot = HotRequest()
    hot.fallback = lambda key, ctx: seen.append((key, ctx.req_id)) or False
    ctx, other, twin = Ctx("r1"), Ctx("r2"), Ctx("r1")
    hot.ctx = ctx
    hot.leased = {b"a"}
    assert hot(b"a", other) is False  # another request
    assert hot(b"a", twin) is False  # equal req_id, not the same context
    assert hot(b"z", ctx) is False  # not leased
    assert seen == [(b"a", "r2"), (b"a", "r1"), (b"z", "r1")]
    assert hot.leased == {b"a"} and hot.hits == []
    # Keyword arguments are passed through to the fallback as given.
    hot.fallback = lambda key, req_context: ("kw", key, req_context.req_id)
    assert hot(b"a", req_context=ctx) == ("kw", b"a", "r1")
    assert hot.leased == {b"a"}


def test_cold_request_never_answers_none_context() -> None:
    hot = HotRequest()
    hot.fallback = lambda key, ctx: "fallback"
    hot.leased = {b"a"}
    assert hot(b"a", None) == "fallback"  # ctx None is no hot request
    assert hot.leased == {b"a"}


def test_without_fallback_a_clear_error() -> None:
    hot = HotRequest()
    with pytest.raises(TypeError, match="fallback"):
        hot(b"a", Ctx("r"))


def test_unhashable_key_raises_and_changes_nothing() -> None:
    hot = HotRequest()
    hot.fallback = lambda key, ctx: False
    ctx = Ctx("r")
    hot.ctx = ctx
    hot.leased = {b"a"}
    with pytest.raises(TypeError):
        hot([1], ctx)
    assert hot.leased == {b"a"} and hot.hits == []


def test_members_of_other_types_or_deleted_take_the_fallback() -> None:
    hot = HotRequest()
    hot.fallback = lambda key, ctx: "fallback"
    ctx = Ctx("r")
    hot.ctx = ctx
    hot.leased = frozenset({b"a"})  # not a mutable set: nothing to remove from
    assert hot(b"a", ctx) == "fallback"
    hot.leased = {b"a"}
    hot.hits = ()  # not a list
    assert hot(b"a", ctx) == "fallback" and hot.leased == {b"a"}
    hot.hits = []
    del hot.leased
    assert hot.leased is None
    assert hot(b"a", ctx) == "fallback"
    del hot.fallback
    with pytest.raises(TypeError):
        hot(b"a", ctx)


def test_reference_cycle_through_the_fallback_is_collected() -> None:
    class Tier:
        def __init__(self) -> None:
            self.hot = HotRequest()
            self.hot.fallback = self.rest
            self.hot.ctx = self
            self.lookup = self.hot

        def rest(self, key, ctx):
            return False

    tier = Tier()
    ref = weakref.ref(tier)
    del tier
    gc.collect()
    assert ref() is None


def test_a_miss_member_maps_the_fallbacks_truth_to_hit_or_miss() -> None:
    answers = {b"on-disk": True, b"absent": False, b"odd": 0, b"many": [1]}
    hot = HotRequest()
    hot.fallback = lambda key, ctx: answers[key]
    hot.hit, hot.miss = "HIT", "MISS"
    ctx = Ctx("r")
    assert [hot(k, ctx) for k in answers] == ["HIT", "MISS", "MISS", "HIT"]
    # A fallback that raises, or whose result has no truth, raises through.
    hot.fallback = lambda key, ctx: answers[key]
    with pytest.raises(KeyError):
        hot(b"unknown", ctx)

    class NoTruth:
        def __bool__(self) -> bool:
            raise ValueError("no truth")

    hot.fallback = lambda key, ctx: NoTruth()
    with pytest.raises(ValueError, match="no truth"):
        hot(b"x", ctx)
    # miss None: the fallback's result as it is.
    hot.miss = None
    hot.fallback = lambda key, ctx: "as is"
    assert hot(b"x", ctx) == "as is"


def test_a_key_whose_hash_replaces_the_members_is_safe() -> None:
    # A key's own __hash__/__eq__ is Python code that may replace the sets
    # and the list the call is working on: the call keeps them alive.
    hot = HotRequest()
    ctx = Ctx("r")

    class Sneaky:
        def __init__(self, name: str) -> None:
            self.name = name

        def __hash__(self) -> int:
            hot.leased = set()
            hot.hits = []
            return hash(self.name)

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Sneaky) and other.name == self.name

    key = Sneaky("a")
    hot.ctx = ctx
    leased = {key}
    hot.leased = leased
    hits = hot.hits
    del leased
    hot.fallback = lambda key, ctx: "fallback"
    assert hot(key, ctx) is True  # answered from the set it started with
    assert hits == [key] and hot.hits == [] and hot.leased == set()


def test_a_fallback_that_replaces_itself_runs_to_its_end() -> None:
    hot = HotRequest()
    ctx = Ctx("r")

    def once(key, ctx):
        hot.fallback = lambda key, ctx: "second"
        return "first"

    hot.fallback = once
    del once
    assert hot(b"k", ctx) == "first"
    assert hot(b"k", ctx) == "second"


@pytest.mark.parametrize("when", ["__bool__", "__del__"])
def test_a_fallback_result_that_deletes_hit_and_miss_is_safe(when: str) -> None:
    # The miss mapping runs the result's __bool__ and then releases it (its
    # __del__): Python code that may delete hit and miss before the answer is
    # taken (a NULL member read back crashed the process).
    hot = HotRequest()
    hot.hit, hot.miss = "HIT", "MISS"

    class Result:
        def __init__(self, truth: bool) -> None:
            self.truth = truth

        def __bool__(self) -> bool:
            if when == "__bool__":
                del hot.hit, hot.miss
            return self.truth

        def __del__(self) -> None:
            if when == "__del__":
                del hot.hit, hot.miss
                gc.collect()

    for truth, answer in ((True, "HIT"), (False, "MISS")):
        hot.hit, hot.miss = "HIT", "MISS"
        hot.fallback = lambda key, ctx, truth=truth: Result(truth)
        # The members as the fallback returned: the answer it maps to.
        assert hot(b"k", Ctx("r")) == answer
        assert hot.hit is None and hot.miss is None
    # Both gone: the fallback's result as it is.
    hot.fallback = lambda key, ctx: "as is"
    assert hot(b"k", Ctx("r")) == "as is"


def test_no_reference_is_leaked_on_any_path() -> None:
    # Every path, many times: the references of the key, the context, the
    # answers and the fallback come back to what they were, and no memory
    # block is left behind (sys.getallocatedblocks: release builds too).
    import sys

    ctx, other = Ctx("r"), Ctx("o")
    hit, miss, key = object(), object(), b"k" * 16

    class Truth:
        def __init__(self, truth: bool) -> None:
            self.truth = truth

        def __bool__(self) -> bool:
            if self.truth is None:
                raise ValueError("no truth")
            return self.truth

    class BadEq:
        def __hash__(self) -> int:
            return hash(key)

        def __eq__(self, other: object) -> bool:
            raise ArithmeticError("no eq")

    yes, no, none = Truth(True), Truth(False), Truth(None)  # type: ignore[arg-type]
    bad = BadEq()

    def raising(k, c):
        raise KeyError(k)

    def raises(exc: type[BaseException], *call) -> None:
        try:
            call[0](*call[1:])
        except exc:
            return
        raise AssertionError(f"{exc.__name__} not raised")

    def hit_path(hot):
        hot.leased.add(key)
        assert hot(key, ctx) is hit
        hot.hits.clear()

    paths = {
        "hit": (lambda k, c: no, hit_path),
        "not leased": (lambda k, c: no, lambda hot: hot(key, ctx)),
        "other request": (lambda k, c: yes, lambda hot: hot(key, other)),
        "keywords": (lambda key, req_context: no, lambda hot: hot(key, req_context=ctx)),
        "result raises": (
            lambda k, c: none,
            lambda hot: raises(ValueError, hot, key, other),
        ),
        "fallback raises": (raising, lambda hot: raises(KeyError, hot, key, other)),
        "unhashable": (lambda k, c: no, lambda hot: raises(TypeError, hot, [], ctx)),
        "eq raises": (lambda k, c: no, lambda hot: raises(ArithmeticError, hot, bad, ctx)),
        "as is": (lambda k, c: yes, lambda hot: setattr(hot, "miss", None) or hot(key, other)),
    }
    for name, (fallback, call) in paths.items():
        hot = HotRequest()
        hot.ctx, hot.hit, hot.miss, hot.fallback = ctx, hit, miss, fallback
        if name == "eq raises":
            hot.leased = {key}
        watched = (key, ctx, other, hit, miss, yes, no, fallback, hot, hot.leased, hot.hits)
        for _ in range(200):  # warm up (caches, free lists)
            call(hot)
        gc.collect()
        refs = [sys.getrefcount(o) for o in watched]
        blocks = sys.getallocatedblocks()
        for _ in range(20000):
            call(hot)
        gc.collect()
        assert [sys.getrefcount(o) for o in watched] == refs, name
        assert sys.getallocatedblocks() - blocks < 50, name
