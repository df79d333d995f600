"""``nvmetier._table.chunk_run``, the promotion plan's native layout of a
one-group request, against a model of its contract key by key (hypothesis):
the record's keys in order when every key is bytes ending with the group's
suffix and the i-th end token is (i + 1) * tokens_per_chunk, else None
(tests/vllm/test_plan_layout.py checks the plan's layout with it). Under a
second."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nvmetier._table import chunk_run


def model(positions: dict[Any, Any], suffix: bytes, tpc: int) -> list[Any] | None:
    keys = list(positions)
    if not all(isinstance(k, bytes) and k.endswith(suffix) for k in keys):
        return None
    ends = list(positions.values())
    if not all(type(e) is int for e in ends):
        return None
    if ends != [(i + 1) * tpc for i in range(len(ends))]:
        return None
    return keys


SUFFIXES = [b"\x00\x00\x00\x00", b"\x00\x00\x00\x01", b""]


@st.composite
def records(draw: Any) -> tuple[dict[Any, Any], bytes, int]:
    suffix = draw(st.sampled_from(SUFFIXES))
    tpc = draw(st.sampled_from([1, 16, 32]))
    n = draw(st.integers(0, 12))
    positions: dict[Any, Any] = {}
    for i in range(n):
        body = draw(st.binary(min_size=0, max_size=6))
        key: Any = body + draw(st.sampled_from([suffix, *SUFFIXES, b"\x00\x00\x01"]))
        if draw(st.integers(0, 30)) == 0:
            key = key.decode("latin-1")  # not bytes
        end: Any = (i + 1) * tpc
        roll = draw(st.integers(0, 20))
        if roll == 0:
            end += draw(st.sampled_from([-1, 1, tpc]))
        elif roll == 1:
            end = float(end)  # equal, not an int: the general path's
        elif roll == 2:
            end = 1 << 70  # past a C long long
        positions[key] = end
    return positions, suffix, tpc


@settings(max_examples=200, deadline=None)
@given(records())
def test_chunk_run_answers_as_its_model(record: tuple[dict[Any, Any], bytes, int]) -> None:
    positions, suffix, tpc = record
    assert chunk_run(positions, suffix, tpc) == model(positions, suffix, tpc)


def test_chunk_run_keeps_the_key_objects_and_rejects_bad_arguments() -> None:
    keys = [i.to_bytes(8, "big") + b"\x00\x00\x00\x02" for i in range(300)]
    positions = {k: (i + 1) * 16 for i, k in enumerate(keys)}
    out = chunk_run(positions, b"\x00\x00\x00\x02", 16)
    assert out is not None and all(a is b for a, b in zip(out, keys, strict=True))
    assert chunk_run(positions, b"\x00\x00\x00\x02", 0) is None
    assert chunk_run(positions, b"\x00\x00\x00\x02", -16) is None
    with pytest.raises(TypeError):
        chunk_run(list(positions), b"\x00\x00\x00\x02", 16)
