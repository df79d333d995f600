"""``nvmetier fsck`` and ``nvmetier info`` on a store written through vLLM's
real tiering orchestrator (the harness's simulated engine)."""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from vllm.v1.kv_offload.base import LookupResult

from nvmetier.files import DATA_NAME
from nvmetier.vllm.harness import SimulatedEngine, key_of, make_config
from tests.cli.clikit import assert_one_line_error, run_cli, run_json
from tests.fault.faultkit import flip_bit, live_records, read_superblock

pytestmark = pytest.mark.timeout(120)

N_KEYS = 40
CHUNK = 64 << 10
MODEL = "org/cli-model"


def _tier(root: str) -> dict[str, Any]:
    return {
        "type": "NvmeTierManager",
        "module_path": "nvmetier.vllm",
        "root_dir": root,
        "capacity_bytes": "32MiB",
    }


def _engine(root: str) -> SimulatedEngine:
    config = make_config([_tier(root)], chunk_bytes=CHUNK, cpu_chunks=32, model=MODEL)
    return SimulatedEngine(config)


@pytest.fixture(scope="module")
def vllm_root(tmp_path_factory) -> str:
    """A root_dir holding one store written through the orchestrator, shut down."""
    root = str(tmp_path_factory.mktemp("cli-vllm") / "kv")
    eng = _engine(root)
    eng.store_all([key_of(i) for i in range(N_KEYS)])
    eng.shutdown()
    return root


@pytest.fixture
def root_copy(vllm_root, tmp_path) -> str:
    """A private copy of the vLLM-written root, for tests that change it."""
    dst = str(tmp_path / "kv")
    shutil.copytree(vllm_root, dst)
    return dst


def _store(root: str) -> str:
    (name,) = os.listdir(root)
    return os.path.join(root, name)


def test_fsck_of_a_vllm_written_root_is_clean(vllm_root) -> None:
    proc = run_cli("fsck", vllm_root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{N_KEYS} live" in proc.stdout
    assert "result:  clean" in proc.stdout


def test_fsck_deep_json_verifies_every_chunk_vllm_stored(vllm_root) -> None:
    code, out = run_json("fsck", "--deep", vllm_root)
    assert code == 0 and out["exit_code"] == 0
    (s,) = out["stores"]
    assert s["path"] == _store(vllm_root)
    assert s["live"] == N_KEYS and s["deep_checked"] == N_KEYS and s["errors"] == []
    assert s["identity"]["model_name"] == MODEL and s["identity"]["chunk_bytes"] == CHUNK
    assert s["clean_shutdown"] is True


def test_info_json_counts_what_vllm_stored(vllm_root) -> None:
    code, out = run_json("info", vllm_root)
    assert code == 0
    (s,) = out["stores"]
    assert s["slots_used"] == N_KEYS and s["bytes_used"] == N_KEYS * s["slot_bytes"]
    assert sum(s["ages"].values()) == N_KEYS
    assert s["oldest_ns"] <= s["newest_ns"]
    assert s["identity"]["model_name"] == MODEL
    assert s["clean_shutdown"] is True


def test_info_text_names_the_layout_and_the_engines(vllm_root) -> None:
    proc = run_cli("info", vllm_root)
    assert proc.returncode == 0, proc.stderr
    for needle in (f"model_name={MODEL}", "io_uring engine:", "O_DIRECT:", "clean shutdown:  yes"):
        assert needle in proc.stdout


def test_fsck_of_a_root_in_use_by_vllm_checks_live_and_refuses_repair(root_copy) -> None:
    eng = _engine(root_copy)
    try:
        proc = run_cli("fsck", root_copy)
        repair = run_cli("fsck", "--repair", root_copy)
        info = run_cli("info", root_copy)
    finally:
        eng.shutdown()
    assert proc.returncode == 0 and f"pid {os.getpid()}" in proc.stdout
    assert repair.returncode == 8
    assert_one_line_error(repair)
    assert f"pid {os.getpid()}" in repair.stderr
    assert info.returncode == 0 and f"in use:          yes, by pid {os.getpid()}" in info.stdout


def test_repaired_vllm_store_serves_every_other_chunk(root_copy) -> None:
    sdir = _store(root_copy)
    sb = read_superblock(sdir)
    rec = live_records(sdir)[0]
    flip_bit(os.path.join(sdir, DATA_NAME), sb.slot_location(rec.slot)[1] + 100, 2)
    assert run_cli("fsck", "--deep", root_copy).returncode == 4
    assert run_cli("fsck", "--deep", "--repair", root_copy).returncode == 1
    assert run_cli("fsck", "--deep", root_copy).returncode == 0
    eng = _engine(root_copy)
    try:
        keys = [key_of(i) for i in range(N_KEYS)]
        results: dict[bytes, LookupResult] = {}
        verified = 0
        for i in range(0, N_KEYS, 16):  # the primary holds 32 chunks
            part = keys[i : i + 16]
            # No key positions: every chunk is asked about on its own (with
            # them, a walk stops at the repaired chunk, as vLLM's does).
            results.update(eng.promote(part, positions=False))
            verified += eng.verify([k for k in part if results[k] is LookupResult.HIT])
            eng.reset_primary()
        assert rec.key in keys and results[rec.key] is LookupResult.MISS
        assert all(results[k] is LookupResult.HIT for k in keys if k != rec.key)
        assert verified == N_KEYS - 1
    finally:
        eng.shutdown()
