"""``nvmetier bench --peers lmcache`` and ``--rounds``: options, order, failures.

Behaviour only, never timings. The real LMCache runs need its environment
(``tools/peers/setup_lmcache.sh``, minutes and a package registry): they are
skipped where it is not built, and marked slow.
"""

from __future__ import annotations

import json
import os

import pytest

from nvmetier import bench
from nvmetier.bench import peers
from nvmetier.bench.report import PhaseResult, median_summary


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict | None, str]:
    rc = bench.main([*argv, "--output-format", "json"])
    cap = capsys.readouterr()
    return rc, (json.loads(cap.out) if rc == 0 else None), cap.err


def test_rotation_puts_each_target_first_once_per_cycle() -> None:
    t = ["a", "b", "c"]
    orders = [peers.rotation(t, r) for r in range(4)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert peers.rotation([], 3) == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--peers", "lmcache", "--level", "engine"], "--level tier only"),
        (["--peers", "lmcache", "--peer-backends", "fs_native,nfs"], "--peer-backends"),
        (["--peers", "redis"], None),  # argparse: not a choice
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--staging", "sometimes"], "use auto, on or off"),
    ],
)
def test_bad_peer_round_and_staging_options_are_usage_errors(
    argv: list[str], message: str | None, tmp_path, capsys
) -> None:
    try:
        rc = bench.main([*argv, "--dir", str(tmp_path), "--size", "1m", "--bs", "64k"])
    except SystemExit as exc:  # argparse
        rc = int(exc.code or 0)
    err = capsys.readouterr().err
    assert rc == 2
    if message:
        assert message in err


def test_lmcache_that_cannot_be_installed_exits_3_naming_the_step(
    tmp_path, capsys, monkeypatch
) -> None:
    monkeypatch.setenv("NVMETIER_PEERS_LMCACHE_ENV", str(tmp_path / "env"))
    monkeypatch.setenv("NVMETIER_PEERS_PYTHON", str(tmp_path / "no-such-python3.11"))
    rc, report, err = _json(
        capsys, "--peers", "lmcache", "--dir", str(tmp_path / "d"), "--size", "1m", "--bs", "64k"
    )
    assert rc == 3 and report is None
    assert "LMCache cannot be installed" in err
    assert "python -m venv" in err  # the step that failed


@pytest.mark.timeout(120)
def test_rounds_alternate_targets_in_rotated_order_and_report_medians(tmp_path, capsys) -> None:
    rc, report, _ = _json(
        capsys,
        "--level",
        "tier",
        "--engine",
        "threads",
        "--staging",
        "on,off",
        "--rounds",
        "3",
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
    assert rc == 0 and report is not None
    orders = [r["order"] for r in report["rounds"]]
    first = ["nvmetier-threads-staging-on", "nvmetier-threads-staging-off"]
    assert orders == [first, first[::-1], first]
    assert all(r["loadavg"] and r["utc"] for r in report["rounds"])
    rounds = sorted(
        (r["extra"]["round"], r["target"]) for r in report["results"] if r["phase"] == "read"
    )
    assert [k for k, _ in rounds] == [0, 0, 1, 1, 2, 2]
    med = {(m["target"], m["phase"]): m for m in report["medians"]}
    on = med[("nvmetier-threads-staging-on", "read")]
    assert on["rounds"] == 3 and on["gbps_min"] <= on["gbps_median"] <= on["gbps_max"]
    assert all(r["errors"] == 0 for r in report["results"])
    staged = [r for r in report["results"] if r["target"].endswith("staging-on")]
    assert all(r["extra"]["primary"]["staging"] for r in staged)


def _res(target: str, rnd: int, gbps: float) -> PhaseResult:
    return PhaseResult(
        "tier",
        target,
        "read",
        2 << 20,
        int(gbps * 1e9),
        1.0,
        1,
        {},
        0.1,
        0.1,
        extra={"round": rnd},
    )


def test_median_summary_ratios_are_medians_of_per_round_ratios() -> None:
    results = [
        _res("nvmetier-uring", 0, 2.0),
        _res("fio", 0, 1.0),
        _res("lmcache-fs_native", 0, 4.0),
        _res("nvmetier-uring", 1, 3.0),
        _res("fio", 1, 3.0),
        _res("lmcache-fs_native", 1, 1.0),
        _res("nvmetier-uring", 2, 1.0),
        _res("fio", 2, 0.5),
        _res("lmcache-fs_native", 2, 2.0),
    ]
    _lines, rows = median_summary(results, [2 << 20])
    ours = next(r for r in rows if r["target"] == "nvmetier-uring")
    assert ours["gbps_median"] == 2.0
    assert ours["x_fio"] == 2.0  # per-round 2.0, 1.0, 2.0 (not 2.0 / 1.0 of the medians)
    assert ours["x_best_lmcache"] == 0.5  # 0.5, 3.0, 0.5
    assert "x_best_lmcache" not in next(r for r in rows if r["target"] == "fio")


def _lmcache_env_ready() -> bool:
    env = peers.lmcache_env_path()
    return (env / peers.STAMP).exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not _lmcache_env_ready(), reason="LMCache's environment is not built")
def test_each_lmcache_backend_stores_and_loads_every_chunk(tmp_path, capsys) -> None:
    rc, report, err = _json(
        capsys,
        "--level",
        "tier",
        "--engine",
        "threads",
        "--peers",
        "lmcache",
        "--peer-backends",
        ",".join(peers.LMCACHE_BACKENDS),
        "--bs",
        "256k",
        "--size",
        "8m",
        "--iodepth",
        "4",
        "--dir",
        str(tmp_path),
        "--no-drop-caches",
    )
    assert rc == 0 and report is not None, err
    got = {(r["target"], r["phase"]): r for r in report["results"]}
    for b in peers.LMCACHE_BACKENDS:
        for phase in ("write", "read"):
            r = got[(f"lmcache-{b}", phase)]
            assert r["bytes"] == 8 << 20 and r["errors"] == 0
        assert got[(f"lmcache-{b}", "read")]["extra"]["wrong_bytes_loaded"] == 0
    assert not [p for p in os.listdir(tmp_path) if p.startswith("lmcache-")]
