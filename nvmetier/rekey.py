"""``nvmetier rekey``: rotate the operator key of the encrypted stores under
a root, live, without rewriting any data.

Owns: the rotation of one store (``rekey_store``) and of every store under a
root (``rekey``). Runs on the CLI's main thread; blocks on small file I/O
(two header writes and fsyncs of each store's ``keys`` file).

An encrypted store's chunks are sealed under random epoch keys wrapped by the
store's random store key, which alone is wrapped by the operator's key file
(docs/format.md). A rotation unwraps the store key with the old key file and
wraps it with the new one, in both header copies of ``keys`` (under its
``flock``): afterwards the old key file opens nothing in the store and the
new one everything. Processes attached keep running (they hold the store key
since their open); the next ones must use the new key file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from nvmetier import crypto
from nvmetier import format as fmt
from nvmetier.keyring import ENTRY_LIVE, Keyring

EXIT_OK = 0
EXIT_LEFT = 4  # a store was not rekeyed (another key wraps it, or unreadable)
EXIT_OPERATIONAL = 8
EXIT_USAGE = 16


@dataclasses.dataclass
class RekeyResult:
    """What a rotation did to one store.

    Attributes:
        path: the store directory.
        encrypted: whether the store is sealed (a plaintext one is skipped).
        rekeyed: the store key is now wrapped by the new key file.
        old_fingerprint, new_fingerprint: the key files' fingerprints.
        epochs: live data keys in the store (unchanged, rewrapped with it).
        error: why the store was not rekeyed (None when it was, or skipped).
    """

    path: str
    encrypted: bool = False
    rekeyed: bool = False
    old_fingerprint: str | None = None
    new_fingerprint: str | None = None
    epochs: int = 0
    error: str | None = None

    @property
    def exit_code(self) -> int:
        return EXIT_LEFT if self.error is not None else EXIT_OK

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "exit_code": self.exit_code}


def rekey_store(store_dir: str, old: crypto.KeySet, new: crypto.KeySet) -> RekeyResult:
    """Rotate one store. Never raises for a store: ``error`` says why not."""
    import os

    out = RekeyResult(store_dir, old_fingerprint=old.fingerprint_hex)
    out.new_fingerprint = new.fingerprint_hex
    sb_path = os.path.join(store_dir, "superblock")
    try:
        with open(sb_path, "rb") as f:
            sb = fmt.unpack_superblock(f.read(), where=sb_path)
    except (OSError, crypto.FormatError) as exc:
        out.error = str(exc)
        return out
    out.encrypted = "encryption" in sb.identity
    if not out.encrypted:
        return out
    try:
        ring = Keyring.open(store_dir)
    except (OSError, crypto.FormatError) as exc:
        out.error = str(exc)
        return out
    try:
        ring.rekey(old, new)
        out.rekeyed = True
        out.epochs = sum(e.state == ENTRY_LIVE for e in ring.epochs())
    except (OSError, crypto.FormatError) as exc:
        out.error = str(exc)
    finally:
        ring.close()
    return out


def rekey(root: str, old_key_file: str, new_key_file: str) -> list[RekeyResult]:
    """Rotate every encrypted store under ``root`` (a root_dir, or one store).

    Raises:
        ConfigError: a key file is unusable (naming it and the fix), or both
            are the same key.
        FsckOperationalError: ROOT is not a root_dir or a store.
    """
    from nvmetier.errors import ConfigError
    from nvmetier.fsck import find_stores

    old = crypto.KeySet.from_file(old_key_file)
    new = crypto.KeySet.from_file(new_key_file)
    if old.fingerprint == new.fingerprint:
        raise ConfigError(
            f"--key-file and --new-key-file hold the same key ({old.fingerprint_hex}); "
            f"{crypto.KEY_FIX.replace('KEYFILE', new_key_file)}"
        )
    return [rekey_store(d, old, new) for d in find_stores(root)]


def format_result(r: RekeyResult) -> str:
    if r.error is not None:
        return f"{r.path}: not rekeyed: {r.error}"
    if not r.encrypted:
        return f"{r.path}: not encrypted, nothing to rekey"
    return (
        f"{r.path}: rekeyed {r.old_fingerprint} -> {r.new_fingerprint} "
        f"({r.epochs} data keys rewrapped with the store key; no data rewritten)"
    )


def overall_exit(results: Sequence[RekeyResult]) -> int:
    code = 0
    for r in results:
        code |= r.exit_code
    if results and not any(r.encrypted for r in results):
        code |= EXIT_OPERATIONAL  # nothing under ROOT was encrypted
    return code
