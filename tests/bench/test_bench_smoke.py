"""Smoke tests of ``nvmetier bench``: tiny runs at the engine and tier levels.

They check behaviour (the JSON report's shape, bytes moved, no errors), never
timings. Real files in ``tmp_path``; each run takes well under a second.
"""

from __future__ import annotations

import json

import pytest

from nvmetier import bench

PHASE_KEYS = {
    "level",
    "target",
    "phase",
    "bs",
    "bytes",
    "runtime_s",
    "iops",
    "bw_bytes",
    "bw_gbps",
    "clat_ns",
    "cpu",
    "errors",
}


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    rc = bench.main([*argv, "--output-format", "json"])
    out = capsys.readouterr().out
    assert rc == 0
    return json.loads(out)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("level", ["engine", "tier"])
def test_json_report_has_a_write_and_a_read_phase_with_positive_bandwidth(
    level: str, tmp_path, capsys
) -> None:
    report = _run(
        capsys,
        "--level",
        level,
        "--rw",
        "rw",
        "--bs",
        "64k",
        "--size",
        "2m",
        "--iodepth",
        "4",
        "--dir",
        str(tmp_path),
        "--no-drop-caches",
    )
    assert report["level"] == level
    results = report["results"]
    assert [r["phase"] for r in results] == ["write", "read"]
    for r in results:
        assert r.keys() >= PHASE_KEYS
        assert r["target"] == "nvmetier-threads"
        assert r["bs"] == 64 << 10
        assert r["bytes"] == 2 << 20
        assert r["bw_bytes"] > 0 and r["iops"] > 0
        assert r["errors"] == 0
        assert {"p50", "p90", "p99", "p99.9"} <= r["clat_ns"].keys()
        assert {"usr_s_per_gb", "sys_s_per_gb"} <= r["cpu"].keys()
    assert {row["phase"] for row in report["summary"]} == {"write", "read"}


@pytest.mark.timeout(60)
def test_tier_level_loads_back_the_bytes_it_stored(tmp_path, capsys) -> None:
    report = _run(
        capsys,
        "--level",
        "tier",
        "--rw",
        "randread",
        "--bs",
        "64k",
        "--size",
        "1m",
        "--iodepth",
        "2",
        "--job-chunks",
        "2",
        "--dir",
        str(tmp_path),
        "--no-drop-caches",
    )
    (read,) = report["results"]
    assert read["phase"] == "read"
    assert read["extra"]["wrong_bytes_loaded"] == 0
    assert read["extra"]["store_stats"]["checksum_failures"] == 0


@pytest.mark.timeout(60)
def test_leaves_no_files_behind_without_keep(tmp_path, capsys) -> None:
    _run(
        capsys,
        "--level",
        "engine",
        "--rw",
        "write",
        "--bs",
        "64k,128k",
        "--size",
        "1m",
        "--iodepth",
        "2",
        "--dir",
        str(tmp_path),
        "--no-drop-caches",
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(60)
def test_unusable_uring_engine_is_skipped_with_a_note(tmp_path, capsys, monkeypatch) -> None:
    import nvmetier.engine

    monkeypatch.setattr(nvmetier.engine, "uring_status", lambda: (False, "not here"))
    report = _run(
        capsys,
        "--level",
        "engine",
        "--rw",
        "write",
        "--bs",
        "64k",
        "--size",
        "1m",
        "--iodepth",
        "2",
        "--engine",
        "threads,uring",
        "--dir",
        str(tmp_path),
        "--no-drop-caches",
    )
    assert {r["target"] for r in report["results"]} == {"nvmetier-threads"}
    assert any("uring" in n and "not here" in n for n in report["notes"])


def test_bad_block_size_is_a_usage_error(tmp_path) -> None:
    assert bench.main(["--bs", "1000", "--dir", str(tmp_path)]) == 2
