"""The CPU spec's primary-tier region files: claimed by a live server, so no
reclaim removes them, across PID namespaces too; reclaimed once their
server is dead; left with a warning when they belong to another user.

The namespace tests run real processes in PID namespaces of their own
(``unshare --pid --fork --mount-proc``, as root): the holder of a region
stands for a server in one container, the reclaim for a server starting in
another that shares ``/dev/shm`` (here a temporary directory) and sees none
of the first one's processes. Skipped where ``unshare`` cannot do that.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
)
from vllm.v1.kv_offload.cpu import gpu_worker

from nvmetier.shm_region import claim_region, region_path
from nvmetier.vllm.cpu import CpuTieringOffloadingSpec
from nvmetier.vllm.harness import make_config

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WAIT_S = 60.0  # bound on every wait for another process
OLD = 1_000_000_000  # an mtime long past: age keeps nothing in these tests
PAGE = 32 << 10

# A server's worker in its own PID namespace: claims the region, maps it as
# vLLM does, says "ready", and holds both until its stdin closes (or 120 s).
HOLDER = f"""
import mmap, os, signal, sys
from nvmetier.shm_region import claim_region
signal.alarm(120)
path = sys.argv[1]
claim = claim_region(path, mmap.PAGESIZE)
with open(path, "r+b") as f:
    region = mmap.mmap(f.fileno(), mmap.PAGESIZE)
os.utime(path, ({OLD}, {OLD}))
print("ready", os.getpid(), flush=True)
sys.stdin.read()
"""

# A server starting elsewhere: its reclaim of directory argv[1], as JSON; as
# user argv[2] (uid:gid) if given, dropped to once Python and nvmetier are
# loaded (this Python lives where only root may read).
RECLAIM = """
import json, logging, os, sys
from nvmetier.shm_region import reclaim_stale_regions
logging.basicConfig(format="%(levelname)s %(message)s")
if len(sys.argv) > 2:
    uid, gid = map(int, sys.argv[2].split(":"))
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
print(json.dumps(reclaim_stale_regions(sys.argv[1], min_age_s=0)))
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": REPO_ROOT}


