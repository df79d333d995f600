"""What must hold in every crash state (``docs/format.md``, "Durability
order"), checked on one materialised state.

Owns: the checks, each returning the violations it found as one line for a
person. Two kinds:

- *media* checks (``check_media``) read the files as a power loss left them,
  without opening the store: the superblock is whole; a superblock names
  only files that exist whole (item 1, create); a clean superblock sits over
  an index and data that agree, record by record (items 2 and 4: open,
  close); a killed process (``volatile`` state) leaves every valid record
  over the bytes it describes ("Crash protocol"); the purge log is whole
  (item 5); every sealed chunk on the media names an epoch key the keys file
  holds (item 6); the root budget record is whole; ``nvmetier fsck
  --repair`` then ``fsck`` ends clean.
- the *restart* check (``check_restart``) opens the state as the next start
  would (``BlockStore``, either engine, ``verify_checksums`` on or off):
  the open succeeds (a state whose superblock verifies is never refused,
  not even with a documented ``FormatError``/``ConfigError``); it
  drops exactly the records fsck reported bad; every load returns bytes that
  were stored under its key (the oracle), and none of a key a finished
  purge removed; the capacity counts each chunk once.

Called by the explorer's thread; blocks (reads and opens small stores).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import shutil
from typing import Any

from nvmetier import format as fmt
from nvmetier import fsck, purge_log, recovery
from nvmetier.crashsim.workloads import roots_of

# Errors a restart may refuse a damaged store with (documented in
# docs/operations.md: a store that is not one, or of another layout).
_DOCUMENTED_OPEN_ERRORS = ("FormatError", "FormatVersionError", "ConfigError", "KeyringError")


def _store_dirs(root: str, spec: dict[str, Any]) -> str:
    """The main store directory of the state under ``root``."""
    return os.path.join(root, spec.get("roots", ["kv"])[0], spec["store_name"])


def _check_root_records(root: str, spec: dict[str, Any]) -> list[str]:
    """The root budget record, when on the media, is whole (old or new)."""
    from nvmetier import budget
    from nvmetier.errors import ConfigError

    try:
        budget.read_budget(os.path.join(root, spec.get("roots", ["kv"])[0]))
    except ConfigError as exc:
        return [f"root budget record not whole after a crash: {exc}"]
    return []


def check_media(
    root: str,
    spec: dict[str, Any],
    volatile: bool,
    work: str,
    purged: set[bytes] | None = None,
    facts: dict[str, int] | None = None,
) -> list[str]:
    """The media checks of the state under ``root`` (``work``: scratch;
    ``purged``: keys a finished purge removed and nothing stored again;
    ``facts`` gets what the restart check compares with: the records fsck
    found bad, ``fsck_bad_records``)."""
    out: list[str] = _check_root_records(root, spec)
    sdir = _store_dirs(root, spec)
    sb_path = os.path.join(sdir, "superblock")
    if not os.path.exists(sb_path):
        return out  # a store not created yet: the next start creates it afresh
    with open(sb_path, "rb") as f:
        raw = f.read()
    try:
        sb = fmt.unpack_superblock(raw, where=sb_path)
    except Exception as exc:
        return [f"superblock not whole after a crash: {exc}"]
    for name, size in (("index", sb.index_bytes), ("data", sb.data_file_bytes)):
        p = os.path.join(sdir, name)
        have = os.path.getsize(p) if os.path.exists(p) else None
        if have is None or have < size:
            out.append(f"create: the superblock names {name} but it is {have} bytes, not {size}")
    if out:
        return out
    key_set = _key_set(spec)
    res = fsck.check_store(sdir, deep=True, keys=key_set)
    payload = [e for e in res.errors if e.kind == "payload"]
    if facts is not None and not res.operational_error:
        facts["fsck_bad_records"] = sum(
            e.kind in ("record", "misplaced", "duplicate") for e in res.errors
        )
    if sb.clean and res.errors:
        out.append(
            "a clean superblock over an index and data that disagree: "
            + "; ".join(f"slot {e.slot}: {e.detail}" for e in res.errors[:3])
        )
    elif volatile and payload:
        out.append(
            "after kill -9, a valid record over bytes it does not describe: "
            + "; ".join(f"slot {e.slot}: {e.detail}" for e in payload[:3])
        )
    if res.operational_error:
        out.append(f"fsck could not check the state: {res.operational_error}")
    elif res.errors:
        # fsck --repair must leave a store that fsck then finds clean.
        copy = os.path.join(work, "repair")
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(sdir, copy)
        fixed = fsck.check_store(copy, deep=True, repair=True, keys=key_set)
        again = fsck.check_store(copy, deep=True, keys=key_set)
        if fixed.operational_error or again.exit_code != fsck.EXIT_CLEAN:
            out.append(
                f"fsck --repair left errors (exit {again.exit_code}): "
                + "; ".join(f"{e.kind} {e.slot}: {e.detail}" for e in again.errors[:3])
            )
        shutil.rmtree(copy, ignore_errors=True)
    log = os.path.join(sdir, purge_log.LOG_NAME)
    if os.path.exists(log):
        with open(log, "rb") as f:
            data = f.read()
        got = purge_log.unpack_log(data)
        if got is None or len(data) != 32 + 96 * len(got[2]):
            out.append(f"the purge log is not whole ({len(data)} bytes)")
    if "encryption" in sb.identity:
        out.extend(_check_epochs(sdir, sb))
    if purged:
        out.extend(_check_purged(sdir, sb, purged, key_set))
    return out


def _check_purged(sdir: str, sb: fmt.Superblock, purged: set[bytes], key_set: Any) -> list[str]:
    """No valid record on the media names a key a finished purge removed
    (its records are msynced before the purge returns)."""
    names = set(purged)
    if key_set is not None:
        from nvmetier.keyring import Keyring, KeyringError

        try:
            ring = Keyring.open(sdir)
        except (OSError, KeyringError):
            return []
        try:
            names = set(ring.store_keys(key_set).key_macs(sorted(purged)))
        finally:
            ring.close()
    with open(os.path.join(sdir, "index"), "rb") as f:
        index = f.read()
    scan = recovery.scan_index(index, sb.n_slots, sb.ways)
    back = [s for s, k in zip(scan.slots.tolist(), scan.keys, strict=True) if k in names]
    if back:
        return [f"purge: slot {back[0]} holds a valid record of a key a finished purge removed"]
    return []


def _key_set(spec: dict[str, Any]) -> Any:
    if not spec.get("key_file"):
        return None
    from nvmetier import crypto

    return crypto.KeySet.from_file(spec["key_file"])


def _check_epochs(sdir: str, sb: fmt.Superblock) -> list[str]:
    """Every sealed chunk on the media names an epoch the keys file holds
    (live with the chunk's key fingerprint, or destroyed): a new epoch is
    durable before its first seal (docs/format.md, "keys")."""
    from nvmetier.engine import sealed
    from nvmetier.keyring import Keyring, KeyringError

    try:
        ring = Keyring.open(sdir)
    except (OSError, KeyringError) as exc:
        data = os.path.join(sdir, "data")
        if os.path.exists(data) and _any_trailer(data, sb):
            return [f"sealed chunks on the media but the keys file does not open: {exc}"]
        return []
    try:
        known = {(e.epoch, e.fingerprint) for e in ring.epochs() if e.state == 1}
        gone = {e.epoch for e in ring.epochs() if e.state == 2}
    finally:
        ring.close()
    out = []
    row = sb.chunk_bytes - sealed.TRAILER_BYTES
    with open(os.path.join(sdir, "data"), "rb") as f:
        image = f.read()
    for slot in range(sb.n_slots):
        base = slot * sb.slot_bytes
        parsed = sealed.parse_trailer(image[base + row : base + sb.chunk_bytes])
        if parsed is None:
            continue
        _nonce, _tag, epoch, fp = parsed
        if (epoch, fp) not in known and epoch not in gone:
            out.append(
                f"slot {slot} holds a chunk sealed under epoch {epoch}, which the keys "
                "file on the media does not hold (its key was used before it was durable)"
            )
            break
    return out


def _any_trailer(path: str, sb: fmt.Superblock) -> bool:
    from nvmetier.engine import sealed

    row = sb.chunk_bytes - sealed.TRAILER_BYTES
    with open(path, "rb") as f:
        data = f.read()
    return any(
        sealed.parse_trailer(data[s * sb.slot_bytes + row : s * sb.slot_bytes + sb.chunk_bytes])
        for s in range(sb.n_slots)
    )


def check_restart(
    root: str,
    spec: dict[str, Any],
    oracle: dict[bytes, set[str]],
    purged: set[bytes],
    *,
    engine: str,
    verify: bool,
    served: list[int] | None = None,
    facts: dict[str, int] | None = None,
) -> list[str]:
    """Open the state under ``root`` as the next start would, load every key
    the oracle knows, and check what comes back. ``served`` (when given)
    gets the number of chunks the loads returned appended, -1 when the open
    refused the state."""
    from nvmetier.config import TierConfig
    from nvmetier.store import BlockStore

    cfg = dict(spec["config"])
    cfg["root_dir"] = roots_of(root, spec)
    cfg["verify_checksums"] = verify
    if spec.get("key_file"):
        cfg["encryption"] = {"key_file": spec["key_file"]}
    row = spec["row_bytes"]
    keys = sorted(oracle)
    buf = mmap.mmap(-1, max(1, len(keys)) * row)
    logging.disable(logging.WARNING)
    try:
        try:
            store = BlockStore(
                TierConfig.from_dict(cfg),
                store_name=spec["store_name"],
                identity=spec["identity"],
                buffer=memoryview(buf),
                row_bytes=row,
                engine=engine,
            )
        except Exception as exc:
            # The media checks passed: the superblock (when there is one)
            # is whole, so the same configuration must reopen its store (a
            # refusal, even a documented one, loses the cache: say which).
            kind = "documented" if type(exc).__name__ in _DOCUMENTED_OPEN_ERRORS else "unexpected"
            if served is not None:
                served.append(-1)
            return [
                f"open ({engine}, verify={verify}) of a state whose superblock verifies "
                f"refused ({kind} error): {type(exc).__name__}: {exc}"
            ]
        out: list[str] = []
        try:
            out.extend(_check_loads(store, buf, keys, oracle, purged, row, engine, verify, served))
            out.extend(_check_capacity(store))
            fsck_bad = (facts or {}).get("fsck_bad_records")
            dropped = store.stats()["records_dropped_at_open"]
            if fsck_bad is not None and fsck_bad != dropped:
                out.append(
                    f"fsck found {fsck_bad} bad records but the open dropped {dropped}: "
                    "fsck must see what an open sees"
                )
        finally:
            store.close()
        return out
    finally:
        logging.disable(logging.NOTSET)
        with contextlib.suppress(BufferError):
            buf.close()


def _check_loads(
    store: Any,
    buf: mmap.mmap,
    keys: list[bytes],
    oracle: dict[bytes, set[str]],
    purged: set[bytes],
    row: int,
    engine: str,
    verify: bool,
    served: list[int] | None,
) -> list[str]:
    if not keys:
        if served is not None:
            served.append(0)
        return []
    store.submit_load(1, keys, list(range(len(keys))))
    store.wait_idle(30.0)
    (outcome,) = store.poll()
    ok = keys if outcome.success else list(outcome.successful_keys or [])
    if served is not None:
        served.append(len(ok))
    out = []
    for k in ok:
        i = keys.index(k)
        got = hashlib.sha256(buf[i * row : (i + 1) * row]).hexdigest()
        if got not in oracle[k]:
            out.append(
                f"load of key {k.hex()[:16]} ({engine}, verify={verify}) returned bytes "
                "never stored under it"
            )
        elif k in purged:
            out.append(f"load of key {k.hex()[:16]} returned a chunk a finished purge removed")
    return out


def _check_capacity(store: Any) -> list[str]:
    st = store.stats()
    scan = recovery.scan_index(store.files.index, store.sb.n_slots, store.sb.ways, with_keys=False)
    valid = len(scan.slots)
    del scan
    if not (st["slots_used"] == st["slots_ready"] == valid) or st["slots_used"] > st["slots_total"]:
        return [
            f"capacity: slots_used {st['slots_used']}, slots_ready {st['slots_ready']}, "
            f"valid records {valid} (of {st['slots_total']}): a chunk counted twice or lost"
        ]
    return []
