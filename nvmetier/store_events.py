"""KV events a store hands vLLM beyond its table's own: the removals of an
``nvmetier purge``, and a sealed store's key MACs turned back into keys.

Owns ``PurgeEvents``: which purges of the store this process took the events
of, the removals it holds back until a write of the same key ends, and the
purges whose removals could not be read (``kv_events_lost``). The table's own
events (one stored event per store job, evictions) come from
``Table.take_events``; ``BlockStore.take_events`` puts the two together.

Threads: the scheduler thread (``BlockStore.take_events``), under vLLM's
manager lock, like every ``BlockStore`` method.

Why the purge needs care. The first sharer with events on to see a new purge
generation takes it (one compare-and-swap in the table header) and emits the
purge log's keys; the others emit nothing for it. The log is read here once
per purge (96 bytes per removed chunk, just written: in the page cache). The
purge announces itself after it removed the keys (it logs them last), so a
key may have been written again in between, and its new stored event queued
before the removal is: a removal queued behind it would leave a replay
without a key the store holds. So a purged key held again when the purge is
taken is announced stored again right after its removal, and one being
written again waits for the write to end (its removal then, and its stored
event again if it landed).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from nvmetier import purge_log

# Table.states_many's answers (native/nvt_layout.h's slot states; 255: the
# key's set could not be locked in its bound).
_WRITING, _READY, _STATE_UNKNOWN = 1, 2, 255


class PurgeEvents:
    """The removals of this store's purges, as KV events.

    Args:
        store_dir: the store's first directory (where the purge log is).
        stats: the store's counters (``purge_removals_emitted`` is counted
            there).
        known: a sealed store's key MACs this process can name (the table's
            keys are MACs; a purged MAC it never submitted cannot be named
            and is left out), or None for a plaintext store.
    """

    def __init__(
        self, store_dir: str, stats: Counter[str], known: dict[bytes, bytes] | None
    ) -> None:
        self._dir = store_dir
        self._stats = stats
        self._known = known
        # Keys (table names) of a purge this process took the events of that
        # were being written again when it took them: their removal waits
        # until the write ends.
        self._pending: list[bytes] = []
        # Purges taken whose removals could not be read (counted in
        # kv_events_lost beside the table's own).
        self.lost = 0

    def take(self, table: Any) -> None:
        """Queue, behind the table's events, the removals of the purges
        taken since the last call and of the keys held back then."""
        keys: list[bytes] = []
        gen, taken = table.purge_generation()
        if gen != taken:
            keys = self._claim(table, gen, taken)
            if self._known is not None and keys:
                keys = [k for k in keys if k in self._known]  # MACs it can name
        if self._pending:
            keys = self._pending + keys
        if keys:
            # A key named twice (pending and purged again, or by two purges
            # merged into one log) is one removal and one store.
            self._push(table, list(dict.fromkeys(keys)))

    def _claim(self, table: Any, gen: int, taken: int) -> list[bytes]:
        """The removals of the purges after ``taken`` that this process
        claims. The log is read first and the claim moves the table's taken
        generation to the last purge that log covers (compare-and-swap from
        ``taken``): claimed first, a purge landing before the read saw its
        predecessor taken and replaced the log with its own keys, and the
        claimed purge's removals were never emitted. A purge landing after
        the read merges the untaken log into its own; its generation is then
        past the claim and the next take emits the whole (removals emitted
        twice: a replay ends the same)."""
        first, last, logged = purge_log.read_log(self._dir)
        ahead = (last - taken) & 0xFFFFFFFF
        if first == last == 0 or ahead >= 1 << 31:
            # No log (or not readable, or older than the claim: impossible
            # unless it was replaced by hand): take the purges, emit nothing.
            if table.claim_purge_events(taken, gen) is not None:
                self.lost += 1
            return []
        if ahead == 0:  # the log's purge is taken; its generation not bumped yet
            return []
        if table.claim_purge_events(taken, last) is None:
            return []  # another sharer took it
        if 0 < (first - 1 - taken) & 0xFFFFFFFF < 1 << 31:
            self.lost += 1  # the log starts after a purge not taken
        return logged

    def _push(self, table: Any, keys: list[bytes]) -> None:
        """Queue a purge's removals of ``keys`` behind the table's events (a
        purged key's stored event may still be open there, its job not
        finished, and the removal must follow it), each key held again since
        announced stored after it, and keep those being written again for
        the next call."""
        pending: list[bytes] = []
        done: list[bytes] = []
        again: list[bytes] = []
        for k, state in zip(keys, table.states_many(keys), strict=True):
            if state in (_WRITING, _STATE_UNKNOWN):  # its set was busy: asked again too
                pending.append(k)
            else:
                done.append(k)
                if state == _READY:
                    again.append(k)
        self._pending = pending
        if not done:
            return
        self._stats["purge_removals_emitted"] += len(done)
        table.push_removed(done)
        if again:
            table.push_stored(again)


def unseal_events(
    known: dict[bytes, bytes], events: list[tuple[bool, list[bytes]]]
) -> list[tuple[bool, list[bytes]]]:
    """A sealed store's table events name key MACs: the keys this process
    knows (``known``: MAC to key, of what it submitted) are reported, a
    removal of one it never saw (another process's chunk) cannot be named
    and is left out. A removal does not forget the key: a submit of it may
    already have been made again (its MAC remembered then), and that job's
    stored event, handed out after the removal, must still name it. The key
    moves to the newest end instead (the store drops the oldest past its
    bound), as it did when a removal forgot it and the next submit
    remembered it."""
    out = []
    for removed, macs in events:
        keys = [k for k in map(known.get, macs) if k is not None]
        if removed:
            for m in macs:
                k = known.pop(m, None)
                if k is not None:
                    known[m] = k
        if keys:
            out.append((removed, keys))
    return out
