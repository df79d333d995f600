"""``staging: auto`` decided by measurement: the probe and its kept result.

Owns ``probe`` (a short run of both modes on the store's own drives, with
the store's own engine, over shared scratch memory in 4 KiB pages from the
allocator vLLM's region comes from (never the primary itself, which may
already hold KV another process reads): the CPU seconds per GB of every
thread the engine runs plus the caller's, and the GB/s each way) and the
small file ``staging`` beside the superblock that keeps the result per
engine, so a reopen reuses it.

Why: on drives that take 4 KiB-page ops at full speed (RAM-backed loop
drives, many NVMe drives) staging's copy costs CPU and bandwidth; on a
drive that splits such ops (a virtio disk with a low segment limit) staging
is what reaches the drive's speed. The page size alone cannot tell them
apart; moving a few MiB both ways can.

Rule (``choose``): the mode that moves at least ``BW_MARGIN`` times the
other's GB/s in loads or in stores (and is not that much slower the other
way) wins, except that a virtio disk without indirect descriptors
(``ring_bound_drive``: its ring holds about one unstaged scattered chunk at
a time, which a burst of a few MiB does not show) always stages; otherwise
the one with fewer CPU seconds per GB (the tier's cost on a node where cores
are shared with vLLM).

Called by ``BlockStore.__init__`` on the opening thread for ``staging:
auto`` with O_DIRECT on, a plaintext store and a primary in 4 KiB pages,
when no result for this engine, chunk size and drive count is kept (at
creation, or the first open after an upgrade) and this process has not
probed the same drives already. The probe writes and reads
scratch files of its own on the store's drives (without a name: O_TMPFILE), never the
store's data files. Blocks for the probe (tens to hundreds of ms; each wait
bounded by ``PROBE_TIMEOUT_S``). A probe that fails raises OSError; the
caller then keeps the page-size rule (``nvmetier.memory.staging_wanted``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from nvmetier import budget
from nvmetier.thread_cpu import thread_times

logger = logging.getLogger(__name__)

FILE_NAME = "staging"
FILE_VERSION = 1
BW_MARGIN = 1.25
PROBE_TIMEOUT_S = 10.0
# Bytes per mode and direction: a few MiB, at least 8 ops per drive.
PROBE_MIN_BYTES = 16 << 20
PROBE_MAX_BYTES = 64 << 20
# The scratch buffer (rows reused as a ring past it).
PROBE_BUFFER_BYTES = 32 << 20
O_DIRECT = getattr(os, "O_DIRECT", 0o40000)
_MADV_NOHUGEPAGE = getattr(mmap, "MADV_NOHUGEPAGE", 15)
# Results probed in this process, by (the folders' devices, engine, chunk
# size, io_workers, queue_depth): a second store on the same drives (another
# data-parallel rank's, a test's) reuses the measurement instead of probing.
_MEMO: dict[tuple[Any, ...], dict[str, Any]] = {}
_MEMO_LOCK = threading.Lock()


def _task_cpu() -> dict[int, float]:
    """{tid: CPU seconds} of this process's live threads."""
    return {tid: t[3] for tid, t in thread_times().items()}


def _cpu_since(before: dict[int, float], caller_t0: float) -> float:
    """CPU of the threads born since ``before`` (the engine's) and the
    caller's own thread: other threads of the process (vLLM's) are not ours."""
    caller = threading.get_native_id()
    now = _task_cpu()
    born = sum(v for tid, v in now.items() if tid not in before and tid != caller)
    return born + (time.thread_time() - caller_t0)


def _scratch(length: int) -> mmap.mmap:
    """Shared memory in 4 KiB pages, populated, from the allocator vLLM's
    region comes from (shmem: vLLM maps a ``/dev/shm`` file; a memfd is
    the same kind of page, physically scattered alike). Fresh private
    memory would not do: its pages often come physically contiguous, so
    the block layer merges them and the probe would not see what a real
    primary costs a drive that splits scattered pages."""
    fd = os.memfd_create("nvmetier-staging-probe", getattr(os, "MFD_CLOEXEC", 1))
    try:
        os.ftruncate(fd, length)
        m = mmap.mmap(fd, length, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError, AttributeError):
        m.madvise(_MADV_NOHUGEPAGE)
    pattern = os.urandom(1 << 16)
    for off in range(0, length, len(pattern)):
        m[off : off + len(pattern)] = pattern[: length - off]
    return m


