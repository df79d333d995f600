"""SlotIndex: hash addressing, eviction order and pins (no disk)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nvmetier import format as fmt
from nvmetier.index import SlotIndex, SlotState


def _fill_set(idx: SlotIndex, seed: int) -> list[bytes]:
    """Commit ``ways`` keys into the set of ``seed`` (keys are synthetic)."""
    keys = []
    for i in range(idx.ways):
        key = b"k%d" % i
        claimed = idx.allocate(key, seed)
        assert claimed is not None
        idx.commit(claimed[0])
        keys.append(key)
    return keys


@given(st.binary(min_size=1, max_size=64))
def test_key_lands_in_its_hash_set(key: bytes) -> None:
    idx = SlotIndex(64, 8)
    seed = fmt.key_seed(key)
    claimed = idx.allocate(key, seed)
    assert claimed is not None
    assert claimed[0] in idx.set_slots(seed)
    assert claimed[0] // 8 == fmt.set_of(key, idx.n_sets)


def test_writing_key_is_not_ready_until_commit() -> None:
    idx = SlotIndex(16, 4)
    slot, evicted = idx.allocate(b"a", 1) or (None, None)
    assert evicted is None
    assert not idx.is_ready(b"a")
    idx.commit(slot)  # type: ignore[arg-type]
    assert idx.is_ready(b"a")


def test_empty_ways_are_used_before_evicting() -> None:
    idx = SlotIndex(16, 4)
    keys = _fill_set(idx, 0)
    assert all(idx.is_ready(k) for k in keys)
    assert len(idx) == 4


def test_least_recently_used_way_is_evicted() -> None:
    idx = SlotIndex(16, 4)
    keys = _fill_set(idx, 0)
    idx.touch(idx.find(keys[0]))  # type: ignore[arg-type]
    claimed = idx.allocate(b"new", 0)
    assert claimed is not None
    assert claimed[1] == keys[1]
    assert idx.find(keys[1]) is None
    assert idx.is_ready(keys[0])


def test_pinned_slot_is_never_evicted() -> None:
    idx = SlotIndex(16, 4)
    keys = _fill_set(idx, 0)
    for k in keys[:3]:
        idx.pin(idx.find(k))  # type: ignore[arg-type]
    claimed = idx.allocate(b"new", 0)
    assert claimed is not None and claimed[1] == keys[3]
    assert idx.allocate(b"newer", 0) is None  # 3 pinned + 1 writing


def test_slot_being_written_is_never_evicted() -> None:
    idx = SlotIndex(4, 4)
    for i in range(4):
        assert idx.allocate(b"w%d" % i, 0) is not None
    assert idx.allocate(b"x", 0) is None


def test_unpinned_slot_becomes_evictable_again() -> None:
    idx = SlotIndex(4, 4)
    keys = _fill_set(idx, 0)
    for k in keys:
        idx.pin(idx.find(k))  # type: ignore[arg-type]
    assert idx.allocate(b"x", 0) is None
    idx.unpin(idx.find(keys[2]))  # type: ignore[arg-type]
    claimed = idx.allocate(b"x", 0)
    assert claimed is not None and claimed[1] == keys[2]


def test_bad_slot_is_evicted_first() -> None:
    idx = SlotIndex(4, 4)
    keys = _fill_set(idx, 0)
    idx.mark_bad(idx.find(keys[3]))  # type: ignore[arg-type]
    assert not idx.is_ready(keys[3])
    claimed = idx.allocate(b"x", 0)
    assert claimed is not None and claimed[1] == keys[3]


def test_bad_key_is_rewritten_in_place() -> None:
    idx = SlotIndex(4, 4)
    keys = _fill_set(idx, 0)
    slot = idx.find(keys[1])
    idx.mark_bad(slot)  # type: ignore[arg-type]
    claimed = idx.allocate(keys[1], 0)
    assert claimed == (slot, None)
    assert idx.state[slot] == SlotState.WRITING  # type: ignore[index]


def test_allocating_a_present_key_is_an_error() -> None:
    idx = SlotIndex(4, 4)
    keys = _fill_set(idx, 0)
    with pytest.raises(ValueError):
        idx.allocate(keys[0], 0)


def test_abort_frees_the_slot() -> None:
    idx = SlotIndex(4, 4)
    slot, _ = idx.allocate(b"a", 0) or (0, None)
    assert idx.abort(slot) == b"a"
    assert idx.find(b"a") is None
    assert idx.state[slot] == SlotState.EMPTY


def test_sets_are_independent() -> None:
    idx = SlotIndex(8, 4)
    _fill_set(idx, 0)
    claimed = idx.allocate(b"other", 1)
    assert claimed is not None and claimed[1] is None
    assert claimed[0] in range(4, 8)


def test_geometry_must_be_whole_sets() -> None:
    with pytest.raises(ValueError):
        SlotIndex(10, 4)


@given(st.lists(st.integers(0, 40), min_size=1, max_size=300))
def test_index_never_holds_more_than_its_slots(ids: list[int]) -> None:
    idx = SlotIndex(16, 4)
    for i in ids:
        key = b"key-%d" % i
        if idx.find(key) is not None:
            idx.touch(idx.find(key))  # type: ignore[arg-type]
            continue
        claimed = idx.allocate(key, fmt.key_seed(key))
        assert claimed is not None
        idx.commit(claimed[0])
        assert len(idx) <= 16
    for i in set(ids):
        slot = idx.find(b"key-%d" % i)
        assert slot is None or idx.keys[slot] == b"key-%d" % i
