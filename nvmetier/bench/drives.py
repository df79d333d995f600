"""RAM-backed loop drives for the benchmark: fast "drives" anyone can make.

Owns: ``loop_drives`` (a context manager) and the tmpfs, image files, loop
devices and ext4 mounts it creates. Each drive is an image file on one tmpfs,
attached with ``losetup --direct-io=on`` (so O_DIRECT reaches RAM without the
page cache twice), formatted ext4 and mounted: the disk is not the limit, the
I/O path and the CPU are. Needs root, ``losetup`` and ``mkfs.ext4``.

Everything is removed on the way out, whatever happens: the body's exception,
Ctrl-C, or SIGTERM/SIGHUP (turned into an exception for the duration, so the
``finally`` runs). Runs on the calling (main) thread; blocks on the commands.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from types import FrameType

from nvmetier.config import format_size


class DriveSetupError(RuntimeError):
    """The loop drives could not be created (not root, a missing tool, ...)."""


class Interrupted(BaseException):
    """SIGTERM or SIGHUP during the run: unwinds to the cleanup."""


def _run(cmd: list[str]) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise DriveSetupError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout.strip()


def check_can_make_drives() -> str | None:
    """None if loop drives can be made here, else why not."""
    if os.geteuid() != 0:
        return "--loop-drives needs root (losetup, mount)"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"--loop-drives needs {tool}, which is not installed"
    return None


def _umount(path: str, tries: int = 20) -> bool:
    """Unmount ``path``, retrying for ~2 s while it is busy (a loop device
    releases its image a moment after its filesystem is unmounted)."""
    for _ in range(tries):
        if subprocess.run(["umount", path], capture_output=True, check=False).returncode == 0:
            return True
        time.sleep(0.1)
    return False


def _open_under(path: str) -> str:
    """This process's open files under ``path`` (what keeps a mount busy)."""
    names = []
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target.startswith(path + "/"):
                    names.append(os.path.basename(target.removesuffix(" (deleted)")))
    return "open here: " + ", ".join(sorted(names)) if names else "open elsewhere"


@contextlib.contextmanager
def loop_drives(
    n: int, size_bytes: int, log: Callable[[str], None], parent: str | None = None
) -> Iterator[list[str]]:
    """Create ``n`` RAM-backed ext4 loop drives of ``size_bytes`` each.

    Yields:
        The mount points, one per drive (empty directories).

    Raises:
        DriveSetupError: not root, a missing tool, or a command failed; what
            was created so far is removed first.
    """
    why = check_can_make_drives()
    if why:
        raise DriveSetupError(why)
    base = tempfile.mkdtemp(prefix="nvmetier-drives-", dir=parent)
    ram = os.path.join(base, "ram")
    os.mkdir(ram)
    mounted_ram = False
    loops: list[str] = []
    mounts: list[str] = []
    old: dict[signal.Signals, object] = {}

    def interrupted(signum: int, _frame: FrameType | None) -> None:
        raise Interrupted(f"signal {signal.Signals(signum).name}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError):  # not the main thread: no handler
            old[sig] = signal.signal(sig, interrupted)
    try:
        # tmpfs pages are taken as the images fill; the size is a bound.
        _run(["mount", "-t", "tmpfs", "-o", f"size={n * size_bytes + (64 << 20)}", "tmpfs", ram])
        mounted_ram = True
        for i in range(n):
            img = os.path.join(ram, f"drive{i}.img")
            with open(img, "wb") as f:
                f.truncate(size_bytes)
            dev = _run(["losetup", "--direct-io=on", "--find", "--show", img])
            loops.append(dev)
            _run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0", dev])
            mnt = os.path.join(base, f"drive{i}")
            os.mkdir(mnt)
            _run(["mount", dev, mnt])
            mounts.append(mnt)
        where = ", ".join(f"{d} at {m}" for d, m in zip(loops, mounts, strict=True))
        log(
            f"loop drives: {n} x {format_size(size_bytes)} ext4 on RAM-backed loop devices "
            f"(direct I/O on): {where}"
        )
        yield mounts
    finally:
        import gc

        # Files of the run still open (objects of a frozen heap, a store a
        # failed phase left) keep a mount busy: collect them first.
        gc.unfreeze()
        gc.collect()
        errors: list[str] = []
        for mnt in reversed(mounts):
            if not _umount(mnt):  # something still open: detach lazily
                subprocess.run(["umount", "-l", mnt], capture_output=True, check=False)
                errors.append(f"{mnt} busy ({_open_under(mnt)}): detached lazily")
        for dev in reversed(loops):
            r = subprocess.run(["losetup", "-d", dev], capture_output=True, text=True, check=False)
            if r.returncode != 0:
                errors.append(f"losetup -d {dev}: {r.stderr.strip()}")
        if mounted_ram and not _umount(ram):
            subprocess.run(["umount", "-l", ram], capture_output=True, check=False)
            errors.append(f"{ram} busy: detached lazily")
        shutil.rmtree(base, ignore_errors=True)
        for sig, handler in old.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        log(
            f"loop drives removed: {len(loops)} device(s)"
            + (
                f"; {'; '.join(errors)}; the kernel frees them when this process exits"
                if errors
                else ""
            )
        )
