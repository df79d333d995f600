"""nvmetier._table.GuardCall on its own (no vLLM): what its C path changes
and what it leaves to `slow`, with plain containers; the promotion guard's
equivalence is tests/vllm/test_guard_calls.py. Run under the sanitizers too
(scripts/sanitize.sh): references of ids, contexts and the step count."""

from __future__ import annotations

import gc
import sys
import weakref
from typing import Any

import pytest
from nvmetier._table import GuardCall, HotRequest


class _Guard:
    """The two attributes a GuardCall sets (weak-referenceable, for the cycle test)."""

    def __init__(self) -> None:
        self._step: Any = 10
        self._quiet = True


def _parts() -> tuple[Any, list[Any], dict[str, Any], list[Any]]:
    guard = _Guard()
    waiting = {f"r{i}": object() for i in range(4)}
    slow_calls: list[Any] = []
    state = [waiting, {}, set(), [], {}, HotRequest()]
    return guard, state, waiting, slow_calls


def test_end_step_counts_the_step_and_drops_the_scheduled_ids() -> None:
    guard, state, waiting, calls = _parts()
    ctx = waiting["r1"]
    refs = sys.getrefcount(ctx)
    call = GuardCall("end_step", guard, calls.append, *state)
    for _ in range(3):
        call(["r1", "absent", "r2"], [])
    assert guard._step == 13 and guard._quiet is False and calls == []
    assert sorted(waiting) == ["r0", "r3"]
    assert sys.getrefcount(ctx) == refs - 1  # the map's reference only was dropped


def test_finish_drops_the_id_and_clears_quiet() -> None:
    guard, state, waiting, calls = _parts()
    call = GuardCall("finish", guard, calls.append, *state)
    call("r0")
    call("absent")
    assert sorted(waiting) == ["r1", "r2", "r3"] and guard._step == 10 and guard._quiet is False


@pytest.mark.parametrize("slot", [1, 2, 3, 4, 5])
def test_anything_open_goes_to_slow(slot: int) -> None:
    guard, state, waiting, calls = _parts()
    if slot == 1:
        state[1]["r9"] = object()
    elif slot == 2:
        state[2].add("r9")
    elif slot == 3:
        state[3].append(1)
    elif slot == 4:
        state[4][b"k"] = "r9"
    else:
        state[5].ctx = object()
    call = GuardCall("end_step", guard, lambda *a: calls.append(a), *state)
    call(["r0"], [])
    call(["r0"], ["r1"])
    assert calls == [(["r0"], []), (["r0"], ["r1"])] and "r0" in waiting and guard._step == 10


def test_a_step_count_that_is_not_a_number_raises_and_changes_nothing_else() -> None:
    guard, state, waiting, calls = _parts()
    guard._step = None
    with pytest.raises(TypeError):
        GuardCall("end_step", guard, calls.append, *state)(["r0"], [])
    assert "r0" in waiting


def test_an_id_whose_hash_raises_propagates() -> None:
    class Bad:
        def __hash__(self) -> int:
            raise RuntimeError("no hash")

    guard, state, waiting, calls = _parts()
    with pytest.raises(RuntimeError, match="no hash"):
        GuardCall("finish", guard, calls.append, *state)(Bad())
    with pytest.raises(RuntimeError, match="no hash"):
        GuardCall("end_step", guard, calls.append, *state)(["r0", Bad(), "r1"], [])
    assert "r0" not in waiting and "r1" in waiting  # stopped where it raised


def test_a_guard_call_in_a_cycle_is_collected() -> None:
    guard, state, _waiting, calls = _parts()
    call = GuardCall("end_step", guard, calls.append, *state)
    guard.call = call  # guard -> call -> guard
    ref = weakref.ref(guard)
    del guard, call
    gc.collect()
    assert ref() is None


def test_a_key_error_from_an_ids_hash_or_eq_propagates_as_dict_pop_does() -> None:
    # waiting.pop(req_id, None) swallows only the absent key: a KeyError the
    # id's own __hash__ or __eq__ raises propagates.
    class HashKeyError:
        def __hash__(self) -> int:
            raise KeyError("from hash")

    class EqKeyError:
        def __hash__(self) -> int:
            return hash("r0")

        def __eq__(self, other: object) -> bool:
            raise KeyError("from eq")

    for bad in (HashKeyError(), EqKeyError()):
        with pytest.raises(KeyError):
            {"r0": 1}.pop(bad, None)
        guard, state, waiting, calls = _parts()
        with pytest.raises(KeyError):
            GuardCall("finish", guard, calls.append, *state)(bad)
        with pytest.raises(KeyError):
            GuardCall("end_step", guard, calls.append, *state)(["r1", bad, "r2"], [])
        assert "r1" not in waiting and "r2" in waiting and "r0" in waiting


def test_the_step_count_is_added_to_in_place_as_step_plus_equals_one() -> None:
    class InPlaceOnly:
        def __iadd__(self, other: int) -> int:
            return 100 + other

    guard, state, _waiting, calls = _parts()
    guard._step = InPlaceOnly()
    GuardCall("end_step", guard, calls.append, *state)(["r0"], [])
    assert guard._step == 101 and calls == []


@pytest.mark.parametrize("new", [None, 0, "", b""])
def test_falsy_scheduled_ids_are_not_iterated_as_the_method_does_not(new: Any) -> None:
    # end_step tests `if new_req_ids:` before it walks them: a falsy
    # argument that is not iterable (None) is no scheduled request.
    guard, state, waiting, calls = _parts()
    call = GuardCall("end_step", guard, lambda *a: calls.append(a), *state)
    call(new, ())
    assert len(waiting) == 4
    assert calls == [(new, ())] or guard._step == 11


def test_scheduled_ids_whose_truth_raises_go_to_the_method() -> None:
    class NoTruth(list):  # type: ignore[type-arg]
        def __bool__(self) -> bool:
            raise ValueError("ambiguous")

    guard, state, waiting, calls = _parts()
    call = GuardCall("end_step", guard, lambda *a: calls.append(a), *state)
    ids = NoTruth(["r0"])
    call(ids, ())
    call((), NoTruth())
    assert calls[0][0] is ids and len(calls) == 2
    assert len(waiting) == 4 and guard._step == 10
