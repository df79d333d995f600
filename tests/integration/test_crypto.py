"""Encryption-at-rest primitives (nvmetier.crypto, nvmetier._crypto): the key
file's checks, subkeys, key MACs, AES-256-GCM sealing checked against the
``cryptography`` package, and the durable nonce counter across processes and
a SIGKILL."""

from __future__ import annotations

import os
import threading

import pytest

_crypto = pytest.importorskip("nvmetier._crypto")

from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # noqa: E402

from nvmetier import crypto  # noqa: E402
from nvmetier.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def key_file(tmp_path, data: bytes | None = None, mode: int = 0o600, name: str = "key") -> str:
    path = tmp_path / name
    path.write_bytes(os.urandom(32) if data is None else data)
    path.chmod(mode)
    return str(path)


# ----------------------------------------------------------------- key file
def test_a_private_32_byte_key_file_loads(tmp_path) -> None:
    data = os.urandom(32)
    assert crypto.load_key_file(key_file(tmp_path, data)) == data


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o620, 0o602])
def test_a_key_file_others_can_access_is_refused_naming_it_and_the_fix(tmp_path, mode) -> None:
    path = key_file(tmp_path, mode=mode)
    with pytest.raises(ConfigError) as info:
        crypto.load_key_file(path)
    assert path in str(info.value) and "chmod 600" in str(info.value)


@pytest.mark.parametrize("size", [0, 16, 31, 33, 64])
def test_a_key_file_of_another_size_is_refused_with_the_fix(tmp_path, size) -> None:
    path = key_file(tmp_path, os.urandom(size))
    with pytest.raises(ConfigError) as info:
        crypto.load_key_file(path)
    text = str(info.value)
    assert path in text and f"{size} bytes" in text and "head -c 32 /dev/urandom" in text


def test_a_missing_key_file_or_a_directory_is_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot be opened"):
        crypto.load_key_file(str(tmp_path / "absent"))
    d = tmp_path / "dir"
    d.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match="not a regular file"):
        crypto.load_key_file(str(d))


# ----------------------------------------------------------------- subkeys
def test_subkeys_are_deterministic_distinct_and_key_specific() -> None:
    k1, k2 = os.urandom(32), os.urandom(32)
    a, b, c = crypto.KeySet(k1), crypto.KeySet(k1), crypto.KeySet(k2)
    assert (a.seal_key, a.mac_key, a.fingerprint) == (b.seal_key, b.mac_key, b.fingerprint)
    assert len({a.seal_key, a.mac_key, k1}) == 3  # no key serves two purposes
    assert a.fingerprint != c.fingerprint and a.seal_key != c.seal_key
    assert len(a.fingerprint_hex) == 16 and k1.hex() not in repr(a)


def test_key_mac_hides_the_key_and_depends_on_the_key_file() -> None:
    offload_key = os.urandom(32) + b"\0\0\0\0"
    a, b = crypto.KeySet(os.urandom(32)), crypto.KeySet(os.urandom(32))
    mac = a.key_mac(offload_key)
    assert len(mac) == crypto.MAC_BYTES and offload_key[:32] not in mac
    assert mac == a.key_mac(offload_key) and mac != b.key_mac(offload_key)


# ------------------------------------------------------------ AES-256-GCM
def test_seal_matches_the_cryptography_package_and_leaves_the_source_alone() -> None:
    key, nonce, aad = os.urandom(32), os.urandom(12), crypto.chunk_aad(os.urandom(32), 7)
    src = bytearray(os.urandom(1 << 20))
    before = bytes(src)
    dst = bytearray(len(src))
    tag = crypto.seal(key, nonce, aad, src, dst)
    assert bytes(src) == before
    assert bytes(dst) + tag == AESGCM(key).encrypt(nonce, before, aad)


def test_open_in_place_restores_the_plaintext() -> None:
    key, nonce, aad = os.urandom(32), os.urandom(12), b"aad"
    plain = os.urandom(65536)
    sealed = AESGCM(key).encrypt(nonce, plain, aad)
    buf = bytearray(sealed[:-16])
    assert crypto.open_sealed(key, nonce, aad, buf, sealed[-16:])
    assert bytes(buf) == plain


@pytest.mark.parametrize("what", ["byte", "tag", "aad", "nonce", "key"])
def test_any_tampering_fails_the_tag(what) -> None:
    key, nonce, aad = os.urandom(32), os.urandom(12), b"x" * 40
    plain = os.urandom(8192)
    sealed = bytearray(AESGCM(key).encrypt(nonce, plain, aad))
    tag = bytes(sealed[-16:])
    buf = sealed[:-16]
    if what == "byte":
        buf[4000] ^= 0x40
    elif what == "tag":
        tag = bytes([tag[0] ^ 1]) + tag[1:]
    elif what == "aad":
        aad = b"y" + aad[1:]
    elif what == "nonce":
        nonce = bytes([nonce[0] ^ 1]) + nonce[1:]
    else:
        key = os.urandom(32)
    assert not crypto.open_sealed(key, nonce, aad, buf, tag)


def test_bad_argument_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="key must be 32 bytes"):
        crypto.seal(b"k" * 31, b"n" * 12, b"", b"x", bytearray(1))
    with pytest.raises(ValueError, match="nonce must be 12 bytes"):
        crypto.seal(b"k" * 32, b"n" * 8, b"", b"x", bytearray(1))
    with pytest.raises(ValueError, match="shorter"):
        crypto.seal(b"k" * 32, b"n" * 12, b"", b"xy", bytearray(1))


def test_sealing_runs_in_parallel_threads_with_the_gil_released() -> None:
    # Each thread seals its own buffer; with the GIL held they would still be
    # correct, so the check is on the results; the release is what lets the
    # Python thread below keep counting meanwhile.
    key = os.urandom(32)
    bufs = [bytearray(os.urandom(4 << 20)) for _ in range(4)]
    outs = [bytearray(len(b)) for b in bufs]
    tags: list[bytes] = [b""] * 4
    ticks = 0
    stop = threading.Event()

    def count() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1

    def work(i: int) -> None:
        for _ in range(5):
            tags[i] = crypto.seal(key, bytes(12), b"", bufs[i], outs[i])

    counter = threading.Thread(target=count)
    counter.start()
    workers = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stop.set()
    counter.join()
    for i in range(4):
        assert bytes(outs[i]) + tags[i] == AESGCM(key).encrypt(bytes(12), bytes(bufs[i]), b"")
    assert ticks > 0


# ------------------------------------------------------------------ nonces
def test_the_nonce_source_draws_fresh_random_nonces_from_any_thread() -> None:
    src = crypto.NonceSource()
    got: list[bytes] = []

    def draw() -> None:
        for _ in range(2000):
            got.append(src.draw())

    threads = [threading.Thread(target=draw) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8000 and len(set(got)) == 8000
    assert all(len(n) == crypto.NONCE_BYTES for n in got)
