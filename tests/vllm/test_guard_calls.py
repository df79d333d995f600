"""nvmetier._table.GuardCall: the promotion guard's end of step and request
finish in C while no round is open (native/nvt_guard_calls.c), its own
method otherwise.

The contract: a GuardCall made by ``PromotionGuard.end_step_call()`` or
``finish_call()`` leaves the guard exactly as the method would (the waiting
map, the step count; its quiet state may only be cleared), for every state
the guard can be in and every argument vLLM passes; a call the C path does
not answer is the method's own call, arguments as given, exceptions
included. The promotion property tests drive the guard through these calls
too (``tests/vllm/walk_model.py``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nvmetier._table import GuardCall, HotRequest

from nvmetier.vllm.promotion import PromotionGuard

IDS = [f"req-{i}" for i in range(6)]


def _guard(waiting: list[str]) -> PromotionGuard:
    guard = PromotionGuard(64, 1.0)
    for req_id in waiting:
        guard.track(SimpleNamespace(req_id=req_id))
    return guard


def _state(guard: PromotionGuard) -> tuple[Any, ...]:
    return (list(guard._waiting), guard._step, dict(guard._rounds), set(guard._protect_spent))


def _busy(guard: PromotionGuard, how: str) -> None:
    """Open what keeps a call off the C path."""
    if how == "round":
        guard._rounds["req-0"] = object()  # type: ignore[assignment]
    elif how == "protect_spent":
        guard._protect_spent.add("req-1")
    elif how == "pending":
        guard._pending.append(([b"k"], "req-1"))
    elif how == "unloaded":
        guard._unloaded[b"k"] = "req-1"
    elif how == "hot":
        guard._hot.ctx = SimpleNamespace(req_id="req-2")


@settings(max_examples=300, deadline=None)
@given(
    waiting=st.lists(st.sampled_from(IDS), unique=True),
    calls=st.lists(
        st.one_of(
            st.tuples(st.just("end_step"), st.lists(st.sampled_from(IDS)), st.booleans()),
            st.tuples(st.just("finish"), st.sampled_from(IDS), st.just(False)),
            st.tuples(st.just("track"), st.sampled_from(IDS), st.just(False)),
        ),
        max_size=12,
    ),
)
def test_an_idle_guard_ends_steps_and_finishes_as_its_methods_do(
    waiting: list[str], calls: list[tuple[str, Any, bool]]
) -> None:
    native, python = _guard(waiting), _guard(waiting)
    end_step, finish = native.end_step_call(), native.finish_call()
    assert type(end_step) is GuardCall and type(finish) is GuardCall
    for what, arg, as_tuple in calls:
        if what == "end_step":
            fresh = tuple(arg) if as_tuple else arg
            end_step(fresh, ())
            python.end_step(fresh, ())
        elif what == "finish":
            finish(arg)
            python.finish(arg)
        else:
            for g in (native, python):
                g.track(SimpleNamespace(req_id=arg))
        assert _state(native) == _state(python)
        assert native._quiet in (False, python._quiet)  # only ever cleared


@pytest.mark.parametrize(
    "how", ["round", "protect_spent", "pending", "unloaded", "hot", "preempted"]
)
def test_a_guard_with_anything_open_ends_its_step_in_its_own_method(how: str) -> None:
    guard = _guard(IDS)
    calls: list[tuple[Any, ...]] = []
    call = GuardCall("end_step", guard, lambda *a, **k: calls.append((a, k)), *guard._idle_state())
    if how != "preempted":
        _busy(guard, how)
    preempted = ["req-3"] if how == "preempted" else []
    before = _state(guard)
    assert call(["req-4"], preempted) is None
    assert calls == [((["req-4"], preempted), {})]
    assert _state(guard) == before  # the C path did nothing


@pytest.mark.parametrize("how", ["round", "protect_spent", "hot"])
def test_a_request_with_anything_open_finishes_in_the_guards_method(how: str) -> None:
    guard = _guard(IDS)
    calls: list[tuple[Any, ...]] = []
    call = GuardCall("finish", guard, lambda *a, **k: calls.append((a, k)), *guard._idle_state())
    _busy(guard, how)
    before = _state(guard)
    call(req_id="req-4")
    assert calls == [((), {"req_id": "req-4"})]
    assert _state(guard) == before


def test_pending_hits_do_not_keep_a_finish_off_the_c_path() -> None:
    # finish never reads the HITs waiting for their load (end_step counts them).
    guard = _guard(IDS)
    _busy(guard, "pending")
    _busy(guard, "unloaded")
    guard.finish_call()("req-4")
    assert "req-4" not in guard._waiting and guard._pending and guard._unloaded


def test_the_c_path_takes_vllms_keywords_and_the_methods_defaults() -> None:
    guard, twin = _guard(IDS), _guard(IDS)
    end_step = guard.end_step_call()
    end_step(new_req_ids={"req-0"}, preempted_req_ids=set())
    twin.end_step(new_req_ids={"req-0"}, preempted_req_ids=set())
    end_step()
    twin.end_step()
    end_step(("req-1",))
    twin.end_step(("req-1",))
    assert _state(guard) == _state(twin) and guard._step == 3


@pytest.mark.parametrize(
    ("kind", "args", "kwargs"),
    [
        ("end_step", (["req-0"], [], "extra"), {}),
        ("end_step", (), {"new_ids": ["req-0"]}),
        ("end_step", (["req-0"],), {"new_req_ids": ["req-1"]}),
        ("finish", (), {}),
        ("finish", ("req-0", "req-1"), {}),
        ("finish", (), {"request": "req-0"}),
    ],
)
def test_arguments_the_method_refuses_are_refused_as_the_method_refuses_them(
    kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    guard = _guard(IDS)
    call = guard.end_step_call() if kind == "end_step" else guard.finish_call()
    with pytest.raises(TypeError) as native:
        call(*args, **kwargs)
    with pytest.raises(TypeError) as python:
        getattr(guard, kind)(*args, **kwargs)
    assert str(native.value) == str(python.value)
    assert _state(guard) == _state(_guard(IDS))


def test_bad_ids_raise_as_the_method_raises() -> None:
    guard = _guard(IDS)
    with pytest.raises(TypeError):
        guard.end_step_call()(5, ())  # not iterable
    with pytest.raises(TypeError):
        guard.end_step_call()([["unhashable"]], ())
    with pytest.raises(TypeError):
        guard.finish_call()(["unhashable"])
    guard.end_step_call()(iter(["req-0", "req-1"]), ())  # any iterable, once
    assert "req-0" not in guard._waiting and "req-1" not in guard._waiting


def test_a_subclass_that_overrides_a_method_keeps_it() -> None:
    seen: list[str] = []

    class Mine(PromotionGuard):
        def end_step(self, new_req_ids: Any = (), preempted_req_ids: Any = ()) -> None:
            seen.append("end_step")
            super().end_step(new_req_ids, preempted_req_ids)

        def finish(self, req_id: str) -> None:
            seen.append("finish")
            super().finish(req_id)

    guard = Mine(64)
    guard.end_step_call()(["req-0"], ())
    guard.finish_call()("req-0")
    assert seen == ["end_step", "finish"]


def test_a_guard_call_is_refused_without_the_guards_own_containers() -> None:
    guard = _guard([])
    state = list(guard._idle_state())
    with pytest.raises(ValueError, match="kind must be"):
        GuardCall("start_step", guard, guard.end_step, *state)
    with pytest.raises(TypeError):
        GuardCall("finish", guard, guard.finish, *state[:5], object())  # hot not a HotRequest
    with pytest.raises(TypeError):
        GuardCall("finish", guard, "not callable", *state)
    for i, wrong in enumerate([[], [], [], {}, [], HotRequest()]):
        if i == 5:
            continue
        bad = list(state)
        bad[i] = wrong
        with pytest.raises(TypeError):
            GuardCall("finish", guard, guard.finish, *bad)


def test_a_deleted_hot_context_keeps_the_call_off_the_c_path() -> None:
    guard = _guard(IDS)
    calls: list[Any] = []
    call = GuardCall("finish", guard, calls.append, *guard._idle_state())
    del guard._hot.ctx
    call("req-0")
    assert calls == ["req-0"] and "req-0" in guard._waiting


@pytest.mark.parametrize("kind", ["finish", "end_step"])
def test_what_a_finalizer_opens_during_the_pop_is_handled_as_the_method_does(kind: str) -> None:
    # The method tests protect_spent, rounds (finish), pending and unloaded
    # (end_step) after its pop: a finalizer that fills them then is seen.
    def run(native: bool) -> tuple[Any, ...]:
        guard = _guard([])

        class Ctx:
            req_id = "r"

            def __del__(self) -> None:
                rnd = SimpleNamespace(
                    pinned=set(), landing={1}, in_flight_n=0, ctx=None, generation=0
                )
                guard._rounds["r"] = rnd  # type: ignore[assignment]
                guard._protect_spent.add("r")
                guard._pending.append(([], "r"))

        guard._waiting["r"] = Ctx()  # type: ignore[assignment]
        if kind == "finish":
            (guard.finish_call() if native else guard.finish)("r")
        else:
            (guard.end_step_call() if native else guard.end_step)(["r"], set())
        rnd = guard._rounds.get("r")
        return (
            _state(guard)[:2],
            set(guard._protect_spent),
            list(guard._pending),
            None if rnd is None else (rnd.landing, rnd.in_flight_n),
        )

    assert run(True) == run(False)


class _View:
    """The two calls of a CPU tier view a quiet end of step reads."""

    def __init__(self) -> None:
        self._cache_generation = 0

    def generation(self) -> int:
        return int(self._cache_generation)

    def generation_call(self) -> Any:
        return lambda: self._cache_generation


def _quiet_guard() -> tuple[PromotionGuard, list[Any], Any, _View]:
    """A guard with a round open whose last end of step left it quiet."""
    guard = _guard(IDS)
    view = _View()
    guard._view = view  # type: ignore[assignment]
    guard._generation = view.generation_call()
    guard._rounds["req-0"] = object()  # type: ignore[assignment]
    guard._set_quiet(True)
    calls: list[Any] = []
    call = GuardCall("end_step", guard, lambda *a: calls.append(a), *guard._idle_state())
    return guard, calls, call, view


def test_a_quiet_step_with_rounds_open_is_counted_in_c() -> None:
    guard, calls, call, _view = _quiet_guard()
    for ids in ((), [], set(), frozenset()):
        call(ids, ids)
    call()
    assert calls == [] and guard._step == 5 and guard._quiet is True
    assert list(guard._waiting) == IDS  # nothing else touched


@pytest.mark.parametrize("change", ["scheduled", "preempted", "generation", "not_quiet", "odd_ids"])
def test_anything_but_a_quiet_step_goes_to_the_method(change: str) -> None:
    guard, calls, call, view = _quiet_guard()
    fresh: Any = []
    preempted: Any = []
    if change == "scheduled":
        fresh = ["req-1"]
    elif change == "preempted":
        preempted = ["req-1"]
    elif change == "generation":
        view._cache_generation = 1  # vLLM reset its CPU tier since
    elif change == "not_quiet":
        guard._quiet = False
    else:
        fresh = {}  # not a list, tuple or set: the method decides
    call(fresh, preempted)
    assert calls == [(fresh, preempted)] and guard._step == 0


def test_a_quiet_step_counts_as_the_method_does_without_a_view() -> None:
    guard, twin = _guard(IDS), _guard(IDS)
    for g in (guard, twin):
        g._rounds["req-0"] = object()  # type: ignore[assignment]
        g._set_quiet(True)
    guard.end_step_call()([], [])
    twin.end_step([], [])
    assert guard._step == twin._step == 1 and guard._quiet is twin._quiet is True


def test_the_views_generation_call_answers_as_generation() -> None:
    from nvmetier.vllm.cpu_view import PrimaryView

    primary = SimpleNamespace(_cache_generation=7)
    view = PrimaryView.__new__(PrimaryView)
    view._primary = primary  # type: ignore[attr-defined]
    call = view.generation_call()
    assert call() == view.generation() == 7
    primary._cache_generation = 8
    assert call() == view.generation() == 8
    del primary._cache_generation
    assert call() == view.generation() == 0
