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

import errno
import hashlib
import hmac
import os
import stat
import struct
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from nvmetier.errors import ConfigError, FormatError  # noqa: F401 (crypto.FormatError, as always)

if TYPE_CHECKING:
    from nvmetier.keyring import Epoch

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


# ------------------------------------------------------------------ epochs
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


# The keys file's names, as this module always had them (they live in
# nvmetier.keyring since it was split from here): looked up on first use,
# so that either module may be imported first.
_KEYRING_NAMES = frozenset(
    {
        "KEYRING_FILE",
        "KEYRING_MAGIC",
        "KEYRING_VERSION",
        "KEYRING_HEADER_BYTES",
        "KEYRING_ENTRIES_OFFSET",
        "KEYRING_ENTRY_BYTES",
        "KEYRING_ENTRIES",
        "KEYRING_BYTES",
        "STORE_ID_BYTES",
        "ENTRY_FREE",
        "ENTRY_LIVE",
        "ENTRY_DESTROYED",
        "Epoch",
        "Keyring",
        "KeyringError",
    }
)


def __getattr__(name: str) -> Any:
    if name in _KEYRING_NAMES:
        from nvmetier import keyring

        return getattr(keyring, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
