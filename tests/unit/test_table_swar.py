"""The slot table's tag scan, eight ways at a time (nvt_core.h: tag_word,
tag_word_matches; nvt_find_way, nvt_claim_way), against a plain model of one
set: every way count a config can give, including those that leave padding
in the last word of the tag and state arrays, with crafted fingerprints.

The zero test flags a byte just above a true match whose value is the tag
with its low bit cleared: for tag 1 (a fingerprint whose top byte is 0 or 1)
that is an EMPTY way's 0, so tag-1 keys with holes above them and keys
sharing one tag are what this fills the set with. Each case checks the way
every store claims (the first EMPTY way, as the scalar scan chose), that
every held key is found in its way and no other key is, that a store of a
held key is skipped, and that the padding stays zero; then that padding
bytes written non-zero (no writer does) change none of it.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import xxhash

from tests.unit.mem_table import MemTable

_table = pytest.importorskip("nvmetier._table")

HEADER_BYTES = 8192
SET_HEAD_BYTES = 64
WAYS = (1, 3, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1024)


def _a8(n: int) -> int:
    return (n + 7) // 8 * 8


def _tag(key: bytes) -> int:
    return (xxhash.xxh3_64_intdigest(key, 0) >> 56) | 1


def _pools() -> dict[str, Iterator[bytes]]:
    """Endless keys by kind: tag 1, one shared tag (0x5b), any other tag."""
    out: dict[str, list[bytes]] = {"one": [], "same": [], "other": []}
    i = 0
    while min(len(v) for v in out.values()) < 1100:
        key = b"swar-%d" % i
        t = _tag(key)
        kind = "one" if t == 1 else "same" if t == 0x5B else "other"
        out[kind].append(key)
        i += 1
    return {k: iter(v) for k, v in out.items()}


class OneSet(MemTable):
    """A table of one set of `ways` ways (every key lands in it)."""

    def __init__(self, ways: int) -> None:
        super().__init__(ways, ways, prefix="nvt-swar-")

    def padding(self) -> tuple[bytes, bytes]:
        """The tag and state arrays' padding bytes."""
        pad = _a8(self.ways) - self.ways
        tag = HEADER_BYTES + SET_HEAD_BYTES
        state = tag + _a8(self.ways)
        return (
            bytes(self.map[tag + self.ways : tag + self.ways + pad]),
            bytes(self.map[state + self.ways : state + self.ways + pad]),
        )

    def write_padding(self, tag: int, state: int) -> None:
        pad = _a8(self.ways) - self.ways
        t0 = HEADER_BYTES + SET_HEAD_BYTES + self.ways
        s0 = HEADER_BYTES + SET_HEAD_BYTES + _a8(self.ways) + self.ways
        self.map[t0 : t0 + pad] = bytes([tag]) * pad
        self.map[s0 : s0 + pad] = bytes([state]) * pad


def _check(s: OneSet, held: list[bytes | None], absent: list[bytes]) -> None:
    """Every held key in its way; nothing else found; stores of held keys skipped."""
    keys = [k for k in held if k is not None]
    for w, key in enumerate(held):
        if key is not None:
            assert s.t.slot_of(key) == w, (s.ways, w)
    for key in absent:
        assert s.t.slot_of(key) is None
    probe = keys + absent
    assert s.t.contains_many(probe) == bytes([1] * len(keys) + [0] * len(absent))
    rows = np.zeros(len(keys), dtype=np.int64)
    assert s.t.store_ops(99_999, keys, rows, len(keys), True)[0] == b""


@pytest.fixture(scope="module")
def pools() -> dict[str, list[bytes]]:
    return {k: list(v) for k, v in _pools().items()}


@pytest.mark.parametrize("ways", WAYS)
def test_the_eight_way_scan_claims_and_finds_as_the_scalar_scan(
    ways: int, pools: dict[str, list[bytes]]
) -> None:
    one, same, other = (iter(pools[k]) for k in ("one", "same", "other"))
    kinds = (one, same, one, other, same)
    s = OneSet(ways)
    try:
        held: list[bytes | None] = [next(kinds[w % len(kinds)]) for w in range(ways)]
        # A fresh set: each store claims the first EMPTY way, in key order.
        assert s.store([k for k in held if k is not None]) == list(range(ways))
        absent = [next(one), next(same), next(other)]
        _check(s, held, absent)
        # Full (its padding zero, as EMPTY reads): a new key evicts the
        # least recently used way, the first one stored; never a padding way.
        extra = next(one)
        assert s.store([extra]) == [0]
        absent.append(held[0])  # type: ignore[arg-type]
        held[0] = extra
        _check(s, held, absent)
        # Holes (EMPTY, tag 0) just above tag-1 ways: the zero test's borrow
        # flags them for a tag-1 key; and a hole at the last way.
        holes = sorted({w for w in range(ways) if w % 5 in (1, 3)} | {ways - 1})
        for w in holes:
            key = held[w]
            assert key is not None and s.t.invalidate(key)
            absent.append(key)
            held[w] = None
        _check(s, held, absent)
        assert s.padding() == (bytes(_a8(ways) - ways), bytes(_a8(ways) - ways))
        # Refill one at a time: each store takes the lowest hole.
        for w in holes[: len(holes) // 2 + 1]:
            key = next(one)
            assert s.store([key]) == [w]
            held[w] = key
        _check(s, held, absent)
        # Padding written non-zero (nothing does): a tag that matches, a
        # state that is not EMPTY, then one that is. No way past `ways` is
        # ever found, claimed or counted.
        for tag, state in ((1, 2), (0x5B, 0), (0xFF, 0xFF)):
            s.write_padding(tag, state)
            _check(s, held, absent)
        free = [w for w, k in enumerate(held) if k is None]
        new = [next(one) for _ in free]
        assert s.store(new) == free
        for w, key in zip(free, new, strict=True):
            held[w] = key
        _check(s, held, absent)
        # Full: a new key evicts (a way below `ways`), never claims padding.
        extra = next(same)
        (slot,) = s.store([extra])
        assert 0 <= slot < ways
        assert s.t.slot_of(extra) == slot
    finally:
        s.close()
