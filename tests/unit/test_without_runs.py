"""``nvmetier._table.without_runs``: a finished request's refresh keys less
the chunks its own loads refreshed, by identity (nvmetier.vllm.recency)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

_table = pytest.importorskip("nvmetier._table")


def _model(keys: list[object], runs: list[list[object]]) -> list[object]:
    gone = {id(k) for run in runs for k in run}
    return [k for k in keys if id(k) not in gone]


@given(
    n=st.integers(0, 600),
    picks=st.lists(st.lists(st.integers(0, 700), max_size=300), max_size=4),
)
def test_without_runs_answers_as_its_model(n: int, picks: list[list[int]]) -> None:
    keys = [b"key-%d" % i for i in range(n)]
    pool = keys + [b"other-%d" % i for i in range(100)]
    runs = [[pool[i % len(pool)] for i in pick] for pick in picks] if pool else []
    assert _table.without_runs(keys, runs) == _model(keys, runs)


def test_an_equal_key_that_is_another_object_is_kept() -> None:
    """Identity, never equality: a key no load of this request held (an equal
    bytes object from elsewhere) is still refreshed."""
    key = b"chunk-1"
    twin = bytes(bytearray(key))
    assert twin == key and twin is not key
    out = _table.without_runs([key, b"chunk-2"], [[twin]])
    assert out[0] is key and len(out) == 2


def test_the_order_and_the_objects_are_kept() -> None:
    keys = [b"a%d" % i for i in range(10)]
    out = _table.without_runs(keys, [keys[2:5], [keys[8]]])
    assert out == keys[:2] + keys[5:8] + keys[9:]
    assert all(a is b for a, b in zip(out, keys[:2] + keys[5:8] + keys[9:], strict=True))


def test_bad_arguments_raise_a_type_error() -> None:
    with pytest.raises(TypeError):
        _table.without_runs((b"a",), [])
    with pytest.raises(TypeError):
        _table.without_runs([b"a"], ())
    with pytest.raises(TypeError, match="each run must be a list"):
        _table.without_runs([b"a"], [(b"a",)])
