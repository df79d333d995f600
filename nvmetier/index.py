"""The in-memory slot index: hash-addressed, set-associative, LRU per set.

Owns: which key each slot holds, the slot states, pins and recency. No disk,
no threads, no locks: every method is called by the scheduler thread only
(the store applies I/O completions there). Nothing here blocks.

A key's candidate slots are fixed by its hash: set ``h(key) % n_sets``, slots
``set * ways`` to ``set * ways + ways - 1``. There is no global free list and
no allocator lock; a store picks an empty way of its set, else the least
recently used way that nothing pins. A dict from key to slot answers lookups
in O(1); it mirrors the table and never decides placement.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np


class SlotState(enum.IntEnum):
    EMPTY = 0  # free
    WRITING = 1  # a store's data write is in flight; not a hit, not evictable
    READY = 2  # durable and verified at store time; a hit
    BAD = 3  # a load of it failed (I/O error): a miss until rewritten; evicted first


_EMPTY_BYTE = bytes([SlotState.EMPTY])


class SlotIndex:
    """Set-associative table of ``n_slots`` slots in sets of ``ways``.

    Args:
        n_slots: total slots, a multiple of ``ways``.
        ways: slots per set.
    """

    def __init__(self, n_slots: int, ways: int) -> None:
        if ways < 1 or n_slots < ways or n_slots % ways:
            raise ValueError(f"n_slots={n_slots} must be a positive multiple of ways={ways}")
        self.n_slots = n_slots
        self.ways = ways
        self.n_sets = n_slots // ways
        self.keys: list[bytes | None] = [None] * n_slots
        self.state = bytearray(n_slots)
        self.pins = [0] * n_slots
        self.last_used = [0] * n_slots
        self._slot_of: dict[bytes, int] = {}
        self._clock = 1

    # --- queries --------------------------------------------------------------
    def find(self, key: bytes) -> int | None:
        """The slot holding ``key`` in any state, or None."""
        return self._slot_of.get(key)

    def is_ready(self, key: bytes) -> bool:
        slot = self._slot_of.get(key)
        return slot is not None and self.state[slot] == SlotState.READY

    def set_slots(self, seed: int) -> range:
        """The candidate slots of a key whose hash is ``seed``."""
        base = (seed % self.n_sets) * self.ways
        return range(base, base + self.ways)

    def __len__(self) -> int:
        """Slots that hold a key (any state but EMPTY)."""
        return len(self._slot_of)

    def count(self, state: SlotState) -> int:
        return self.state.count(state)

    # --- recency --------------------------------------------------------------
    def touch(self, slot: int) -> None:
        self.last_used[slot] = self._clock
        self._clock += 1

    def advance_clock(self, at_least: int) -> None:
        self._clock = max(self._clock, at_least + 1)

    # --- placement ------------------------------------------------------------
    def allocate(self, key: bytes, seed: int) -> tuple[int, bytes | None] | None:
        """Claim a slot of ``key``'s set for writing it.

        Picks an empty way, else a BAD way, else the least recently used READY
        way with no pins. The slot becomes WRITING and is owned by the caller
        until ``commit`` or ``abort``.

        Precondition: ``key`` is not in the index (``find`` is None), or holds a
        BAD slot, which is reused in place.

        Returns:
            ``(slot, evicted_key)`` (``evicted_key`` is None when the way was
            empty), or None when every way is pinned or being written.
        """
        old = self._slot_of.get(key)
        if old is not None:
            if self.state[old] != SlotState.BAD or self.pins[old]:
                raise ValueError("allocate() of a key already in the index")
            self.state[old] = SlotState.WRITING
            return old, None
        state, pins, last = self.state, self.pins, self.last_used
        # set_slots(seed), inlined: a call and a range cost ~25% of this method.
        base = (seed % self.n_sets) * self.ways
        # Fast path, a C-level scan: the first EMPTY way (never pinned: a slot
        # is pinned only while it holds a key, but check rather than assume).
        victim = state.find(_EMPTY_BYTE, base, base + self.ways)
        if victim >= 0 and not pins[victim]:
            self.keys[victim] = key
            self._slot_of[key] = victim
            state[victim] = SlotState.WRITING
            return victim, None
        victim = -1
        victim_rank = (3, 0)
        for slot in range(base, base + self.ways):
            st = state[slot]
            if pins[slot] or st == SlotState.WRITING:
                continue  # a load or a write is using it
            if st == SlotState.EMPTY:
                victim = slot
                break
            rank = (0 if st == SlotState.BAD else 1, last[slot])
            if victim < 0 or rank < victim_rank:
                victim, victim_rank = slot, rank
        if victim < 0:
            return None
        evicted = self.keys[victim]
        if evicted is not None:
            del self._slot_of[evicted]
        self.keys[victim] = key
        self._slot_of[key] = victim
        state[victim] = SlotState.WRITING
        return victim, evicted

    def commit(self, slot: int) -> None:
        """A write finished: the slot is READY and most recently used."""
        assert self.state[slot] == SlotState.WRITING
        self.state[slot] = SlotState.READY
        self.touch(slot)

    def abort(self, slot: int) -> bytes | None:
        """A write failed: the slot is EMPTY again. Returns the key it had."""
        return self.clear(slot)

    def clear(self, slot: int) -> bytes | None:
        """Forget the slot's key (eviction, corruption). Returns the key."""
        key = self.keys[slot]
        if key is not None:
            self._slot_of.pop(key, None)
        self.keys[slot] = None
        self.state[slot] = SlotState.EMPTY
        return key

    def mark_bad(self, slot: int) -> None:
        """A load failed without proof of corruption: a miss until rewritten."""
        if self.state[slot] == SlotState.READY:
            self.state[slot] = SlotState.BAD

    def load(self, slot: int, key: bytes, last_used: int) -> None:
        """Restore a READY slot at open time (from a verified record)."""
        self.keys[slot] = key
        self._slot_of[key] = slot
        self.state[slot] = SlotState.READY
        self.last_used[slot] = last_used

    def load_many(
        self,
        slots: Sequence[int] | np.ndarray,
        keys: Sequence[bytes],
        last_used: Sequence[int] | np.ndarray,
    ) -> None:
        """Restore many READY slots at open time: ``load(s, k, t)`` for each
        triple, as C loops over numpy arrays instead of a Python loop.

        Preconditions: ``slots`` and ``keys`` are each distinct (as in a
        ``recovery.ScanResult``), ``last_used`` values are below 2**64.

        Raises:
            ValueError: the three sequences differ in length.
            IndexError: a slot is outside the table.
        """
        slot_arr = np.asarray(slots, dtype=np.int64)
        if not len(slot_arr) == len(keys) == len(last_used):
            raise ValueError(
                f"load_many() got {len(slot_arr)} slots, {len(keys)} keys, "
                f"{len(last_used)} last_used"
            )
        if not len(slot_arr):
            return
        if slot_arr.min() < 0 or slot_arr.max() >= self.n_slots:
            raise IndexError(f"a slot is outside 0..{self.n_slots - 1}")
        new_keys = np.empty(len(keys), dtype=object)
        new_keys[:] = keys  # an object array: bytes stay bytes (never an S dtype)
        table = np.empty(self.n_slots, dtype=object)
        table[:] = self.keys
        table[slot_arr] = new_keys
        self.keys[:] = table.tolist()
        recency = np.array(self.last_used, dtype=np.uint64)
        recency[slot_arr] = np.asarray(last_used, dtype=np.uint64)
        self.last_used[:] = recency.tolist()
        state = np.frombuffer(self.state, dtype=np.uint8)
        state[slot_arr] = SlotState.READY
        del state  # drop the export: the bytearray must stay resizable
        self._slot_of.update(zip(keys, slot_arr.tolist(), strict=True))

    # --- pins -----------------------------------------------------------------
    def pin(self, slot: int) -> None:
        self.pins[slot] += 1

    def unpin(self, slot: int) -> None:
        assert self.pins[slot] > 0
        self.pins[slot] -= 1
