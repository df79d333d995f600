"""What kind of memory a buffer is: huge-page backing, and whether staging pays.

Owns: ``huge_page_bytes`` (how much of an address range the kernel maps with
huge pages, from ``/proc/self/smaps``), ``thp_private_ok`` (whether private
memory may get transparent huge pages here), ``staging_wanted`` (the
``staging: auto`` decision) and ``describe_primary`` (the one line the
store's startup log and ``nvmetier info`` print), and ``advise`` (a
best-effort ``madvise`` of a whole mapping). Read-only look-ups of
``/proc`` and ``/sys``; no threads; callers block for one read of smaps
(a few ms).

Why it matters: vLLM's CPU primary is a ``/dev/shm`` file mapped shared and
populated with ``MADV_POPULATE_WRITE``. On a host whose
``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` is ``never`` (the
common default) its pages are 4 KiB and physically scattered (measured: 440
to 512 pieces per 2 MiB chunk, mostly in descending order, which the block
layer cannot merge). Each piece is one block segment, so an O_DIRECT 2 MiB
load becomes several block requests; a virtio disk without indirect
descriptors then holds about one such request in its ring, and NVMe drives
split it by their PRP/SGL limits. A primary backed by 2 MiB pages (a tmpfs
mounted ``huge=within_size``, or ``shmem_enabled=advise`` with
``MADV_HUGEPAGE``) moves a chunk in one piece per 2 MiB.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any


def advise(m: mmap.mmap, advice: str) -> bool:
    """``madvise`` the whole mapping with ``mmap.<advice>`` (a name such as
    ``"MADV_HUGEPAGE"``), best effort: False where this Python or kernel
    lacks it."""
    value = getattr(mmap, advice, None)
    if value is None:
        return False
    try:
        m.madvise(value)
    except OSError:
        return False
    return True


_THP = "/sys/kernel/mm/transparent_hugepage"
# smaps fields that count bytes mapped by huge pages (kB).
_HUGE_FIELDS = (
    "AnonHugePages",
    "ShmemPmdMapped",
    "FilePmdMapped",
    "Shared_Hugetlb",
    "Private_Hugetlb",
)


def buffer_address(buffer: Any) -> tuple[int, int]:
    """(address, length in bytes) of a writable buffer object."""
    view = memoryview(buffer).cast("B")
    try:
        n = len(view)
        if n == 0:
            return 0, 0
        return ctypes.addressof(ctypes.c_char.from_buffer(view)), n
    finally:
        view.release()


def huge_page_bytes(address: int, length: int, smaps: str = "/proc/self/smaps") -> int:
    """Bytes of ``[address, address+length)`` the kernel maps with huge pages.

    Sums the huge-page fields of every mapping overlapping the range, each
    scaled by the share of that mapping inside the range (smaps counts per
    mapping, not per address). Returns 0 when smaps cannot be read.
    """
    end = address + length
    total = 0.0
    try:
        with open(smaps) as f:
            lo = hi = 0
            overlap = 0
            for line in f:
                head = line.split(None, 1)[0] if line.strip() else ""
                if "-" in head and not head.endswith(":"):
                    a, b = head.split("-")
                    lo, hi = int(a, 16), int(b, 16)
                    overlap = max(0, min(hi, end) - max(lo, address))
                    continue
                if overlap and head[:-1] in _HUGE_FIELDS:
                    kb = int(line.split()[1])
                    total += kb * 1024 * overlap / max(1, hi - lo)
    except OSError:
        return 0
    return int(total)


def _selected(path: str) -> str | None:
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    if "[" in text:
        return text.split("[", 1)[1].split("]", 1)[0]
    return text.strip() or None


def thp_private_ok() -> bool:
    """Whether private memory advised with MADV_HUGEPAGE may get huge pages."""
    mode = _selected(os.path.join(_THP, "enabled"))
    return mode in ("always", "madvise")


def shmem_thp_mode() -> str | None:
    """The host's shmem huge-page policy (``never``, ``advise``, ``within_size``, ...)."""
    return _selected(os.path.join(_THP, "shmem_enabled"))


def staging_wanted(mode: str, buffer: Any) -> tuple[bool, str]:
    """Resolve ``staging`` (``auto``/``on``/``off``) for ``buffer``: (stage, why)."""
    if mode == "off":
        return False, "staging off (config)"
    if mode == "on":
        return True, "staging on (config)"
    address, length = buffer_address(buffer)
    if length == 0:
        return False, "staging off: empty primary"
    huge = huge_page_bytes(address, length)
    if huge >= 0.9 * length:
        return False, f"staging off: the primary is huge-page backed ({huge >> 20} MiB)"
    if not thp_private_ok():
        return False, (
            "staging off: transparent huge pages are disabled for private memory "
            "(/sys/kernel/mm/transparent_hugepage/enabled is never), so staging would "
            "not be contiguous either"
        )
    return True, (
        f"staging on: the primary is in 4 KiB pages ({huge >> 20} of {length >> 20} MiB "
        "huge-page backed)"
    )


def describe_primary(buffer: Any) -> dict[str, Any]:
    """What backs ``buffer``: its size, the bytes in huge pages, the host's THP modes."""
    address, length = buffer_address(buffer)
    huge = huge_page_bytes(address, length) if length else 0
    return {
        "primary_bytes": length,
        "primary_huge_page_bytes": huge,
        "primary_huge_page_share": round(huge / length, 3) if length else 0.0,
        "thp_enabled": _selected(os.path.join(_THP, "enabled")),
        "thp_shmem_enabled": shmem_thp_mode(),
    }


def probe_shm_pages(shm_dir: str = "/dev/shm", length: int = 4 << 20) -> dict[str, Any]:
    """What pages a CPU tier made as vLLM makes its own would get here.

    Creates a ``length``-byte file in ``shm_dir``, unlinks it, maps it shared,
    populates it with ``MADV_POPULATE_WRITE`` (as ``SharedOffloadRegion``
    does) and reads its huge-page share from smaps; the mapping is gone when
    this returns. Never raises: a failure is reported in ``error``.
    """
    import mmap

    out: dict[str, Any] = {
        "shm_dir": shm_dir,
        "thp_enabled": _selected(os.path.join(_THP, "enabled")),
        "thp_shmem_enabled": shmem_thp_mode(),
        "mount_huge": _mount_option(shm_dir, "huge"),
    }
    path = os.path.join(shm_dir, f"nvmetier_probe_{os.getpid()}.mmap")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.unlink(path)
            os.ftruncate(fd, length)
            m = mmap.mmap(fd, length, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        try:
            try:
                m.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23), 0, length)
            except OSError:
                m.write(b"\0" * length)
            address, n = buffer_address(m)
            out["huge_page_share"] = round(huge_page_bytes(address, n) / n, 3)
        finally:
            m.close()
    except OSError as exc:
        out["error"] = f"{path}: {exc.strerror or exc}"
    return out


def _mount_option(path: str, key: str) -> str | None:
    """``key=value``'s value among the mount options of the mount holding ``path``."""
    best, value = "", None
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 4:
                    continue
                mnt = parts[1]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(
                    best
                ):
                    best = mnt
                    value = None
                    for opt in parts[3].split(","):
                        if opt.startswith(key + "="):
                            value = opt.split("=", 1)[1]
    except OSError:
        return None
    return value
