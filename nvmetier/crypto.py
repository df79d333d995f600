"""Encryption-at-rest primitives: the operator's key file and what it
derives, keyed MACs of offload keys, chunk sealing (AES-256-GCM), the nonce
allocator, and a sealed store's ``keys`` file (``Keyring``).

Owns: no state but a ``Keyring``'s file descriptor (``O_CLOEXEC``, closed
in a forked child). Every cipher and MAC comes from OpenSSL: AES-256-GCM of
chunks through ``nvmetier._crypto`` (libcrypto's EVP interface,
``native/nvt_crypto.c`` and ``native/nvt_seal.c``, the GIL released);
HMAC-SHA256 natively or through ``hmac``; HKDF-SHA256 and the key wrapping
(AES-256-GCM) through the ``cryptography`` package. None is written by hand.

Keys (docs/format.md, "Encrypted stores"): the key file wraps each store's
random store key; the store key gives the MAC key of the index and wraps the
store's random *epoch* keys, under which chunks are sealed, each process
under its own epoch, a new one at every open and at least hourly. Nonces are
96 random bits per seal (``NonceSource``, natively ``nvt_random``): no file
or counter a copy, restore or rollback could replay. Destroying an epoch's
entry (purge, retention) erases every chunk sealed under it.

Threads: ``load_key_file``, ``KeySet`` and ``Keyring`` run where a store
opens or closes, on a sealed store's housekeeping thread and in the CLI
(they block on small file I/O and fsyncs); ``key_mac`` is for the scheduler
thread (~0.3 µs a key); ``seal``/``open_sealed`` for engine threads.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import hmac
import os
import stat
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from nvmetier.crashsim import hook
from nvmetier.errors import ConfigError, FormatError

T = TypeVar("T")

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
MAC_BYTES = 32  # HMAC-SHA256 of an offload key: what an encrypted index holds
FINGERPRINT_BYTES = 8

KEY_FIX = "create one with: head -c 32 /dev/urandom > KEYFILE && chmod 600 KEYFILE"

# HKDF info labels: one subkey per use, so no key serves two purposes.
_INFO_SEAL = b"nvmetier v1 aes-256-gcm chunk key"
_INFO_MAC = b"nvmetier v1 hmac-sha256 offload-key mac"
_INFO_FINGERPRINT = b"nvmetier v1 key fingerprint"


def load_key_file(path: str) -> bytes:
    """Read the operator's key: a regular file of exactly 32 bytes that only
    its owner can read (no group or other permission bits at all).

    Raises:
        ConfigError: naming the file, what is wrong and the fix.
    """
    fix = KEY_FIX.replace("KEYFILE", path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise ConfigError(
            f"encryption key_file {path!r} cannot be opened ({exc.strerror}); {fix}"
        ) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"encryption key_file {path!r} is not a regular file; {fix}")
        if st.st_mode & 0o077:
            raise ConfigError(
                f"encryption key_file {path!r} can be read or written by others (mode "
                f"{stat.S_IMODE(st.st_mode):04o}); make it private: chmod 600 {path}"
            )
        if st.st_uid != os.geteuid():
            raise ConfigError(
                f"encryption key_file {path!r} belongs to uid {st.st_uid}, not to this "
                f"process's user ({os.geteuid()}); chown it to the user vLLM runs as"
            )
        if st.st_size != KEY_BYTES:
            raise ConfigError(
                f"encryption key_file {path!r} has {st.st_size} bytes; it must hold exactly "
                f"{KEY_BYTES} random bytes; {fix}"
            )
        data = os.pread(fd, KEY_BYTES + 1, 0)
    finally:
        os.close(fd)
    if len(data) != KEY_BYTES:
        raise ConfigError(f"encryption key_file {path!r} changed while read; {fix}")
    return data


def _hkdf(key: bytes | bytearray, info: bytes, length: int) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(key)


class _Macs:
    """HMAC-SHA256 names of offload keys (what an encrypted index holds)."""

    __slots__ = ()
    mac_key: bytes
    _native_mac: Any

    def key_mac(self, key: bytes) -> bytes:
        """The index's name for ``key``: HMAC-SHA256 under the MAC subkey.
        Without the key file, nobody can test whether a guessed prompt's
        key is in the index."""
        if self._native_mac is not None:
            return self._native_mac(key)  # type: ignore[no-any-return]
        return hmac.digest(self.mac_key, key, hashlib.sha256)

    def key_macs(self, keys: Iterable[bytes]) -> list[bytes]:
        """``key_mac`` of each key, in one native call."""
        if self._native_mac is not None:
            return self._native_mac.many(keys)  # type: ignore[no-any-return]
        return [self.key_mac(k) for k in keys]

    def mac_then(self, then: Callable[[bytes], T]) -> Callable[[bytes], T]:
        """``lambda key: then(key_mac(key))`` as one native callable (no
        Python frame): a sealed store's table lookup for vLLM's adapter."""
        if self._native_mac is not None:
            import nvmetier._crypto as native

            return native.KeyMac(self.mac_key, then)  # type: ignore[no-any-return]
        mac = self.key_mac
        return lambda key: then(mac(key))


class KeySet(_Macs):
    """The subkeys of one operator key (HKDF-SHA256, one label each).

    Attributes:
        seal_key: AES-256-GCM key of the chunks.
        mac_key: HMAC-SHA256 key of the offload keys in the index.
        fingerprint: 8 bytes that name the key (``fingerprint_hex``) without
            revealing it: shown by ``nvmetier info``, compared at open.
    """

    __slots__ = ("_native_mac", "fingerprint", "kek", "mac_key", "seal_key")

    kek: bytearray | None

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a key is {KEY_BYTES} bytes, not {len(key)}")
        self.seal_key = _hkdf(key, _INFO_SEAL, KEY_BYTES)
        self.mac_key = _hkdf(key, _INFO_MAC, KEY_BYTES)
        self.fingerprint = _hkdf(key, _INFO_FINGERPRINT, FINGERPRINT_BYTES)
        # Format 4: wraps each store's random store key (crypto.Keyring).
        # Derived into memory this object owns (a bytearray) so that
        # ``forget_kek`` can wipe it: a running store holds no KEK.
        self.kek: bytearray | None = bytearray(KEY_BYTES)
        # The native HMAC, keyed once (~0.3 us a key instead of ~3 us).
        try:
            import nvmetier._crypto as native
        except ImportError:  # pragma: no cover - built with libssl-dev
            self._native_mac: Any = None
            self.kek[:] = _hkdf(key, _INFO_KEK, KEY_BYTES)
        else:
            self._native_mac = native.KeyMac(self.mac_key)
            native.hkdf_into(key, _INFO_KEK, self.kek)

    def forget_kek(self) -> None:
        """Wipe the key-encryption key: what a running store no longer
        needs once its store key is unwrapped (``rekey`` reads the key files
        again). Unwrapping or creating a keyring with this object then
        raises ``ValueError``."""
        if self.kek is not None:
            _wipe(self.kek)
            self.kek = None

    def kek_bytes(self) -> bytearray:
        if self.kek is None:
            raise ValueError("this key's key-encryption key was dropped (a running store's)")
        return self.kek

    @classmethod
    def from_file(cls, path: str) -> KeySet:
        return cls(load_key_file(path))

    @property
    def fingerprint_hex(self) -> str:
        return self.fingerprint.hex()

    def __repr__(self) -> str:  # never the key material
        return f"KeySet(fingerprint={self.fingerprint_hex})"


def _native() -> Any:
    try:
        import nvmetier._crypto as native
    except ImportError as exc:  # pragma: no cover - built with libssl-dev
        raise ConfigError(
            "encryption at rest needs nvmetier's _crypto extension, which was not built "
            "(install libssl-dev and reinstall nvmetier, e.g. bash scripts/setup.sh)"
        ) from exc
    return native


def seal(seal_key: bytes, nonce: bytes, aad: bytes, src: Any, dst: Any) -> bytes:
    """Encrypt ``src`` into ``dst`` (AES-256-GCM; ``src`` is only read) and
    return the tag. The GIL is released while the bytes are processed."""
    return _native().seal(seal_key, nonce, aad, src, dst)  # type: ignore[no-any-return]


def open_sealed(
    seal_key: bytes, nonce: bytes, aad: bytes, buf: Any, tag: bytes, dst: Any = None
) -> bool:
    """Decrypt ``buf`` into ``dst`` (default: in place); False when the tag
    does not verify (then ``dst`` holds garbage and must not be used). The
    GIL is released."""
    return bool(_native().open(seal_key, nonce, aad, buf, buf if dst is None else dst, tag))


def chunk_aad(key_mac: bytes, layout_digest: int) -> bytes:
    """What a chunk's tag binds besides its bytes: the MAC of its offload
    key and the store's layout identity digest, so a chunk moved to another
    key's record, or into another layout's store, never opens."""
    return key_mac + struct.pack("<Q", layout_digest)


# ------------------------------------------------------------------ nonces
NONCE_FILE = "nonce"  # format 3's nonce counter; format 4 has none


class NonceSource:
    """The one nonce allocator: 96 random bits per seal from the kernel's
    CSPRNG (``getrandom``, through ``nvmetier._crypto``; the same function
    the engines' native seal path calls). Nothing about a nonce depends on a
    file or a counter, so no copy, restore or rollback of a store directory
    can make one repeat; the data key under which it is used is itself
    random per epoch (``Keyring``), and an epoch seals at most
    ``EPOCH_MAX_SEALS`` chunks (NIST SP 800-38D's bound for random nonces is
    2^32 per key). Thread-safe and fork-safe (no state).
    """

    def draw(self) -> bytes:
        """12 fresh random bytes."""
        return _native().random(NONCE_BYTES)  # type: ignore[no-any-return]


# ------------------------------------------------------------------ keyring
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

# An epoch seals for at most this long and this many chunks (random nonces:
# a collision among 2^28 of them has probability below 2^-41).
EPOCH_S = 3600.0
EPOCH_MIN_S = 1.0
EPOCH_MAX_SEALS = 1 << 28
# The last epoch number a keys file can hold (an entry's and a trailer's
# epoch are 32 bits).
EPOCH_LAST = 0xFFFFFFFF
EPOCH_ROTATE_SEALS = 1 << 27

_INFO_KEK = b"nvmetier v2 store key wrapping"
_INFO_STORE_MAC = b"nvmetier v2 hmac-sha256 offload-key mac"
_INFO_EPOCH_WRAP = b"nvmetier v2 epoch key wrapping"
_AAD_STORE_KEY = b"nvmetier v2 store key"
_AAD_EPOCH_KEY = b"nvmetier v2 epoch key"


def _xxh(data: bytes, seed: int = 0) -> int:
    import xxhash

    return int(xxhash.xxh3_64_intdigest(data, seed))


def _aesgcm(key: bytes | bytearray) -> Any:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(key)


def kek_of(keys: KeySet) -> bytearray:
    """The operator key's key-encryption key (wraps a store key)."""
    return keys.kek_bytes()


def _random_secret(n: int) -> bytearray:
    """``n`` random bytes read straight into a bytearray (no bytes copy)."""
    out = bytearray(n)
    with open("/dev/urandom", "rb", buffering=0) as f:
        if f.readinto(out) != n:
            raise OSError(errno.EIO, "short read of /dev/urandom")
    return out


def _wipe(buf: bytearray) -> None:
    """Overwrite a secret this process owns, in place."""
    buf[:] = bytes(len(buf))


def epoch_fingerprint(key: bytes | bytearray) -> bytes:
    """8 bytes naming an epoch key (in every trailer) without revealing it."""
    return hmac.digest(key, b"nvmetier v2 epoch key fingerprint", hashlib.sha256)[
        :FINGERPRINT_BYTES
    ]


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


class StoreKeys(_Macs):
    """A store's secrets once its store key is unwrapped: the offload-key MAC
    (the index's names for keys) and the wrapping of its epoch keys. Same
    MAC methods as ``KeySet`` (``key_mac``, ``key_macs``, ``mac_then``).

    The epoch-wrapping key is derived straight into native memory
    (``nvmetier._crypto.WrapKey``: MADV_DONTDUMP, MADV_WIPEONFORK, zeroed
    when freed) and wraps and unwraps there (libcrypto's EVP AEAD): no
    Python object ever holds it, so no core dump does. ``store_key`` is
    the caller's to wipe (``Keyring.store_keys`` does)."""

    def __init__(self, store_key: bytes | bytearray, fingerprint: bytes) -> None:
        self.mac_key = _hkdf(store_key, _INFO_STORE_MAC, KEY_BYTES)
        self._wrap = _native().WrapKey(store_key, _INFO_EPOCH_WRAP)
        self.fingerprint = fingerprint
        try:
            import nvmetier._crypto as native
        except ImportError:  # pragma: no cover - built with libssl-dev
            self._native_mac: Any = None
        else:
            self._native_mac = native.KeyMac(self.mac_key)

    @property
    def fingerprint_hex(self) -> str:
        return self.fingerprint.hex()

    def wrap_epoch(
        self, store_id: bytes, epoch: int, key: bytes | bytearray
    ) -> tuple[bytes, bytes]:
        nonce = os.urandom(NONCE_BYTES)  # one per wrapping: a handful per epoch
        aad = _AAD_EPOCH_KEY + store_id + struct.pack("<I", epoch)
        return nonce, self._wrap.seal(nonce, key, aad)

    def unwrap_epoch(self, store_id: bytes, e: Epoch) -> bytearray | None:
        """The epoch's key in a bytearray the caller wipes, or None when the
        entry does not unwrap."""
        aad = _AAD_EPOCH_KEY + store_id + struct.pack("<I", e.epoch)
        key = bytearray(max(0, len(e.wrapped) - TAG_BYTES))
        if len(key) != KEY_BYTES or not self._wrap.open(e.nonce, e.wrapped, aad, key):
            return None
        return key

    def __repr__(self) -> str:
        return f"StoreKeys(fingerprint={self.fingerprint_hex})"


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
    def store_keys(self, operator: KeySet) -> StoreKeys:
        """Unwrap the store key with the operator's key.

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
            return StoreKeys(store_key, operator.fingerprint)
        finally:
            _wipe(store_key)

    def rekey(self, old: KeySet, new: KeySet) -> None:
        """Rewrap the store key from ``old`` to ``new``: both header copies
        rewritten and fsynced in turn (a crash between them leaves the newer
        copy, which the newer sequence selects). No data key changes."""
        from cryptography.exceptions import InvalidTag

        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                seq, header = _read_header(self._fd, self.path)
                try:
                    store_key = _aesgcm(old.kek_bytes()).decrypt(
                        header[48:60], header[60:108], _AAD_STORE_KEY + self.store_id
                    )
                except InvalidTag:
                    raise KeyringError(
                        f"{self.path!r}: --key-file (fingerprint {old.fingerprint_hex}) does not "
                        f"open this store (wrapped by {header[40:48].hex()})"
                    ) from None
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
                for e in self._entries_locked():
                    if e.state != ENTRY_LIVE or not pred(e):
                        continue
                    if cut_to_ns is not None:
                        e.seal_until_ns = min(e.seal_until_ns, cut_to_ns)
                    else:
                        e.state = ENTRY_DESTROYED
                    self._write_entry_locked(e)
                    changed.append(e.epoch)
                if changed:
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
