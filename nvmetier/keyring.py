"""A sealed store's ``keys`` file (``Keyring``): its random store key,
wrapped by the operator's key, and its epochs (the random data keys chunks
are sealed under, each wrapped by the store key), live or destroyed.

Owns: a ``Keyring``'s file descriptor (``O_CLOEXEC``, closed in a forked
child) and the file's layout (docs/format.md, "Encrypted stores"). The
primitives it uses (``KeySet``, ``StoreKeys``, the AEAD and HMAC calls)
are ``nvmetier.crypto``'s, which re-exports every name here as it always
had them (``crypto.Keyring``, ``crypto.Epoch``, ...).

Threads: where a store opens or closes, on a sealed store's housekeeping
thread and in the CLI (``nvmetier rekey``, ``purge``, ``fsck``); every call
blocks on small file I/O and, when it changes the file, an fsync. One
``threading.Lock`` and the file's ``flock`` serialize the writers of one
file, within a process and between processes.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable

from nvmetier.crashsim import hook
from nvmetier.crypto import (
    _AAD_STORE_KEY,
    EPOCH_LAST,
    FINGERPRINT_BYTES,
    KEY_BYTES,
    NONCE_BYTES,
    KeySet,
    StoreKeys,
    _aesgcm,
    _native,
    _random_secret,
    _wipe,
    _xxh,
    epoch_fingerprint,
)
from nvmetier.errors import FormatError

KEYRING_FILE = "keys"
KEYRING_MAGIC = b"NVTKEYRG"
KEYRING_VERSION = 1
KEYRING_HEADER_BYTES = 4096  # two copies, at 0 and 4096
KEYRING_ENTRIES_OFFSET = 8192
KEYRING_ENTRY_BYTES = 128
KEYRING_ENTRIES = 8192  # nvt_seal.h NVT_MAX_EPOCHS
STORE_ID_BYTES = 16
# Header: magic, version, entries, store id, sequence, the operator key's
# fingerprint, the store key's wrapping (nonce, ciphertext + tag), zeros,
# checksum (XXH3-64 of the bytes before it). Changing it requires bumping
# FORMAT_VERSION.
_HEADER = struct.Struct("<8sII16sQ8s12s48s")
# Entry: magic, state, epoch, created_ns, seal_until_ns, wrap nonce, wrapped
# key + tag, the epoch key's fingerprint, pid, zeros, checksum (XXH3-64 of
# the bytes before it, seeded with the entry's index).
_ENTRY = struct.Struct("<4sB3xIQQ12s48s8sI")
_ENTRY_MAGIC = b"NVKE"
ENTRY_FREE, ENTRY_LIVE, ENTRY_DESTROYED = 0, 1, 2
assert _HEADER.size <= KEYRING_HEADER_BYTES - 8 and _ENTRY.size <= KEYRING_ENTRY_BYTES - 8
KEYRING_BYTES = KEYRING_ENTRIES_OFFSET + KEYRING_ENTRIES * KEYRING_ENTRY_BYTES


@dataclasses.dataclass
class Epoch:
    """One entry of a keyring. ``key`` is None unless unwrapped."""

    index: int
    state: int
    epoch: int
    created_ns: int
    seal_until_ns: int
    fingerprint: bytes
    pid: int
    nonce: bytes = b""
    wrapped: bytes = b""
    key: bytes | bytearray | None = None  # a bytearray: the caller wipes it once loaded


_open_keyrings: weakref.WeakSet[Keyring] = weakref.WeakSet()


def _close_keyrings_in_child() -> None:
    # A forked child never uses its parent's keyring: its fd is closed (the
    # native key tables are wiped in the child by MADV_WIPEONFORK).
    for k in list(_open_keyrings):
        k._fd_close()


os.register_at_fork(after_in_child=_close_keyrings_in_child)


class KeyringError(FormatError):
    """A keyring that cannot be used with this key file (or at all)."""


class Keyring:
    """A sealed store's ``keys`` file (docs/format.md "Encrypted stores"):
    its random store id, its random store key wrapped by the operator's key
    (two header copies), and one entry per epoch: a random data key wrapped
    by the store key, its sealing window, live or destroyed.

    Threads: every method takes this object's lock and the file's ``flock``
    (other processes, ``nvmetier purge``/``rekey``) and may block on an
    fsync: called where a store opens or closes, from the sealing
    housekeeping thread, and from the CLI; never from vLLM's threads.
    Destroying an epoch overwrites its entry in place (the wrapped key
    zeroed) and fsyncs.
    """

    def __init__(self, fd: int, path: str, store_id: bytes, seq: int, header: bytes) -> None:
        self._fd = fd
        self.path = path
        self.store_id = store_id
        self._seq = seq
        self._header = header
        self._lock = threading.Lock()
        _open_keyrings.add(self)

    # ------------------------------------------------------------- open
    @classmethod
    def exists(cls, store_dir: str) -> bool:
        return os.path.exists(os.path.join(store_dir, KEYRING_FILE))

    @classmethod
    def open(
        cls, store_dir: str, *, create: bool = False, operator: KeySet | None = None
    ) -> Keyring:
        """Open the store's keyring; with ``create``, make it first when
        absent (a random store id and store key wrapped by ``operator``),
        atomically (a link of a complete, fsynced file: of two processes
        creating it at once, one's file wins and both use it).

        Raises:
            KeyringError: absent (without ``create``), or not a valid keyring.
        """
        path = os.path.join(store_dir, KEYRING_FILE)
        if create and not os.path.exists(path):
            if operator is None:
                raise ValueError("creating a keyring needs the operator's key")
            _create_keyring(store_dir, path, operator)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError as exc:
            raise KeyringError(
                f"{path!r} is missing: the sealed store's keys are gone, so nothing in it "
                "can be read; remove the store directory to start over"
            ) from exc
        try:
            size = os.fstat(fd).st_size
            if size != KEYRING_BYTES:
                # Created whole (never grown): a short file lost entries, so
                # their chunks could not be read and their epoch numbers
                # would come back under other keys; never used as it is.
                raise KeyringError(
                    f"{path!r} is {size} bytes, not the {KEYRING_BYTES} of a keys file "
                    "(truncated or damaged): the keys of some or all of the store's chunks "
                    "are gone; restore the file from a copy taken with the store, or remove "
                    "the store directory to start over"
                )
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                seq, header = _read_header(fd, path)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path, header[16:32], seq, header)

    def _fd_close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        with self._lock:
            self._fd_close()

    @property
    def operator_fingerprint(self) -> bytes:
        return self._header[40:48]

    # --------------------------------------------------------- store key
    def store_keys(self, operator: KeySet, *, heal: bool = False) -> StoreKeys:
        """Unwrap the store key with the operator's key; with ``heal`` (a
        store's open, not fsck's checks) then rewrite a header copy that
        lags the other (``_heal_headers``).

        Raises:
            KeyringError: the key file is not the one that wraps this store's
                key (naming both fingerprints and the fixes).
        """
        with self._lock:
            _seq, header = self._reread_header()
        nonce, wrapped = header[48:60], header[60:108]
        # Unwrapped natively into a bytearray wiped below (no bytes copy).
        store_key = bytearray(KEY_BYTES)
        try:
            ok = _native().open(
                operator.kek_bytes(),
                nonce,
                _AAD_STORE_KEY + self.store_id,
                wrapped[:KEY_BYTES],
                store_key,
                wrapped[KEY_BYTES:],
            )
        except BaseException:
            _wipe(store_key)
            raise
        if not ok:
            _wipe(store_key)
            raise KeyringError(
                f"{self.path!r}: this store's keys are wrapped by the key with fingerprint "
                f"{header[40:48].hex()}, not by this key file's ({operator.fingerprint_hex}); "
                "use that key file, rotate with `nvmetier rekey ROOT --key-file OLD "
                "--new-key-file NEW`, or remove the store directory to start over"
            )
        try:
            out = StoreKeys(store_key, operator.fingerprint)
        finally:
            _wipe(store_key)
        if heal:
            self._heal_headers()
        return out

    def _heal_headers(self) -> None:
        """Make both header copies the newest valid one when they differ:
        a rekey cut between its two header writes (a crash) leaves the other
        copy wrapping the store key under the *old* key file, which would
        then open everything in the store from its current files. Called
        once the key file proved to open the newest copy (an open), and by
        a rekey run again. A read of both pages when they agree."""
        with self._lock:
            if self._fd < 0 or not _copies_differ(self._fd):
                return
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                _heal_locked(self._fd, self.path)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def rekey(self, old: KeySet, new: KeySet) -> None:
        """Rewrap the store key from ``old`` to ``new``: both header copies
        rewritten and fsynced in turn (a crash between them leaves the newer
        copy, which the newer sequence selects). No data key changes."""

        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                seq, header = _read_header(self._fd, self.path)
                store_key = _unwrap(old, header, self.store_id)
                if store_key is None:
                    if _copies_differ(self._fd) and _unwrap(new, header, self.store_id):
                        # A rotation to `new` cut between its header writes:
                        # finish it, so that no copy the old key file opens
                        # stays behind. (One already whole is refused below.)
                        _heal_locked(self._fd, self.path)
                        self._seq, self._header = seq, header
                        return
                    raise KeyringError(
                        f"{self.path!r}: --key-file (fingerprint {old.fingerprint_hex}) does not "
                        f"open this store (wrapped by {header[40:48].hex()})"
                    )
                nonce = os.urandom(NONCE_BYTES)
                wrapped = _aesgcm(new.kek_bytes()).encrypt(
                    nonce, store_key, _AAD_STORE_KEY + self.store_id
                )
                body = _HEADER.pack(
                    KEYRING_MAGIC,
                    KEYRING_VERSION,
                    KEYRING_ENTRIES,
                    self.store_id,
                    seq + 1,
                    new.fingerprint,
                    nonce,
                    wrapped,
                )
                page = _header_page(body)
                # The copy not in use first, then the other: both new.
                for copy in (1, 0) if _active_copy(self._fd) == 0 else (0, 1):
                    _pwrite_all(self._fd, page, copy * KEYRING_HEADER_BYTES)
                    _fsync(self._fd)
                self._seq, self._header = seq + 1, page[: _HEADER.size]
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _reread_header(self) -> tuple[int, bytes]:
        fcntl.flock(self._fd, fcntl.LOCK_SH)
        try:
            seq, header = _read_header(self._fd, self.path)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._seq, self._header = seq, header
        return seq, header

    # ------------------------------------------------------------ epochs
    def epochs(self) -> list[Epoch]:
        """Every entry that is not free (a torn entry counts as free)."""
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_SH)
            try:
                return self._entries_locked()
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _entries_locked(self) -> list[Epoch]:
        data = os.pread(self._fd, KEYRING_ENTRIES * KEYRING_ENTRY_BYTES, KEYRING_ENTRIES_OFFSET)
        out = []
        for i in range(len(data) // KEYRING_ENTRY_BYTES):
            raw = data[i * KEYRING_ENTRY_BYTES : (i + 1) * KEYRING_ENTRY_BYTES]
            if raw[:4] != _ENTRY_MAGIC:
                continue
            if _xxh(raw[:-8], i) != int.from_bytes(raw[-8:], "little"):
                continue  # torn: its epoch's chunks are misses
            _magic, state, epoch, created, until, nonce, wrapped, fp, pid = _ENTRY.unpack_from(raw)
            if state not in (ENTRY_LIVE, ENTRY_DESTROYED):
                continue
            out.append(Epoch(i, state, epoch, created, until, fp, pid, nonce, wrapped))
        return out

    def _scrub_torn_locked(self) -> int:
        """Zero every entry no reader uses (its checksum or state invalid:
        a write torn by a crash, a damaged byte): its epoch's chunks are
        misses already, but its wrapped key may be intact, and the key file
        would unwrap it from the file's bytes. Under the exclusive flock (no
        writer is half way through an entry). Returns the entries zeroed."""
        import numpy as np

        data = os.pread(self._fd, KEYRING_ENTRIES * KEYRING_ENTRY_BYTES, KEYRING_ENTRIES_OFFSET)
        rows = np.frombuffer(data, dtype=np.uint8)
        rows = rows[: len(rows) // KEYRING_ENTRY_BYTES * KEYRING_ENTRY_BYTES]
        n = 0
        for i in np.flatnonzero(rows.reshape(-1, KEYRING_ENTRY_BYTES).any(axis=1)).tolist():
            raw = data[i * KEYRING_ENTRY_BYTES : (i + 1) * KEYRING_ENTRY_BYTES]
            ok = raw[:4] == _ENTRY_MAGIC and _xxh(raw[:-8], i) == int.from_bytes(raw[-8:], "little")
            if ok and raw[4] in (ENTRY_LIVE, ENTRY_DESTROYED):
                continue
            _pwrite_all(
                self._fd,
                bytes(KEYRING_ENTRY_BYTES),
                KEYRING_ENTRIES_OFFSET + i * KEYRING_ENTRY_BYTES,
            )
            n += 1
        return n

    def _write_entry_locked(self, e: Epoch) -> None:
        body = _ENTRY.pack(
            _ENTRY_MAGIC,
            e.state,
            e.epoch,
            e.created_ns,
            e.seal_until_ns,
            e.nonce if e.state == ENTRY_LIVE else bytes(NONCE_BYTES),
            e.wrapped if e.state == ENTRY_LIVE else bytes(48),
            e.fingerprint if e.state == ENTRY_LIVE else bytes(FINGERPRINT_BYTES),
            e.pid,
        )
        raw = body + bytes(KEYRING_ENTRY_BYTES - 8 - len(body))
        raw += struct.pack("<Q", _xxh(raw, e.index))
        _pwrite_all(self._fd, raw, KEYRING_ENTRIES_OFFSET + e.index * KEYRING_ENTRY_BYTES)

    def new_epoch(self, skeys: StoreKeys, epoch_s: float) -> tuple[Epoch, list[int]]:
        """A new epoch with a fresh random data key, sealing for at most
        ``epoch_s`` from now: written and fsynced before this returns (so
        before its first seal). When the keyring is full the oldest epoch is
        destroyed for room (its chunks become misses). Returns the epoch
        (its ``key`` set) and the epochs destroyed for room."""
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                ents = self._entries_locked()
                used = {e.index for e in ents}
                free = [i for i in range(KEYRING_ENTRIES) if i not in used]
                destroyed: list[int] = []
                if free:
                    index = free[0]
                else:
                    dead = [e for e in ents if e.state == ENTRY_DESTROYED]
                    victim = min(dead or ents, key=lambda e: (e.epoch, e.index))
                    index = victim.index
                    if victim.state == ENTRY_LIVE:
                        destroyed.append(victim.epoch)
                newest = max((e.epoch for e in ents), default=0)
                if newest >= EPOCH_LAST:
                    # Only a damaged or forged file gets here (one epoch an
                    # hour would take 490,000 years): its entries carry a
                    # checksum, not a MAC, so whoever can write it can name
                    # any epoch, destroyed ones included. Say so, rather than
                    # fail on the number's packing with no word of the file.
                    raise KeyringError(
                        f"{self.path!r} names epoch {newest}, the last a keys file can "
                        "number, so no new epoch (data key) can be made and nothing more "
                        "can be sealed: the file is damaged or was written by someone "
                        "else; restore it from a copy taken with the store, or remove the "
                        "store directory to start over"
                    )
                epoch = newest + 1
                key = _random_secret(KEY_BYTES)  # the caller wipes it once loaded
                nonce, wrapped = skeys.wrap_epoch(self.store_id, epoch, key)
                now = time.time_ns()
                e = Epoch(
                    index,
                    ENTRY_LIVE,
                    epoch,
                    now,
                    now + int(epoch_s * 1e9),
                    epoch_fingerprint(key),
                    os.getpid(),
                    nonce,
                    wrapped,
                    key,
                )
                self._write_entry_locked(e)
                if not _EPOCH_UNSYNCED:
                    _fsync(self._fd)
                return e, destroyed
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def retire(self, epoch: int, *, destroy: bool) -> None:
        """No seal under ``epoch`` after now: its window is cut to now, or
        (``destroy``: it sealed nothing) it is destroyed."""
        now = time.time_ns()
        self.destroy_where(
            lambda e: e.epoch == epoch,
            cut_to_ns=None if destroy else now,
        )

    def destroy_where(
        self, pred: Callable[[Epoch], bool], *, cut_to_ns: int | None = None
    ) -> list[int]:
        """Destroy (or, with ``cut_to_ns``, end the sealing window of) every
        live epoch ``pred`` selects: each entry overwritten in place, then
        one fsync. Returns the epochs changed."""
        with self._lock:
            if self._fd < 0:
                return []
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                changed = []
                scrubbed = self._scrub_torn_locked() if cut_to_ns is None else 0
                for e in self._entries_locked():
                    if e.state != ENTRY_LIVE or not pred(e):
                        continue
                    if cut_to_ns is not None:
                        e.seal_until_ns = min(e.seal_until_ns, cut_to_ns)
                    else:
                        e.state = ENTRY_DESTROYED
                    self._write_entry_locked(e)
                    changed.append(e.epoch)
                if changed or scrubbed:
                    _fsync(self._fd)
                return changed
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def load(self, skeys: StoreKeys) -> tuple[list[Epoch], int]:
        """Every live epoch with its key unwrapped (an entry that does not
        unwrap is left out: its chunks are misses), and the highest epoch
        the keyring names (live or destroyed). The keys are ``bytes`` (for
        tools: fsck, tests); a running store uses ``load_wipeable``."""
        live, top = self.load_wipeable(skeys)
        for e in live:
            if isinstance(e.key, bytearray):
                key = bytes(e.key)
                _wipe(e.key)
                e.key = key
        return live, top

    def load_wipeable(self, skeys: StoreKeys) -> tuple[list[Epoch], int]:
        """``load`` with each key in a bytearray the caller wipes once
        loaded (``_wipe``): no copy of an epoch key outlives the reload."""
        live, top, _destroyed = self.load_table(skeys)
        return live, top

    def load_table(self, skeys: StoreKeys) -> tuple[list[Epoch], int, list[int]]:
        """``load_wipeable`` and the epochs the file names destroyed (what a
        native key table opens as ``EKEYREVOKED``: nvt_seal.h), from one
        read of the file."""
        ents = self.epochs()
        top = max((e.epoch for e in ents), default=0)
        live = []
        for e in ents:
            if e.state == ENTRY_LIVE:
                e.key = skeys.unwrap_epoch(self.store_id, e)
                if e.key is not None:
                    live.append(e)
        return live, top, [e.epoch for e in ents if e.state == ENTRY_DESTROYED]


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    if os.pwrite(fd, data, offset) != len(data):
        raise OSError(errno.EIO, "short write of the keys file")
    rec = hook.recorder
    if rec is not None:
        rec.write_fd(fd, offset, data)


def _fsync(fd: int) -> None:
    os.fsync(fd)
    rec = hook.recorder
    if rec is not None:
        rec.fsync_fd(fd)


# Test-only (issue 31): the planted bug the crash explorer must find.
_EPOCH_UNSYNCED = hook.planted("epoch-unsynced")


def _unwrap(operator: KeySet, header: bytes, store_id: bytes) -> bytes | None:
    """The store key ``header`` wraps under ``operator``'s key, or None when
    that key does not open it (rekey's old key file, and the new one of a
    rotation cut between its header writes)."""
    from cryptography.exceptions import InvalidTag

    try:
        return _aesgcm(
            operator.kek_bytes()
        ).decrypt(  # type: ignore[no-any-return]
            header[48:60], header[60:108], _AAD_STORE_KEY + store_id
        )
    except InvalidTag:
        return None


def _copies_differ(fd: int) -> bool:
    return os.pread(fd, KEYRING_HEADER_BYTES, 0) != os.pread(
        fd, KEYRING_HEADER_BYTES, KEYRING_HEADER_BYTES
    )


def _heal_locked(fd: int, path: str) -> None:
    """Under the file's exclusive flock: every header copy that is not the
    newest valid one (older, torn, or damaged) is overwritten with it, each
    write fsynced."""
    pages = [os.pread(fd, KEYRING_HEADER_BYTES, c * KEYRING_HEADER_BYTES) for c in (0, 1)]
    got = [_parse_header(p) for p in pages]
    valid = [c for c in (0, 1) if got[c] is not None]
    if not valid:
        raise KeyringError(
            f"{path!r} is not a valid keys file (magic, version or checksum of both header "
            "copies): nothing in the store can be read; remove the store directory to start over"
        )
    best = max(valid, key=lambda c: got[c][0])  # type: ignore[index]
    for c in (0, 1):
        if pages[c] != pages[best]:
            _pwrite_all(fd, pages[best], c * KEYRING_HEADER_BYTES)
            _fsync(fd)


def _header_page(body: bytes) -> bytes:
    page = body + bytes(KEYRING_HEADER_BYTES - 8 - len(body))
    return page + struct.pack("<Q", _xxh(page))


def _parse_header(page: bytes) -> tuple[int, bytes] | None:
    if len(page) != KEYRING_HEADER_BYTES or page[:8] != KEYRING_MAGIC:
        return None
    if _xxh(page[:-8]) != int.from_bytes(page[-8:], "little"):
        return None
    _magic, version, entries, _sid, seq, _fp, _n, _w = _HEADER.unpack_from(page)
    if version != KEYRING_VERSION or entries != KEYRING_ENTRIES:
        return None
    return seq, page[: _HEADER.size]


def _active_copy(fd: int) -> int:
    got = [
        _parse_header(os.pread(fd, KEYRING_HEADER_BYTES, c * KEYRING_HEADER_BYTES)) for c in (0, 1)
    ]
    if got[0] is None:
        return 1
    if got[1] is None:
        return 0
    return 0 if got[0][0] >= got[1][0] else 1


def _read_header(fd: int, path: str) -> tuple[int, bytes]:
    got = [
        _parse_header(os.pread(fd, KEYRING_HEADER_BYTES, c * KEYRING_HEADER_BYTES)) for c in (0, 1)
    ]
    valid = [g for g in got if g is not None]
    if not valid:
        raise KeyringError(
            f"{path!r} is not a valid keys file (magic, version or checksum of both header "
            "copies): nothing in the store can be read; remove the store directory to start over"
        )
    return max(valid, key=lambda g: g[0])


def _create_keyring(store_dir: str, path: str, operator: KeySet) -> None:
    store_id = os.urandom(STORE_ID_BYTES)
    store_key = os.urandom(KEY_BYTES)
    nonce = os.urandom(NONCE_BYTES)
    wrapped = _aesgcm(operator.kek_bytes()).encrypt(nonce, store_key, _AAD_STORE_KEY + store_id)
    body = _HEADER.pack(
        KEYRING_MAGIC,
        KEYRING_VERSION,
        KEYRING_ENTRIES,
        store_id,
        1,
        operator.fingerprint,
        nonce,
        wrapped,
    )
    page = _header_page(body)
    tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
    rec = hook.recorder
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        if rec is not None:
            rec.create(tmp)
        _pwrite_all(fd, page + page, 0)
        os.ftruncate(fd, KEYRING_BYTES)
        if rec is not None:
            rec.truncate(tmp, KEYRING_BYTES)
        _fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # atomic, and never replaces another's keyring
        if rec is not None:
            rec.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
        if rec is not None:
            rec.unlink(tmp)
    dfd = os.open(store_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    if rec is not None:
        rec.fsync_dir(store_dir)
