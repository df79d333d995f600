"""A corrupt table header is refused before any field is used as an index
(issue 15, item 10): every field is checked against this version's layout and
the mapping's size. No disk: anonymous mappings."""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
from collections.abc import Iterator

import pytest

from nvmetier import _table  # type: ignore[attr-defined]  # a C extension
from nvmetier import format as fmt
from nvmetier.errors import FormatError

N_SLOTS, WAYS = 64, 8

# nvt_table_header: (offset, struct format) of each field.
FIELDS = {
    "magic": (0, "<Q"),
    "version": (8, "<I"),
    "header_bytes": (12, "<I"),
    "n_slots": (16, "<Q"),
    "ways": (24, "<I"),
    "set_bytes": (28, "<I"),
    "n_sets": (32, "<Q"),
    "max_sharers": (68, "<I"),
}


@pytest.fixture
def lock_fd() -> Iterator[int]:
    fd, path = tempfile.mkstemp(prefix="nvt-header-")
    yield fd
    os.close(fd)
    os.unlink(path)


def _table_map(extra_bytes: int = 0) -> mmap.mmap:
    m = mmap.mmap(-1, _table.table_bytes(N_SLOTS, WAYS) + extra_bytes)
    _table.format(m, N_SLOTS, WAYS)
    return m


def _open(m: mmap.mmap, fd: int, index_bytes: int = N_SLOTS * 128) -> object:
    return _table.Table(
        m,
        mmap.mmap(-1, index_bytes),
        fd,
        n_paths=1,
        slot_bytes=4096,
        row_bytes=4096,
        n_rows=4,
        lease_ns=10**9,
        watch_timeout_ns=10**9,
    )


def test_a_formatted_table_opens(lock_fd: int) -> None:
    m = _table_map()
    assert _table.header(m)["valid"] and _table.header(m)["problem"] is None
    _open(m, lock_fd)


# Each corruption is one a real header can get (bit rot, a torn write, another
# version): every one would index out of the mapping if it were trusted.
CORRUPTIONS = [
    ("magic", 0),
    ("version", fmt.FORMAT_VERSION + 7),
    ("header_bytes", 4096),
    ("n_slots", N_SLOTS * 1024),  # more slots than the mapping holds
    ("n_slots", N_SLOTS + 1),  # not a multiple of ways
    ("n_slots", 1 << 32),  # slot numbers are 32-bit
    ("n_slots", 0),
    ("ways", 0),
    ("ways", 1 << 31),  # layout offsets would overflow 32 bits
    ("ways", 16),  # n_sets no longer n_slots / ways
    ("set_bytes", 64),
    ("n_sets", N_SLOTS // WAYS + 1),  # one set past the end
    ("n_sets", 1 << 40),
    ("max_sharers", 1 << 20),
]


@pytest.mark.parametrize(("field", "value"), CORRUPTIONS, ids=[f"{f}={v}" for f, v in CORRUPTIONS])
def test_a_corrupt_header_field_is_refused_with_its_reason(
    lock_fd: int, field: str, value: int
) -> None:
    m = _table_map()
    off, form = FIELDS[field]
    struct.pack_into(form, m, off, value)
    head = _table.header(m)
    assert not head["valid"] and head["problem"]
    with pytest.raises(ValueError, match="the table is not usable"):
        _open(m, lock_fd)


def test_a_table_shorter_than_its_header_is_refused(lock_fd: int) -> None:
    m = mmap.mmap(-1, 4096)
    with pytest.raises(ValueError, match="shorter than its header"):
        _open(m, lock_fd)


def test_an_index_shorter_than_the_slots_is_refused(lock_fd: int) -> None:
    with pytest.raises(ValueError, match="index is shorter"):
        _open(_table_map(), lock_fd, index_bytes=(N_SLOTS - 1) * 128)


@pytest.mark.parametrize("n_slots", [1 << 32, (1 << 32) - 1, 1 << 40])
def test_table_bytes_and_format_refuse_2_to_the_32_slots(n_slots: int) -> None:
    with pytest.raises(ValueError, match=r"below 2\^32"):
        _table.table_bytes(n_slots, 1)
    with pytest.raises(ValueError, match=r"below 2\^32"):
        _table.format(mmap.mmap(-1, 8192), n_slots, 1)


def test_a_capacity_of_2_to_the_32_slots_is_refused_naming_the_fix() -> None:
    with pytest.raises(FormatError, match=r"fewer than 2\^32 slots.*larger chunks"):
        fmt.geometry(2**32 * 4096 * 2, 4096, 8, 1, {})