def _run(engine: Any, ops: list[Any]) -> bool:
    """Submit ``ops`` at once and wait for them all; False on an error."""
    engine.submit(ops)
    left = {op.op_id for op in ops}
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    ok = True
    while left and time.monotonic() < deadline:
        for c in engine.wait_completions(0.05):
            left.discard(c.op_id)
            ok = ok and c.result >= 0
    return ok and not left


def _scratch_file(d: str) -> int:
    """An O_DIRECT scratch file in ``d`` that has no name: O_TMPFILE, so a
    process killed at any point leaves nothing on disk. Where the filesystem
    lacks O_TMPFILE, a named file unlinked at once (a kill between the two
    leaves an empty file)."""
    flags = os.O_RDWR | os.O_CLOEXEC | O_DIRECT
    tmpfile = getattr(os, "O_TMPFILE", 0)
    if tmpfile:
        try:
            return os.open(d, flags | tmpfile, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR):
                raise
    path = os.path.join(d, f".staging-probe-{os.getpid()}-{threading.get_native_id()}")
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(path)
    return fd


def _probe_files(dirs: Sequence[str], size: int) -> list[int]:
    """One scratch file per drive (the store's folders), O_DIRECT, without a
    name (``_scratch_file``: the fd keeps it until the probe closes it) and
    allocated as the store's data files are."""
    fds: list[int] = []
    try:
        for d in dirs:
            fd = _scratch_file(d)
            fds.append(fd)
            os.posix_fallocate(fd, 0, size)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def probe(
    make: Callable[[memoryview, list[int], bool], Any],
    dirs: Sequence[str],
    chunk_bytes: int,
) -> dict[str, Any]:
    """Measure both modes: ``make(buffer, fds, staging)`` builds the store's
    engine over a scratch buffer and scratch files on the store's drives
    (never its data files: another process may be storing already). Ops of
    ``chunk_bytes`` are striped over the drives as the store stripes, all
    submitted at once, written then read back. Two rounds, alternated (off,
    on, off, on), the better round of each mode kept. Returns the result
    (``choose`` applied); raises OSError when the probe cannot run."""
    n_files = len(dirs)
    file_bytes = probe_file_bytes(n_files, chunk_bytes)
    n_ops = max(n_files, file_bytes * n_files // chunk_bytes)
    rows = max(1, min(n_ops, PROBE_BUFFER_BYTES // chunk_bytes))
    span = rows * chunk_bytes
    fds = _probe_files(dirs, file_bytes)
    # Never the store's primary: vLLM may already hold KV in it (a store is
    # reopened at the first data-path call when the block-hash seed turns out
    # random), and another process (the GPU worker) reads and writes it.
    try:
        scratch = _scratch(span)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    view = memoryview(scratch)
    best: dict[str, dict[str, float]] = {}
    try:
        from nvmetier.engine.base import OP_READ, OP_WRITE, Op

        for _round in range(2):
            for mode in ("off", "on"):
                before = _task_cpu()
                t_caller = time.thread_time()
                engine = make(view, fds, mode == "on")
                try:
                    walls = []
                    for kind in (OP_WRITE, OP_READ):
                        ops = [
                            Op(
                                i,
                                kind,
                                i % n_files,
                                (i // n_files) * chunk_bytes,
                                (i % rows) * chunk_bytes,
                                chunk_bytes,
                                i,
                                True,
                            )
                            for i in range(n_ops)
                        ]
                        cpu0 = _cpu_since(before, t_caller)
                        t0 = time.perf_counter()
                        if not _run(engine, ops):
                            raise OSError(f"a probe op failed or timed out (staging {mode})")
                        wall = time.perf_counter() - t0
                        walls.append((wall, _cpu_since(before, t_caller) - cpu0))
                finally:
                    engine.close()
                one_way = n_ops * chunk_bytes / 1e9
                (w_wall, w_cpu), (r_wall, r_cpu) = walls
                row = {
                    "gbps": 2 * one_way / max(1e-9, w_wall + r_wall),
                    "write_gbps": one_way / max(1e-9, w_wall),
                    "read_gbps": one_way / max(1e-9, r_wall),
                    "cpu_s_per_gb": (w_cpu + r_cpu) / (2 * one_way),
                }
                prev = best.get(mode)
                # The better round of each figure: a shared machine's noise is
                # one-sided (it only ever slows a round down).
                best[mode] = (
                    row
                    if prev is None
                    else {k: (min if k == "cpu_s_per_gb" else max)(prev[k], row[k]) for k in row}
                )
    finally:
        view.release()
        scratch.close()
        for fd in fds:
            os.close(fd)
    stage, why = choose(best["on"], best["off"], ring_bound_drive(dirs))
    return {
        "staging": "on" if stage else "off",
        "why": why,
        "on": {k: round(v, 4) for k, v in best["on"].items()},
        "off": {k: round(v, 4) for k, v in best["off"].items()},
        "chunk_bytes": chunk_bytes,
        "drives": n_files,
        "probe_bytes": n_ops * chunk_bytes,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def ring_bound_drive(dirs: Sequence[str]) -> str | None:
    """The first of ``dirs``' block devices that is virtio-blk without
    indirect descriptors (``VIRTIO_RING_F_INDIRECT_DESC``, feature bit 28,
    off), else None. Every segment of a request takes one of such a ring's
    descriptors, so an unstaged chunk of scattered 4 KiB pages (hundreds of
    segments) leaves room for about one request in the device at a time
    (docs/bench.md, "Tier-level loads"): a burst of a few MiB does not show
    it, sustained loads beside other I/O do. Never raises."""
    for d in dirs:
        try:
            st = os.stat(d)
            dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
            sys_dev = os.path.realpath(f"/sys/dev/block/{dev}")
            if os.path.exists(os.path.join(sys_dev, "partition")):
                sys_dev = os.path.dirname(sys_dev)
            driver = os.path.basename(os.path.realpath(os.path.join(sys_dev, "device", "driver")))
            if driver != "virtio_blk":
                continue
            with open(os.path.join(sys_dev, "device", "features")) as f:
                bits = f.read().strip()
            if len(bits) > 28 and bits[28] == "0":
                return os.path.basename(sys_dev)
        except (OSError, ValueError):
            continue
    return None


def choose(
    on: dict[str, float], off: dict[str, float], ring_bound: str | None = None
) -> tuple[bool, str]:
    """(stage, why) from the two modes' figures (see the module's rule): a
    mode wins on bandwidth when, in loads or in stores, it moves at least
    ``BW_MARGIN`` times the other's GB/s and is not that much slower the
    other way; else the one with fewer CPU seconds per GB."""
    figures = (
        f"staging on: loads {on['read_gbps']:.2f} GB/s, stores {on['write_gbps']:.2f} GB/s, "
        f"{on['cpu_s_per_gb']:.3f} CPU s/GB; off: loads {off['read_gbps']:.2f}, stores "
        f"{off['write_gbps']:.2f}, {off['cpu_s_per_gb']:.3f}"
    )

    def faster(a: dict[str, float], b: dict[str, float]) -> bool:
        ways = ("read_gbps", "write_gbps")
        return any(a[w] >= BW_MARGIN * b[w] for w in ways) and not any(
            b[w] >= BW_MARGIN * a[w] for w in ways
        )

    if faster(on, off):
        return True, f"staging on: it moves more bytes on these drives ({figures})"
    # A short burst on a shared virtio disk has been seen to favour either
    # mode; sustained loads there were 0.55x fio unstaged (docs/bench.md).
    if ring_bound:
        return True, (
            f"staging on: {ring_bound} is virtio-blk without indirect descriptors, where an "
            "unstaged chunk of scattered pages fills the ring, which a short probe does not "
            f"show ({figures})"
        )
    if faster(off, on):
        return False, f"staging off: it moves more bytes on these drives ({figures})"
    if off["cpu_s_per_gb"] <= on["cpu_s_per_gb"]:
        return False, f"staging off: as fast, and fewer CPU seconds per GB ({figures})"
    return True, f"staging on: as fast, and fewer CPU seconds per GB ({figures})"


# The kept file is a few hundred bytes a result: past this it is not ours.
MAX_FILE_BYTES = 1 << 20


def _valid(res: Any) -> bool:
    """Whether ``res`` is a result as ``probe`` makes it, in the fields the
    open and ``nvmetier info`` use (a bool is not a count here)."""
    return (
        isinstance(res, dict)
        and res.get("staging") in ("on", "off")
        and all(
            type(res.get(k)) is int and res[k] > 0  # True is not 1 drive
            for k in ("chunk_bytes", "drives")
        )
        and isinstance(res.get("why"), str)
        and len(res["why"]) <= 2000  # a probe's is ~250 characters; it is logged
        and isinstance(res.get("measured_at", ""), str)
        and len(res.get("measured_at", "")) <= 40
    )


def _read(store_dir: str) -> tuple[dict[str, Any], str | None]:
    """(the kept results by engine, the valid ones only; why the file or a
    result in it was ignored, None when nothing was). Never raises, never
    blocks: a FIFO, a device or a symlink in the file's place is refused
    unread, and so is a file past ``MAX_FILE_BYTES`` or JSON nested past
    the parser's recursion limit."""
    path = os.path.join(store_dir, FILE_NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return {}, None
    except OSError as exc:
        return {}, f"it cannot be opened ({exc.strerror or exc})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return {}, "it is not a regular file"
        if st.st_size > MAX_FILE_BYTES:
            return {}, f"it holds {st.st_size} bytes, more than a kept result ever does"
        raw = b""
        while len(raw) <= MAX_FILE_BYTES:  # it may still grow as we read
            chunk = os.read(fd, MAX_FILE_BYTES + 1 - len(raw))
            if not chunk:
                break
            raw += chunk
    except OSError as exc:
        return {}, f"it cannot be read ({exc.strerror or exc})"
    finally:
        os.close(fd)
    if len(raw) > MAX_FILE_BYTES:
        return {}, "it grew past the size a kept result ever has"
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        return {}, f"it is not the JSON a probe writes ({type(exc).__name__}: {str(exc)[:100]})"
    if not isinstance(data, dict):
        return {}, "it is not the JSON object a probe writes"
    version = data.get("version")
    if type(version) is not int or version != FILE_VERSION:  # True is not 1
        return {}, f"its version is {str(version)[:40]!r}, this nvmetier reads {FILE_VERSION}"
    engines = data.get("engines")
    if not isinstance(engines, dict):
        return {}, "it holds no results by engine"
    good = {k: v for k, v in engines.items() if isinstance(k, str) and _valid(v)}
    bad = [str(k)[:40] for k in engines if k not in good]
    return good, (f"the result for engine(s) {', '.join(bad)} is malformed" if bad else None)


def load(store_dir: str) -> dict[str, Any]:
    """The kept results, by engine name, each as ``probe`` makes it ({} if
    none, or unreadable; a malformed result is left out). Never raises."""
    return _read(store_dir)[0]


def save(store_dir: str, engine: str, result: dict[str, Any]) -> None:
    """Keep ``result`` for ``engine`` beside the superblock (atomically:
    written beside and renamed; the temporary file made anew, never
    followed through a link). Never raises."""
    engines = load(store_dir)
    engines[engine] = result
    path = os.path.join(store_dir, FILE_NAME)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # one a crashed process of this pid left
        fd = os.open(
            tmp,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
        )
        with os.fdopen(fd, "w") as f:
            json.dump({"version": FILE_VERSION, "engines": engines}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("nvmetier: could not keep the staging probe in %s: %s", path, exc)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def kept(store_dir: str, engine: str, chunk_bytes: int, drives: int) -> dict[str, Any] | None:
    """The kept result for this engine, chunk size and drive count, or None.
    A kept file that cannot be used is logged (the store probes again and
    keeps a good one in its place)."""
    results, problem = _read(store_dir)
    if problem:
        logger.warning(
            "nvmetier: ignoring the staging probe kept in %s: %s; the store probes again and "
            "replaces it",
            os.path.join(store_dir, FILE_NAME),
            problem,
        )
    res = results.get(engine)
    if res is not None and res["chunk_bytes"] == chunk_bytes and res["drives"] == drives:
        return res  # type: ignore[no-any-return]
    return None


def describe_choice(res: dict[str, Any], reused: bool) -> str:
    """One line for logs and ``nvmetier info``."""
    when = f"probed {res.get('measured_at', '?')}" + (", kept with the store" if reused else "")
    return f"{res.get('why', res.get('staging'))} [{when}]"


def probe_file_bytes(n_files: int, chunk_bytes: int) -> int:
    """The size of each drive's scratch file in ``probe``."""
    per_mode = min(PROBE_MAX_BYTES, max(PROBE_MIN_BYTES, 8 * n_files * chunk_bytes))
    n_ops = max(n_files, per_mode // chunk_bytes)
    return -(-n_ops // n_files) * chunk_bytes


def _probe_within_budget(
    make: Callable[[memoryview, list[int], bool], Any],
    dirs: Sequence[str],
    chunk_bytes: int,
    config: Any,
) -> dict[str, Any]:
    """``probe`` under the root lock, when its scratch files fit the root
    budget and the filesystem reserve (nvmetier.budget): a transient file is
    still bytes on disk, and an emptyDir's sizeLimit counts it. Raises
    OSError(ENOSPC) when they do not fit (the page-size rule then stands)."""
    roots = [os.path.dirname(os.path.normpath(d)) for d in dirs]
    need = probe_file_bytes(len(dirs), chunk_bytes)
    with budget.root_lock(roots):
        room = budget.scratch_room(roots, budget.Policy.from_config(config))
        if need > room:
            raise OSError(
                errno.ENOSPC,
                f"its scratch files ({need} bytes a drive) do not fit the root budget and "
                f"the filesystem reserve ({room} bytes left)",
            )
        return probe(make, dirs, chunk_bytes)


def decide(
    files: Any,
    engine_name: str,
    config: Any,
    row_bytes: int,
    stage: bool,
    reason: str,
) -> tuple[bool, str, dict[str, Any] | None]:
    """``staging: auto`` on a primary in 4 KiB pages, for ``BlockStore``:
    (stage, why, the probe's result) from the result kept with the store for
    this engine, chunk size and drive count, else from a probe now (then
    kept). The page-size rule (``stage``, ``reason``) stands when the probe
    cannot run. ``files`` is the store's ``StoreFiles``, ``config`` its
    ``TierConfig``."""
    from nvmetier.engine import make_engine

    main = files.dirs[0]
    drives = len(files.data_fds)
    res = kept(main, engine_name, row_bytes, drives)
    reused = res is not None
    try:
        devices = tuple(os.stat(d).st_dev for d in files.dirs)
    except OSError:
        devices = ()
    memo_key = (devices, engine_name, row_bytes, str(config.io_workers), config.queue_depth)
    if res is None and devices:
        with _MEMO_LOCK:
            res = _MEMO.get(memo_key)
        if res is not None:  # another store of this process, on the same drives
            save(main, engine_name, res)
            reused = True
    if res is None:

        def make(buf: memoryview, fds: list[int], staged: bool) -> Any:
            return make_engine(
                engine_name,
                buf,
                fds,
                io_threads=config.io_threads,
                queue_depth=config.queue_depth,
                max_inflight_bytes=config.max_inflight_bytes,
                io_workers=config.io_workers,
                chunk_bytes=row_bytes,
                staging=staged,
            )

        try:
            res = _probe_within_budget(make, files.dirs, row_bytes, config)
        except (OSError, ValueError, RuntimeError) as exc:
            # The text only: a log record holding the exception would hold
            # its frames, and through them the caller's buffer.
            why = str(exc)
            logger.warning("nvmetier: the staging probe in %s could not run: %s", main, why)
            return stage, f"{reason} (the staging probe could not run: {why})", None
        save(main, engine_name, res)
    if devices:
        with _MEMO_LOCK:
            _MEMO[memo_key] = res
    return res["staging"] == "on", describe_choice(res, reused), res


__all__: Sequence[str] = (
    "FILE_NAME",
    "choose",
    "decide",
    "describe_choice",
    "kept",
    "load",
    "probe",
    "save",
)
