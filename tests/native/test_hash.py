"""The native XXH3 (nvt_hash) in both modules: every vector build the CPU has
gives python-xxhash's value, the fused copy copies and hashes the same bytes,
forcing a build the CPU lacks is refused, and the profiling counters count
what they say (about 0.3 s)."""

from __future__ import annotations

import os

import pytest
import xxhash

from nvmetier import _table

try:
    from nvmetier import _uring
except ImportError:  # the io_uring engine is optional
    _uring = None  # type: ignore[assignment]

MODULES = [_table] + ([_uring] if _uring is not None else [])
IMPLS = ("avx512", "avx2", "baseline")
# Around the dispatch threshold (1 KiB), the fused block (64 KiB), the GIL
# threshold (64 KiB) and XXH3's stripe and block sizes.
SIZES = (0, 1, 17, 240, 1023, 1024, 1025, 4096, 65535, 65536, 65537, (2 << 20) + 3)


def _available(mod: object) -> list[str]:
    best = mod.xxh3_impl()  # type: ignore[attr-defined]
    return list(IMPLS[IMPLS.index(best) :])


@pytest.fixture(params=MODULES, ids=lambda m: m.__name__)
def mod(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    m = request.param
    best = m.xxh3_impl()
    yield m
    m._xxh3_force(best)


def test_every_build_matches_xxhash(mod) -> None:  # type: ignore[no-untyped-def]
    data = os.urandom(max(SIZES) + 64)
    for impl in _available(mod):
        mod._xxh3_force(impl)
        assert mod.xxh3_impl() == impl
        for n in SIZES:
            for start in (0, 3):  # unaligned too
                view = memoryview(data)[start : start + n]
                want = xxhash.xxh3_64_intdigest(view, n * 7 + 1)
                assert mod.xxh3(view, n * 7 + 1) == want, (impl, n, start)
                dst = bytearray(n)
                assert mod.xxh3_copy(dst, view, n * 7 + 1) == want, (impl, n, start)
                assert dst == view


def test_copy_and_size_mismatch(mod) -> None:  # type: ignore[no-untyped-def]
    src = os.urandom(70000)
    dst = bytearray(len(src))
    mod.copy(dst, src)
    assert dst == src
    with pytest.raises(ValueError, match="one size"):
        mod.xxh3_copy(bytearray(10), src)
    with pytest.raises(TypeError):
        mod.xxh3_copy(b"read-only", b"read-only")


def test_force_refuses_unknown(mod) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="not available"):
        mod._xxh3_force("sse9")
    if mod.xxh3_impl() != "avx512":
        with pytest.raises(ValueError, match="not available"):
            mod._xxh3_force("avx512")


def test_profile_counts_bytes(mod) -> None:  # type: ignore[no-untyped-def]
    data = os.urandom(1 << 20)
    dst = bytearray(len(data))
    mod.hash_profile(True)
    try:
        mod.xxh3(data)
        mod.xxh3(data[:100])  # under 1 KiB: not counted
        mod.xxh3_copy(dst, data)
        mod.copy(dst, data)
        mod.copy(dst, data)
        p = mod.hash_profile_read()
    finally:
        mod.hash_profile(False)
    assert p["hash_bytes"] == 1 << 20
    assert p["copy_hash_bytes"] == 1 << 20
    assert p["copy_bytes"] == 2 << 20
    assert p["hash_ns"] > 0 and p["copy_hash_ns"] > 0 and p["copy_ns"] > 0
    mod.xxh3(data)  # off: no longer counted
    assert mod.hash_profile_read()["hash_bytes"] == 1 << 20
    mod.hash_profile(True)  # on again: zeroed
    assert mod.hash_profile_read()["hash_bytes"] == 0
    mod.hash_profile(False)
