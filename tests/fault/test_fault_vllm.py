"""Injected read errors under vLLM's real tiering orchestrator.

A failed load must turn later lookups of that key into MISS; otherwise the
orchestrator promotes it again every step, forever (vLLM #49176).
"""

from __future__ import annotations

import errno
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from vllm.v1.kv_offload.base import LookupResult

from nvmetier.engine import OP_READ
from nvmetier.vllm.harness import SimulatedEngine, key_of, make_config
from tests.fault.faultkit import FaultyEngine

pytestmark = pytest.mark.timeout(120)

KEYS = [key_of(i) for i in range(12)]
BAD = KEYS[5]


@pytest.fixture
def engine(tmp_path, monkeypatch) -> Iterator[tuple[SimulatedEngine, list[FaultyEngine]]]:
    faulty: list[FaultyEngine] = []

    def wrap(inner):
        faulty.append(FaultyEngine(inner))
        return faulty[-1]

    monkeypatch.setattr("nvmetier.vllm.ENGINE_WRAPPER", wrap)
    tier = {
        "type": "NvmeTierManager",
        "module_path": "nvmetier.vllm",
        "root_dir": str(tmp_path / "kv"),
        "capacity_bytes": "32MiB",
    }
    eng = SimulatedEngine(make_config([tier], chunk_bytes=64 << 10, cpu_chunks=32))
    eng.store_all(KEYS)
    eng.reset_primary()
    yield eng, faulty
    eng.shutdown()


def test_failed_load_under_the_orchestrator_is_a_miss_not_a_livelock(engine) -> None:
    eng, faulty = engine
    faulty[0].fail(OP_READ, errno.EIO, [BAD])
    results = eng.promote(KEYS, timeout_s=30)
    assert results[BAD] is LookupResult.MISS
    assert all(results[k] is LookupResult.HIT for k in KEYS if k != BAD)
    assert eng.verify([k for k in KEYS if k != BAD]) == len(KEYS) - 1


def test_key_whose_load_failed_stays_a_miss_when_the_disk_recovers(engine) -> None:
    eng, faulty = engine
    faulty[0].fail(OP_READ, errno.EIO, [BAD])
    eng.promote([BAD], timeout_s=30)
    faulty[0].clear()
    eng.reset_primary()
    assert eng.promote([BAD], timeout_s=30) == {BAD: LookupResult.MISS}
    assert faulty[0].injected == 1  # looked up, never loaded again
