"""Encryption-at-rest primitives: the operator's key file, the subkeys
derived from it, keyed MACs of offload keys, chunk sealing (AES-256-GCM) and
the durable nonce counter of a store.

Owns: no state but a ``NonceSource``'s file descriptor. Every cipher and MAC
comes from OpenSSL: AES-256-GCM through ``nvmetier._crypto`` (libcrypto's
EVP interface, ``native/nvt_crypto.c``, the GIL released), HMAC-SHA256
through ``hmac`` (OpenSSL-backed), HKDF-SHA256 through the ``cryptography``
package. None is written by hand here.

Threads: ``load_key_file``, ``KeySet`` and ``NonceSource.open`` run where a
store opens (they block on small file I/O); ``key_mac`` is for the scheduler
thread (~1 µs a key); ``seal``/``open_sealed`` for engine threads (they
release the GIL); ``NonceSource.reserve`` blocks on an fsync and is called
once per ``block`` nonces.

Nonces (96 bits) never repeat under one key: each is a 32-bit prefix and a
64-bit counter. The prefix is drawn at random when a store's nonce file is
created and kept in it; the counter is reserved in blocks, each reservation
written and fsynced (under a ``flock`` of the file) before any nonce of the
block is used. So within one store no two seals share a counter, across
processes (the lock), restarts and crashes (a block is durable before use; a
crash only skips the rest of its block). Across two creations of a store
under the same key (the directory deleted, the key kept) the prefixes differ
except with probability 2^-32 per pair; a new key (rotation) makes every
earlier nonce irrelevant.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import os
import stat
import struct
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

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


def _hkdf(key: bytes, info: bytes, length: int) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(key)


class KeySet:
    """The subkeys of one operator key (HKDF-SHA256, one label each).

    Attributes:
        seal_key: AES-256-GCM key of the chunks.
        mac_key: HMAC-SHA256 key of the offload keys in the index.
        fingerprint: 8 bytes that name the key (``fingerprint_hex``) without
            revealing it: shown by ``nvmetier info``, compared at open.
    """

    __slots__ = ("_native_mac", "fingerprint", "mac_key", "seal_key")

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a key is {KEY_BYTES} bytes, not {len(key)}")
        self.seal_key = _hkdf(key, _INFO_SEAL, KEY_BYTES)
        self.mac_key = _hkdf(key, _INFO_MAC, KEY_BYTES)
        self.fingerprint = _hkdf(key, _INFO_FINGERPRINT, FINGERPRINT_BYTES)
        # The native HMAC, keyed once (~0.3 us a key instead of ~3 us).
        try:
            import nvmetier._crypto as native
        except ImportError:  # pragma: no cover - built with libssl-dev
            self._native_mac: Any = None
        else:
            self._native_mac = native.KeyMac(self.mac_key)

    @classmethod
    def from_file(cls, path: str) -> KeySet:
        return cls(load_key_file(path))

    @property
    def fingerprint_hex(self) -> str:
        return self.fingerprint.hex()

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
NONCE_FILE = "nonce"
_NONCE_MAGIC = b"NVTNONCE"
# magic, version, prefix, next counter, checksum of the preceding fields.
_NONCE_REC = struct.Struct("<8sII Q Q")
_NONCE_VERSION = 1


def _nonce_sum(body: bytes) -> int:
    return int.from_bytes(hashlib.sha256(body).digest()[:8], "little")


class NonceSource:
    """A store's durable nonce counter (the file ``nonce`` in its directory).

    Use ``NonceSource.open(store_dir)``, then ``reserve(n)`` for blocks of
    counters and ``nonce(counter)`` for the 12 bytes of each. ``close()``.
    """

    def __init__(self, fd: int, path: str, prefix: int) -> None:
        self._fd = fd
        self.path = path
        self.prefix = prefix

    @classmethod
    def open(cls, store_dir: str) -> NonceSource:
        """Open the store's nonce file, creating it (a random prefix, the
        counter at 0, fsynced) when absent or empty.

        Raises:
            FormatError: the file exists but is not a valid nonce file (it is
                never reset: a reset could reuse nonces).
        """
        path = os.path.join(store_dir, NONCE_FILE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                data = os.pread(fd, _NONCE_REC.size, 0)
                if not data:
                    prefix = int.from_bytes(os.urandom(4), "little")
                    _write_nonce(fd, prefix, 0)
                    dfd = os.open(store_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                    try:
                        os.fsync(dfd)  # the file's name is durable too
                    finally:
                        os.close(dfd)
                else:
                    prefix, _next = _read_nonce(data, path)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path, prefix)

    def reserve(self, n: int) -> int:
        """Reserve ``n`` counters for this process: returns the first; the
        reservation is on disk (fsynced) before this returns. Blocks."""
        if n < 1:
            raise ValueError("reserve at least one nonce")
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            prefix, start = _read_nonce(os.pread(self._fd, _NONCE_REC.size, 0), self.path)
            if prefix != self.prefix:
                raise FormatError(f"{self.path!r} changed its prefix while open; remove the store")
            if start + n >= 1 << 64:
                raise FormatError(
                    f"{self.path!r}: the nonce counter is exhausted; rotate the key and "
                    "remove the store"
                )
            _write_nonce(self._fd, prefix, start + n)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        return start

    def nonce(self, counter: int) -> bytes:
        """The 12 bytes of nonce ``counter`` (prefix, then counter, LE)."""
        return struct.pack("<IQ", self.prefix, counter)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _write_nonce(fd: int, prefix: int, next_counter: int) -> None:
    body = struct.pack("<8sII Q", _NONCE_MAGIC, _NONCE_VERSION, prefix, next_counter)
    rec = body + struct.pack("<Q", _nonce_sum(body))
    if os.pwrite(fd, rec, 0) != len(rec):
        raise OSError("short write of the nonce file")
    os.fsync(fd)


def _read_nonce(data: bytes, path: str) -> tuple[int, int]:
    if len(data) != _NONCE_REC.size:
        raise FormatError(f"{path!r} is not a nonce file (size); remove the store to start over")
    magic, version, prefix, next_counter, checksum = _NONCE_REC.unpack(data)
    if magic != _NONCE_MAGIC or version != _NONCE_VERSION or checksum != _nonce_sum(data[:-8]):
        raise FormatError(
            f"{path!r} is not a valid nonce file (magic, version or checksum); it is never "
            "reset (that could reuse a nonce): remove the store to start over"
        )
    return prefix, next_counter