def _unshare_works() -> str | None:
    """Why no PID namespace can be made here (None when one can)."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    try:
        done = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", "true"],
            capture_output=True,
            timeout=WAIT_S,
        )
    except subprocess.TimeoutExpired:
        return "unshare did not finish"
    if done.returncode != 0:
        return f"unshare --pid --mount-proc fails here: {done.stderr.decode().strip()}"
    return None


@pytest.fixture(scope="module")
def namespaces() -> None:
    why = _unshare_works()
    if why:
        pytest.skip(why)


@pytest.fixture
def shm(tmp_path) -> str:
    """A directory standing in for /dev/shm."""
    d = tmp_path / "shm"
    d.mkdir()
    return str(d)


def _in_namespace(script: str, *args: str) -> list[str]:
    return ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", script, *args]


def _read_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The next line the process writes, waiting at most ``timeout_s``."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            raise TimeoutError(f"no line from pid {proc.pid} in {timeout_s} s")
    return proc.stdout.readline()


@contextlib.contextmanager
def _holder(path: str) -> Iterator[subprocess.Popen[str]]:
    """A region holder in its own PID namespace, ready; stopped at the end."""
    proc = subprocess.Popen(
        _in_namespace(HOLDER, path),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
        start_new_session=True,  # its own process group: killed as one
    )
    try:
        line = _read_line(proc, WAIT_S)
        # PID 1: it sees only its own namespace.
        assert line.split() == ["ready", "1"], line
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(WAIT_S)


def _reclaim_in_another_namespace(region_dir: str) -> list[str]:
    done = subprocess.run(
        _in_namespace(RECLAIM, region_dir),
        capture_output=True,
        text=True,
        env=_env(),
        timeout=WAIT_S,
        check=True,
    )
    removed: list[str] = json.loads(done.stdout.splitlines()[-1])
    return removed


def _claimed(path: str) -> bool:
    """Whether some process holds a claim on the file (the protocol's lock)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _wait_unclaimed(path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _claimed(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} still claimed after {timeout_s} s")
        time.sleep(0.01)


def test_a_live_servers_region_in_another_pid_namespace_is_kept(namespaces, shm) -> None:
    path = region_path("live", shm)
    with _holder(path):
        assert _reclaim_in_another_namespace(shm) == []
        assert os.path.exists(path)


def test_a_killed_servers_region_in_another_pid_namespace_is_removed(namespaces, shm) -> None:
    path = region_path("killed", shm)
    with _holder(path) as proc:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(WAIT_S)
        _wait_unclaimed(path, WAIT_S)  # the kernel drops a killed process's locks
        assert _reclaim_in_another_namespace(shm) == [path]
        assert not os.path.exists(path)


def test_a_claim_made_while_a_reclaim_removes_its_file_holds_a_new_one(tmp_path) -> None:
    path = region_path("raced", str(tmp_path))
    with open(path, "wb"):
        pass
    # The old file stays open here, so its inode number is not reused.
    old = os.open(path, os.O_RDONLY)
    claims = []
    # A reclaim that has the file exclusively, about to remove it: a claim
    # that opened the old file meanwhile must end up holding a new one.
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        claimer = threading.Thread(target=lambda: claims.append(claim_region(path, 4096)))
        claimer.start()
        time.sleep(0.2)
        os.unlink(path)
    finally:
        os.close(fd)
    claimer.join(WAIT_S)
    try:
        assert len(claims) == 1
        with claims[0] as claim:
            assert claim.created
            st = os.stat(path)
            assert (st.st_ino != os.fstat(old).st_ino, st.st_size) == (True, 4096)
            assert _claimed(path)
    finally:
        os.close(old)


@pytest.fixture
def sticky_dir() -> Iterator[str]:
    """A world-writable sticky directory, like /dev/shm, that user nobody
    can reach (pytest's tmp_path is private to root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: makes a file of another user")
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user nobody")
    d = tempfile.mkdtemp(prefix="nvmetier-shm-")
    os.chmod(d, 0o1777)
    try:
        yield d
    finally:
        shutil.rmtree(d)


@pytest.mark.parametrize("mode", [0o600, 0o644], ids=["unreadable", "readable"])
def test_a_stale_region_of_another_user_is_left_with_one_warning_naming_its_owner(
    sticky_dir, mode: int
) -> None:
    path = region_path(f"root-{uuid.uuid4().hex[:8]}", sticky_dir)
    with open(path, "wb") as f:
        f.truncate(1 << 20)
    os.chmod(path, mode)
    os.utime(path, (OLD, OLD))
    nobody = pwd.getpwnam("nobody")
    done = subprocess.run(
        [sys.executable, "-c", RECLAIM, sticky_dir, f"{nobody.pw_uid}:{nobody.pw_gid}"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=WAIT_S,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []
    assert os.path.exists(path)
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, done.stderr
    assert path in warnings[0] and "user root (uid 0)" in warnings[0]
    assert f"rm {path}" in warnings[0]


@pytest.fixture
def _cpu_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    # What vLLM's CPU platform gives the worker in a CPU server.
    from vllm.platforms.cpu import CpuPlatform

    monkeypatch.setattr(gpu_worker, "PIN_MEMORY", False)
    monkeypatch.setattr(gpu_worker, "current_platform", CpuPlatform())


def _cpu_kv_caches() -> CanonicalKVCaches:
    layers = [torch.zeros((8, PAGE), dtype=torch.int8) for _ in range(2)]
    return CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=PAGE) for t in layers],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=PAGE) for i in (0, 1)]],
    )


@pytest.fixture
def cpu_spec(_cpu_platform) -> Iterator[CpuTieringOffloadingSpec]:
    spec = CpuTieringOffloadingSpec(make_config([], chunk_bytes=2 * PAGE, cpu_chunks=4))
    yield spec
    with contextlib.suppress(FileNotFoundError):
        os.unlink(region_path(spec.config.engine_id))


def test_a_cpu_worker_holds_a_claim_on_the_region_vllm_maps(cpu_spec) -> None:
    cpu_spec.get_worker(_cpu_kv_caches())
    path = region_path(cpu_spec.config.engine_id)
    assert os.stat(path).st_size == 4 * 2 * PAGE
    assert _claimed(path)


def test_the_scheduler_unlinks_the_region_once_it_mapped_it(cpu_spec) -> None:
    cpu_spec.get_worker(_cpu_kv_caches())
    cpu_spec.get_manager()
    assert not os.path.exists(region_path(cpu_spec.config.engine_id))


def test_a_scheduler_whose_workers_region_is_missing_refuses_to_start(cpu_spec) -> None:
    path = region_path(cpu_spec.config.engine_id)
    with pytest.raises(RuntimeError, match="Restart the server"):
        cpu_spec.get_manager()
    assert not os.path.exists(path)  # and made no empty region of its own


def test_vllms_region_joins_the_file_a_claim_made_and_maps_its_bytes() -> None:
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    engine_id = f"nvmetier-test-{uuid.uuid4().hex[:12]}"
    path = region_path(engine_id)
    try:
        with claim_region(path, 4 * PAGE) as claim:
            assert claim.created
            with open(path, "r+b") as f:
                f.seek(PAGE)
                f.write(b"\x5a" * PAGE)
            region = SharedOffloadRegion(
                engine_id=engine_id,
                num_chunks=4,
                rank=None,
                kv_bytes_per_chunk=PAGE,
                cpu_page_size=PAGE,
            )
            try:
                assert region.mmap_path == path
                view = region.create_kv_memoryview()
                row = view.tobytes()[PAGE : 2 * PAGE]
                view.release()
            finally:
                region.cleanup()
            assert row == b"\x5a" * PAGE
            assert os.path.exists(path)  # vLLM joined it: its cleanup leaves it to us
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
