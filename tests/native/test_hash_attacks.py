"""The native XXH3 functions of ``_table`` and ``_uring`` against hostile
callers: overlapping buffers, odd lengths and alignments at every dispatch
boundary with seeds (property-based against python-xxhash), wrong types,
buffers resized or closed by another thread while the GIL is released, and
the profiling counters under concurrent threads (about 1.5 s)."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterator

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from nvmetier import _table

try:
    from nvmetier import _uring
except ImportError:  # the io_uring engine is optional
    _uring = None  # type: ignore[assignment]

MODULES = [_table] + ([_uring] if _uring is not None else [])
IMPLS = ("avx512", "avx2", "baseline")
# The dispatch threshold (1 KiB), the fused block and the GIL threshold
# (64 KiB), XXH3's internal block (1 KiB stripes of 16 x 64 B) edges.
BOUNDARIES = (0, 1, 16, 17, 128, 129, 240, 241, 1023, 1024, 1025, 65535, 65536, 65537, 131073)


def _available(mod: object) -> list[str]:
    best = mod.xxh3_impl()  # type: ignore[attr-defined]
    return list(IMPLS[IMPLS.index(best) :])


@pytest.fixture(params=MODULES, ids=lambda m: m.__name__)
def mod(request: pytest.FixtureRequest) -> Iterator[object]:
    m = request.param
    best = m.xxh3_impl()
    yield m
    m._xxh3_force(best)
    assert m.xxh3_impl() == best


@pytest.mark.parametrize("fn", ["copy", "xxh3_copy"])
def test_overlapping_buffers_are_refused(mod, fn: str) -> None:  # type: ignore[no-untyped-def]
    """memcpy on overlapping ranges is undefined: it left dst unlike src
    (and the fused hash that of neither) before this was refused."""
    n = 3 << 16
    buf = bytearray(os.urandom(n + 4096))
    before = bytes(buf)
    mv = memoryview(buf)
    f = getattr(mod, fn)
    for dst, src in (
        (mv[100 : 100 + n], mv[:n]),  # dst after src
        (mv[:n], mv[100 : 100 + n]),  # dst before src
        (mv[:n], mv[:n]),  # the same bytes
        (mv[5:6], mv[5:6]),  # one byte
    ):
        with pytest.raises(ValueError, match="overlapping buffers"):
            f(dst, src)
    assert bytes(buf) == before  # nothing was copied
    # Adjacent is not overlapping; nor is an empty copy.
    f(mv[n : n + 4096], mv[n - 4096 : n])
    assert bytes(mv[n : n + 4096]) == before[n - 4096 : n]
    f(mv[0:0], mv[0:0])


def test_force_refuses_bad_names(mod) -> None:  # type: ignore[no-untyped-def]
    best = mod.xxh3_impl()
    with pytest.raises(TypeError, match="build's name"):
        mod._xxh3_force(2)
    with pytest.raises(TypeError, match="build's name"):
        mod._xxh3_force(b"avx2")
    with pytest.raises(ValueError, match="not available"):
        mod._xxh3_force("baseline\0avx512")  # not read as "baseline"
    with pytest.raises(ValueError, match="not available"):
        mod._xxh3_force("")
    assert mod.xxh3_impl() == best


def test_wrong_types_and_buffers_raise(mod) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(TypeError):
        mod.xxh3("text")
    with pytest.raises(TypeError):
        mod.xxh3(b"x", 1.5)
    with pytest.raises(BufferError):  # a strided view has no one pointer
        mod.xxh3(memoryview(b"0123456789")[::2])
    with pytest.raises(TypeError):  # nor may a strided or read-only dst be written
        mod.copy(memoryview(bytearray(20))[::2], b"0123456789")
    with pytest.raises(TypeError):
        mod.copy(memoryview(bytes(10)), b"0123456789")
    with pytest.raises(TypeError, match="copy"):  # a copy has no seed to give
        mod.copy(bytearray(10), b"0123456789", 5)
    ro = mmap.mmap(-1, 4096, prot=mmap.PROT_READ)
    try:
        with pytest.raises(TypeError):
            mod.xxh3_copy(ro, bytes(4096))
    finally:
        ro.close()


@pytest.mark.parametrize("seed", [-1, 2**64 - 1, 2**64 + 5, -(2**63)])
def test_seeds_wrap_as_python_xxhash_does(mod, seed: int) -> None:  # type: ignore[no-untyped-def]
    data = os.urandom(70000)
    assert mod.xxh3(data, seed) == xxhash.xxh3_64_intdigest(data, seed)


_DATA = os.urandom(131073 + 64)


@settings(max_examples=60, deadline=None)
@given(
    n=st.sampled_from(BOUNDARIES) | st.integers(0, 131073),
    start=st.integers(0, 63),
    seed=st.integers(0, 2**64 - 1),
    dst_start=st.integers(0, 63),
)
def test_every_build_matches_xxhash_at_any_length_and_alignment(
    n: int, start: int, seed: int, dst_start: int
) -> None:
    src = memoryview(_DATA)[start : start + n]
    want = xxhash.xxh3_64_intdigest(src, seed)
    for m in MODULES:
        best = m.xxh3_impl()
        try:
            for impl in _available(m):
                m._xxh3_force(impl)
                assert m.xxh3(src, seed) == want, (m.__name__, impl)
                dst = bytearray(n + 64)
                view = memoryview(dst)[dst_start : dst_start + n]
                assert m.xxh3_copy(view, src, seed) == want, (m.__name__, impl)
                assert view == src
                assert dst[:dst_start] == bytes(dst_start)  # nothing written outside
                assert dst[dst_start + n :] == bytes(64 - dst_start)
        finally:
            m._xxh3_force(best)


def test_buffers_stay_pinned_while_the_gil_is_released(mod) -> None:  # type: ignore[no-untyped-def]
    """Another thread cannot resize a bytearray (hashed, or written as a
    copy's destination) nor close an mmap while it is used off the GIL: each
    buffer is exported for the whole call (under ASan a freed buffer would
    be reported)."""
    src = os.urandom(16 << 20)
    big = bytearray(src)
    # Between two calls the resizer may have left one byte more.
    allowed = {xxhash.xxh3_64_intdigest(src, 3), xxhash.xxh3_64_intdigest(src + b"x", 3)}
    stop = threading.Event()
    refused = 0

    def resize() -> None:
        nonlocal refused
        while not stop.is_set():
            try:
                big.extend(b"x")
                del big[-1]
            except BufferError:
                refused += 1

    t = threading.Thread(target=resize)
    t.start()
    try:
        sums = {mod.xxh3(big, 3) for _ in range(20)}
        for _ in range(10):
            try:
                sums.add(mod.xxh3_copy(big, src, 3))
            except ValueError as exc:  # one byte more between two calls
                assert "one size" in str(exc)
    finally:
        stop.set()
        t.join()
    assert sums <= allowed
    assert refused > 0  # the race was run, and lost by the resizer
    want = xxhash.xxh3_64_intdigest(src, 3)

    m = mmap.mmap(-1, 16 << 20)
    m[:] = src
    refused = 0

    def close() -> None:
        nonlocal refused
        while True:
            try:
                m.close()
                return
            except BufferError:
                refused += 1

    t = threading.Thread(target=close)
    t.start()
    try:
        for _ in range(200):
            try:
                assert mod.xxh3(m, 3) == want
            except ValueError as exc:  # closed between two calls: refused cleanly
                assert "closed" in str(exc)
                break
    finally:
        t.join()
    assert m.closed


def test_profile_counters_add_up_under_threads(mod) -> None:  # type: ignore[no-untyped-def]
    data = os.urandom(1 << 20)
    n_threads, rounds = 4, 10

    def work() -> None:
        dst = bytearray(len(data))
        for _ in range(rounds):
            mod.xxh3(data)
            mod.xxh3_copy(dst, data)
            mod.copy(dst, data)

    mod.hash_profile(True)
    try:
        threads = [threading.Thread(target=work) for _ in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        p = mod.hash_profile_read()
    finally:
        mod.hash_profile(False)
    total = n_threads * rounds * len(data)
    assert p["hash_bytes"] == p["copy_hash_bytes"] == p["copy_bytes"] == total
    assert all(p[k] > 0 for k in ("hash_ns", "copy_hash_ns", "copy_ns"))
