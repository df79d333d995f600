"""The switch the store's file-changing call sites test: ``recorder``.

Owns: the module-level ``recorder`` (None unless a crash-state recording is
under way) and the test-only planted bugs (``planted``). Every site that
changes a store's files (``superblock``, ``files``, ``store_dir``, ``purge``,
``crypto``, the thread engine's data writes) reads ``hook.recorder`` once
and calls it only when it is not None: off, the cost is one attribute load
and one comparison per call (``tools/crashsim_overhead.py`` measures it).
Any thread; never blocks when off.

Both are read once, at import, from the environment, so that every process
of a recorded run (a killed writer, a second sharer, ``nvmetier purge``)
records into the same recording:

- ``NVMETIER_CRASHSIM_RECORD=DIR:ROOT``: append every change under ``ROOT``
  to the recording in ``DIR`` (``recorder.Recorder``).
- ``NVMETIER_PLANT_BUG=name[,name]``: plant the named durability bugs
  (``PLANTABLE``); tests only, to prove the explorer finds each one.
"""

from __future__ import annotations

import os
from typing import Any

RECORD_ENV = "NVMETIER_CRASHSIM_RECORD"
PLANT_ENV = "NVMETIER_PLANT_BUG"

# The bugs a test can plant, each a durability rule of docs/format.md broken.
PLANTABLE = {
    "superblock-no-dir-fsync": "no directory fsync after the superblock rename",
    "clean-before-sync": "the clean mark written before the index and data syncs",
    "publish-before-write": "a record published before its data write completed",
    "purge-log-no-sync": "the purge log replaced without a sync of its bytes",
    "epoch-unsynced": "a new epoch key (the nonce reservation) sealed under before it is synced",
    "purge-unsynced": "a live purge returning before its cleared records are msynced",
}

_planted = frozenset(n for n in os.environ.get(PLANT_ENV, "").split(",") if n)
_unknown = _planted - set(PLANTABLE)
if _unknown:
    raise RuntimeError(
        f"{PLANT_ENV}={os.environ[PLANT_ENV]!r} names no plantable bug {sorted(_unknown)}; "
        f"known: {sorted(PLANTABLE)}"
    )


def planted(name: str) -> bool:
    """Whether the test-only bug ``name`` is planted in this process."""
    return name in _planted


recorder: Any = None
if os.environ.get(RECORD_ENV):
    from nvmetier.crashsim.recorder import Recorder

    recorder = Recorder.from_env(os.environ[RECORD_ENV])
