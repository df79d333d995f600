"""Fixtures for tests through vLLM's real tiering orchestrator."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from nvmetier.vllm.harness import SimulatedEngine, make_config


def new_key(tmp_path: Any, name: str = "key") -> str:
    """A fresh key file (32 random bytes, mode 0600) for a sealed tier's
    ``encryption: {key_file: ...}``; its path."""
    path = tmp_path / name
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return str(path)


def nvme_tier(root: Any, **kw: Any) -> dict[str, Any]:
    tier: dict[str, Any] = {
        "type": "NvmeTierManager",
        "module_path": "nvmetier.vllm",
        "root_dir": root,
        "capacity_bytes": "32MiB",
    }
    tier.update(kw)
    return tier


@pytest.fixture
def make_engine(tmp_path) -> Iterator[Callable[..., SimulatedEngine]]:
    """Build SimulatedEngines (shut down at teardown)."""
    engines: list[SimulatedEngine] = []

    def build(tiers: list[dict[str, Any]] | None = None, **kw: Any) -> SimulatedEngine:
        if tiers is None:
            tiers = [nvme_tier(str(tmp_path / "kv"))]
        kw.setdefault("chunk_bytes", 64 << 10)
        kw.setdefault("cpu_chunks", 32)
        eng = SimulatedEngine(make_config(tiers, **kw))
        engines.append(eng)
        return eng

    yield build
    for eng in engines:
        if hasattr(eng, "rows"):
            eng.shutdown()
