"""``staging: auto`` decided by a probe: the store measures both modes on its
own drives with its own engine at creation, keeps the result beside its
superblock, reuses it on reopen, shows it in ``nvmetier info``, never writes
its data files for it, and falls back to the page-size rule when the probe
cannot run. Also ``choose``'s rule on figures given (about 2 s: one probe per
engine on the test disk)."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from typing import Any

import pytest

from nvmetier import budget as root_budget
from nvmetier import staging_probe
from nvmetier.bench.tier import vllm_like_primary
from nvmetier.config import TierConfig
from nvmetier.engine import uring_status
from nvmetier.info import format_info, info
from nvmetier.store import BlockStore
from nvmetier.store_dir import probe_o_direct

ROW = 256 << 10
ROWS = 8
_URING_OK, _URING_WHY = uring_status()
ENGINES = [
    "threads",
    pytest.param(
        "uring", marks=pytest.mark.skipif(not _URING_OK, reason=f"io_uring: {_URING_WHY}")
    ),
]


@pytest.fixture(autouse=True)
def _fresh_memo() -> Iterator[None]:
    """Each test probes for itself (the process-wide memo is emptied)."""
    staging_probe._MEMO.clear()
    yield
    staging_probe._MEMO.clear()


@pytest.fixture
def shm_region() -> Iterator[mmap.mmap]:
    region = vllm_like_primary(ROWS * ROW, tag="test")
    yield region
    region.close()


def _open(root: str, region: mmap.mmap, engine: str, **over: Any) -> BlockStore:
    raw: dict[str, Any] = {"root_dir": root, "capacity_bytes": 16 << 20, "persist": True}
    raw.update(over)
    return BlockStore(
        TierConfig.from_dict(raw),
        store_name="t",
        identity={"t": 1},
        buffer=memoryview(region),
        row_bytes=ROW,
        engine=engine,
    )


def _needs_o_direct(path: str) -> None:
    ok, why = probe_o_direct(path)
    if not ok:
        pytest.skip(f"O_DIRECT unavailable in {path}: {why}")


def _fig(read: float, write: float, cpu: float) -> dict[str, float]:
    return {"read_gbps": read, "write_gbps": write, "cpu_s_per_gb": cpu, "gbps": 0.0}


def test_choose_prefers_bandwidth_either_way_then_cpu() -> None:
    # A virtio disk: staging loads much faster, stores as fast, at more CPU.
    stage, why = staging_probe.choose(_fig(2.0, 1.5, 0.2), _fig(1.1, 1.5, 0.12))
    assert stage and why.startswith("staging on: it moves more bytes")
    # Loop drives: unstaged is faster both ways.
    stage, why = staging_probe.choose(_fig(1.7, 1.7, 0.2), _fig(2.6, 2.9, 0.1))
    assert not stage and why.startswith("staging off: it moves more bytes")
    # Faster one way, slower the other: bandwidth does not decide, CPU does.
    stage, why = staging_probe.choose(_fig(2.0, 1.0, 0.2), _fig(1.0, 2.0, 0.1))
    assert not stage and "fewer CPU seconds per GB" in why
    # Within the margin both ways: the fewer CPU seconds per GB wins.
    stage, why = staging_probe.choose(_fig(2.1, 2.0, 0.19), _fig(2.0, 2.0, 0.12))
    assert not stage and "fewer CPU seconds per GB" in why and "0.120" in why
    stage, _ = staging_probe.choose(_fig(2.0, 2.0, 0.1), _fig(2.1, 2.0, 0.19))
    assert stage
    # A ring-bound virtio disk stages whatever a burst showed.
    for off in (_fig(2.0, 2.0, 0.12), _fig(2.6, 2.6, 0.12)):
        stage, why = staging_probe.choose(_fig(2.0, 2.0, 0.19), off, "vda")
        assert stage and "vda is virtio-blk without indirect descriptors" in why


def test_ring_bound_drive_is_none_for_tmpfs() -> None:
    assert staging_probe.ring_bound_drive(["/dev/shm"]) is None


@pytest.mark.parametrize("name", ENGINES)
def test_store_probes_at_creation_keeps_it_and_reuses_it_on_reopen(
    name: str, shm_region: mmap.mmap, tmp_path, monkeypatch
) -> None:
    root = str(tmp_path)
    _needs_o_direct(root)
    store = _open(root, shm_region, name)
    try:
        d = store.describe()
        probed = d["staging_probe"]
        assert probed is not None and probed["staging"] in ("on", "off")
        assert d["staging"] is (probed["staging"] == "on")
        assert probed["chunk_bytes"] == ROW and probed["drives"] == 1
        for mode in ("on", "off"):
            assert probed[mode]["read_gbps"] > 0 and probed[mode]["write_gbps"] > 0
            assert probed[mode]["cpu_s_per_gb"] > 0
        assert d["staging_reason"].startswith(f"staging {probed['staging']}: ")
        assert "probed" in d["staging_reason"]
        store_dir = store.files.dirs[0]
        # The probe's scratch files are gone; only the store's files remain.
        assert not [n for n in os.listdir(store_dir) if n.startswith(".staging-probe")]
        assert staging_probe.load(store_dir)[name]["why"] == probed["why"]
    finally:
        store.close()

    # Reopen: the kept result, no second probe.
    def no_probe(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("probed again on reopen")

    monkeypatch.setattr(staging_probe, "probe", no_probe)
    store = _open(root, shm_region, name)
    try:
        d = store.describe()
        assert d["staging_probe"]["measured_at"] == probed["measured_at"]
        assert "kept with the store]" in d["staging_reason"]
    finally:
        store.close()

    report = info(root)
    (s,) = report["stores"]
    assert s["staging"][name]["staging"] == probed["staging"]
    text = format_info(report)
    assert f"staging ({name}): {probed['staging']} with staging: auto" in text


def test_probe_failure_keeps_the_page_size_rule(
    shm_region: mmap.mmap, tmp_path, monkeypatch, caplog
) -> None:
    root = str(tmp_path)
    _needs_o_direct(root)

    def broken(*_a: Any, **_k: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(staging_probe, "probe", broken)
    store = _open(root, shm_region, "threads")
    try:
        d = store.describe()
        assert d["staging"] is True  # a 4 KiB-page primary: the page-size rule stages
        assert "the staging probe could not run" in d["staging_reason"]
        assert "No space left" in d["staging_reason"]
        assert d["staging_probe"] is None
        assert staging_probe.load(store.files.dirs[0]) == {}
    finally:
        store.close()


@pytest.mark.parametrize("mode", ["on", "off"])
def test_explicit_staging_never_probes(
    mode: str, shm_region: mmap.mmap, tmp_path, monkeypatch
) -> None:
    def no_probe(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("probed with staging set")

    monkeypatch.setattr(staging_probe, "probe", no_probe)
    store = _open(str(tmp_path), shm_region, "threads", staging=mode)
    try:
        assert store.describe()["staging"] is (mode == "on")
        assert store.describe()["staging_probe"] is None
    finally:
        store.close()


def test_a_second_store_on_the_same_drive_reuses_this_process_probe(
    shm_region: mmap.mmap, tmp_path, monkeypatch
) -> None:
    _needs_o_direct(str(tmp_path))
    first = _open(str(tmp_path / "a"), shm_region, "threads")
    probed = first.describe()["staging_probe"]
    first.close()

    def no_probe(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("probed the same drive twice")

    monkeypatch.setattr(staging_probe, "probe", no_probe)
    second = _open(str(tmp_path / "b"), shm_region, "threads")
    try:
        assert second.describe()["staging_probe"] == probed
        # ... and it is kept with that store too.
        assert staging_probe.load(second.files.dirs[0])["threads"] == probed
    finally:
        second.close()


def test_the_probe_never_touches_the_primary(tmp_path) -> None:
    """The probe moves its own scratch memory: a primary vLLM may already
    have filled (a store reopened at the first data-path call) keeps its
    bytes."""
    _needs_o_direct(str(tmp_path))
    region = vllm_like_primary(32 << 20, tag="test-probe")
    try:
        pattern = os.urandom(1 << 20)
        for off in range(0, len(region), len(pattern)):
            region[off : off + len(pattern)] = pattern
        store = _open(str(tmp_path), region, "threads")
        try:
            assert store.describe()["staging_probe"] is not None
        finally:
            store.close()
        assert all(
            region[off : off + len(pattern)] == pattern
            for off in range(0, len(region), len(pattern))
        )
    finally:
        region.close()


def test_the_probe_stays_inside_the_root_budget(
    shm_region: mmap.mmap, tmp_path, monkeypatch
) -> None:
    """A budget with room for the store but not for the probe's scratch
    files: no probe runs (its transient files would pass the budget an
    emptyDir's sizeLimit is set from), the page-size rule stands and says
    why, and the root's charges stay within the budget."""
    sizing = str(tmp_path / "sizing")
    root = str(tmp_path / "budgeted")
    os.makedirs(sizing)
    os.makedirs(root)
    _needs_o_direct(root)
    # The store's own charge, from a store of the same config elsewhere.
    _open(sizing, shm_region, "threads").close()
    charge = sum(s.charge_bytes for s in root_budget.root_shares(sizing))
    budget_bytes = charge + staging_probe.probe_file_bytes(1, ROW) // 2
    staging_probe._MEMO.clear()
    calls: list[int] = []
    real = staging_probe.probe
    monkeypatch.setattr(staging_probe, "probe", lambda *a, **k: calls.append(1) or real(*a, **k))
    store = _open(root, shm_region, "threads", root_budget_bytes=budget_bytes)
    try:
        d = store.describe()
        assert d["staging"] is True  # a 4 KiB-page primary: the page-size rule
        assert "do not fit the root budget" in d["staging_reason"]
        assert calls == []
        assert sum(s.charge_bytes for s in root_budget.root_shares(root)) <= budget_bytes
    finally:
        store.close()
