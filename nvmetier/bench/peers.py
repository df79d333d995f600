"""Peers beside the tier: LMCache 0.5.6's disk backends in their own environment.

Owns: ``LMCACHE_BACKENDS``, ``lmcache_env_path`` (where the environment
lives), ``setup_lmcache`` (builds it: CPU torch 2.13.0, ``lmcache==0.5.6
--no-deps`` and its dependencies by hand minus the three CUDA packages, the
Rust ``raw_block`` wheel; never in the product's environment), ``run_peer``
(one backend at one chunk size through ``lmcache_driver.py`` in a
subprocess of that environment) and ``rotation`` (the order of the targets in
each round of an alternated run). Runs on the bench's calling thread; every
subprocess wait is bounded by a timeout.

``python -m nvmetier.bench.peers setup [VENV]`` builds the environment alone
(``tools/peers/setup_lmcache.sh`` calls it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from nvmetier.bench.report import PhaseResult

LMCACHE_VERSION = "0.5.6"
RAW_BLOCK_WHEEL = "lmcache-rust-raw-block-io==0.5.7rc2"
TORCH_CPU = "torch==2.13.0"
# LMCache 0.5.6's Requires-Dist, less cufile-python, cupy-cuda13x and
# cuda-python (GPU code the disk backends never call, and CUDA packages this
# project never installs).
LMCACHE_DEPS = (
    "aiofile",
    "aiofiles",
    "blake3",
    "aiohttp",
    "awscrt",
    "cryptography",
    "fastapi",
    "httpx",
    "huggingface_hub>=1.5.0",
    "msgspec",
    "numpy<=2.2.6",
    "numba",
    "nvtx",
    "opentelemetry-api<=1.40.0,>=1.20.0",
    "opentelemetry-sdk>=1.20.0",
    "opentelemetry-exporter-otlp>=1.20.0",
    "opentelemetry-exporter-prometheus<=0.61b0,>=0.50b0",
    "prometheus_client<=0.24.1,>=0.18.0",
    "psutil",
    "py-cpuinfo",
    "pytest",
    "pyyaml",
    "pyzmq>=25.0.0",
    "grpcio>=1.78.0",
    "grpcio-observability==1.78.0",
    "protobuf<7,>=6.31.1",
    "redis",
    "safetensors",
    "setuptools<81.0.0,>=77.0.3",
    "setuptools_scm>=8",
    "sortedcontainers",
    "transformers>=5.4",
    "uvicorn",
    "httptools",
    "cachetools",
    "google-api-core",
    "google-cloud-bigtable",
)
# Targets: the adapter type, and raw_block's I/O engine.
LMCACHE_BACKENDS = ("fs_native", "raw_block-io_uring", "raw_block-posix", "fs")
DEFAULT_BACKENDS = ("fs_native", "raw_block-io_uring", "fs")
STAMP = f".nvmetier-peers-lmcache-{LMCACHE_VERSION}"
SETUP_TIMEOUT_S = 1800.0
DRIVER = Path(__file__).with_name("lmcache_driver.py")

T = TypeVar("T")


class PeerError(RuntimeError):
    """A peer could not be set up or run; the message says which step and why."""


def rotation(targets: Sequence[T], round_idx: int) -> list[T]:
    """The targets in round ``round_idx``'s order: rotated left by the round.

    Each target runs first in one round out of ``len(targets)``, so no target
    always follows the same neighbour (a peer's writes still in the drive's
    cache, memory it fragmented) or always runs on a cold machine.
    """
    if not targets:
        return []
    k = round_idx % len(targets)
    return list(targets[k:]) + list(targets[:k])


def lmcache_env_path() -> Path:
    """Where LMCache's environment lives: ``$NVMETIER_PEERS_LMCACHE_ENV``, else
    ``.venv-lmcache`` beside this source tree (a checkout), else under
    ``~/.cache/nvmetier``."""
    env = os.environ.get("NVMETIER_PEERS_LMCACHE_ENV")
    if env:
        return Path(env)
    tree = Path(__file__).resolve().parents[2]
    if (tree / "pyproject.toml").exists() and os.access(tree, os.W_OK):
        return tree / ".venv-lmcache"
    return Path.home() / ".cache" / "nvmetier" / "venv-lmcache"


def _python311() -> str | None:
    """A Python 3.11 interpreter for the environment (LMCache's wheels are cp311)."""
    forced = os.environ.get("NVMETIER_PEERS_PYTHON")
    if forced:
        return forced
    base = getattr(sys, "_base_executable", sys.executable)
    if sys.version_info[:2] == (3, 11):
        return base
    for name in ("python3.11",):
        for d in os.environ.get("PATH", "").split(os.pathsep):
            cand = os.path.join(d, name)
            if os.access(cand, os.X_OK):
                return cand
    return None


def _step(cmd: list[str], what: str, log: Callable[[str], None], timeout_s: float) -> None:
    log(f"peers: {what}")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise PeerError(f"{what}: timed out after {timeout_s:.0f}s") from exc
    except OSError as exc:
        raise PeerError(f"{what}: {exc}") from exc
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise PeerError(f"{what}: exit {done.returncode}: " + " | ".join(tail))


def setup_lmcache(env: Path, log: Callable[[str], None]) -> Path:
    """Build LMCache's environment at ``env`` (a no-op once its stamp exists).

    Returns the environment's python. Raises ``PeerError`` naming the step
    that failed (no Python 3.11, no network to the registry, a wheel missing
    for this platform, ...).
    """
    py = env / "bin" / "python"
    if (env / STAMP).exists() and py.exists():
        return py
    base = _python311()
    if base is None:
        raise PeerError(
            "no Python 3.11 interpreter (LMCache 0.5.6 ships cp311 wheels); "
            "set NVMETIER_PEERS_PYTHON to one"
        )
    t = SETUP_TIMEOUT_S
    _step([base, "-m", "venv", str(env)], f"python -m venv {env}", log, t)
    pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    cons = env / "nvmetier-constraints.txt"
    cons.write_text(TORCH_CPU + "\n")
    # torch alone first: where a local +cpu wheel is offered, torch==2.13.0
    # takes it; the constraint keeps every later step from swapping in another
    # (a CUDA) build.
    _step([*pip, TORCH_CPU], f"pip install {TORCH_CPU} (CPU build)", log, t)
    _step(
        [str(py), "-c", "import sys, torch; sys.exit(torch.version.cuda is not None)"],
        "check torch is a CPU build",
        log,
        t,
    )
    _step(
        [*pip, "--no-deps", f"lmcache=={LMCACHE_VERSION}"],
        f"pip install --no-deps lmcache=={LMCACHE_VERSION}",
        log,
        t,
    )
    _step([*pip, "-c", str(cons), *LMCACHE_DEPS], "pip install lmcache's dependencies", log, t)
    _step([*pip, "--no-deps", RAW_BLOCK_WHEEL], f"pip install --no-deps {RAW_BLOCK_WHEEL}", log, t)
    _step([str(py), "-c", "import lmcache, torch"], "import lmcache", log, t)
    (env / STAMP).touch()
    return py


def run_peer(
    py: Path,
    backend: str,
    args: argparse.Namespace,
    bs: int,
    log: Callable[[str], None],
    timeout_s: float = 900.0,
) -> list[PhaseResult]:
    """Store then load ``args.size`` bytes in ``bs`` chunks through one LMCache
    backend (``LMCACHE_BACKENDS``), in ``args.dir``; the write and read
    PhaseResults (target ``lmcache-<backend>``). Raises ``PeerError``."""
    kind, _, engine = backend.partition("-")
    cmd = [
        str(py),
        "-P",
        str(DRIVER),
        "--backend",
        kind,
        "--dir",
        args.dir,
        "--bs",
        str(bs),
        "--size",
        str(args.size),
        "--iodepth",
        str(args.iodepth),
    ]
    if engine:
        cmd += ["--raw-block-engine", engine]
    if not args.no_drop_caches:
        cmd.append("--drop-caches")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise PeerError(f"lmcache {backend}: timed out after {timeout_s:.0f}s") from exc
    lines = [ln for ln in done.stdout.strip().splitlines() if ln.startswith("{")]
    try:
        out: dict[str, Any] = json.loads(lines[-1])
    except (IndexError, ValueError) as exc:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise PeerError(f"lmcache {backend}: exit {done.returncode}, no result: {tail}") from exc
    if "error" in out or done.returncode != 0:
        raise PeerError(f"lmcache {backend}: exit {done.returncode}: {out.get('error')}")
    results = []
    for phase in ("write", "read"):
        ph = out["phases"][phase]
        results.append(
            PhaseResult(
                level="tier",
                target=f"lmcache-{backend}",
                phase=phase,
                bs=bs,
                bytes=int(ph["bytes"]),
                runtime_s=float(ph["seconds"]),
                ops=int(ph["bytes"]) // bs,
                clat_ns={},
                cpu_usr_s=float(ph["cpu_usr_s"]),
                cpu_sys_s=float(ph["cpu_sys_s"]),
                errors=int(ph["failed"]),
                extra={
                    "iodepth": args.iodepth,
                    "wrong_bytes_loaded": int(ph["wrong_chunks"]),
                    "buffer_huge_page_share": out.get("buffer_huge_page_share"),
                    "checksums": "none",
                },
            )
        )
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nvmetier.bench.peers")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("setup", help="build LMCache's own environment")
    s.add_argument("venv", nargs="?", default=None)
    a = p.parse_args(argv)
    env = Path(a.venv) if a.venv else lmcache_env_path()
    try:
        setup_lmcache(env, lambda m: print(m, flush=True))
    except PeerError as exc:
        print(f"setup_lmcache: LMCache cannot be installed: {exc}", file=sys.stderr)
        return 3
    print(f"setup_lmcache: ready ({env})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
