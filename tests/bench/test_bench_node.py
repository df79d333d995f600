"""``scripts/bench-node.sh``'s runner (``tools/bench_node.py``): the plan and a real run.

The plan (``--dry-run``, in-process): drive counts capped at the drives given,
one I/O worker per drive, fio once per drive count, the vllm level skipped
with its reason where vLLM does not import. The smallest real run: the tier
level on two folders of the test disk at 1 and 2 drives, 8 MiB per drive,
without fio; the table and the JSON it writes. ~4 s (two bench processes).
The numbers themselves are not checked, only that they are there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_node", ROOT / "tools" / "bench_node.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _drives(tmp_path: Path, n: int) -> list[str]:
    out = []
    for i in range(n):
        d = tmp_path / f"nvme{i}"
        d.mkdir()
        out.append(str(d))
    return out


@pytest.mark.parametrize("vllm_ok", [True, False])
def test_dry_run_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, vllm_ok: bool
) -> None:
    bn = _runner()
    monkeypatch.setattr(bn, "_vllm_why_not", lambda: None if vllm_ok else "no vLLM here")
    drives = _drives(tmp_path, 3)
    out = tmp_path / "plan.json"
    rc = bn.main(
        ["--dry-run", "--drives", ",".join(drives), "--fio", "none", "--out", str(out), "--quick"]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["dry_run"] is True and doc["rows"] == []
    plan = doc["plan"]
    assert plan["counts"] == [1, 2] and plan["drives"] == drives
    assert plan["bytes_per_drive"] == bn.QUICK_PER_DRIVE
    skipped = {s["what"]: s["why"] for s in doc["skipped"]}
    assert "3 drive(s) given" in skipped["4 drives"] and "8 drives" in skipped
    assert "--fio none" in skipped["fio"]
    levels = ["tier", "vllm"] if vllm_ok else ["tier"]
    assert plan["levels"] == levels
    if not vllm_ok:
        assert skipped["vllm level"] == "no vLLM here"
    runs = doc["runs"]
    assert [(r["drives"], r["level"]) for r in runs] == [(n, lv) for n in (1, 2) for lv in levels]
    for r in runs:
        cmd = r["command"].split()
        n = r["drives"]
        assert cmd[cmd.index("--io-workers") + 1] == str(n)
        assert cmd[cmd.index("--dirs") + 1] == ",".join(drives[:n])
        assert cmd[cmd.index("--size") + 1] == f"{256 * n}m"
        assert cmd[cmd.index("--level") + 1] == r["level"]
        assert "--compare-fio" not in cmd  # --fio none
        assert ("--no-fs-tier" in cmd) == (r["level"] == "vllm")
        assert "--profile" in cmd
        if r["level"] == "vllm":  # the primary grows with the drives: 512 MiB each
            assert cmd[cmd.index("--primary") + 1] == bn._size(512 * n << 20)
            assert cmd[cmd.index("--load-requests") + 1] == "2"
    printed = capsys.readouterr().out
    assert "would run: nvmetier bench --level tier" in printed
    assert "skipped: fio: --fio none" in printed


def test_vllm_found_but_not_importable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM that is found but fails to import (a carry missing a wheel, a
    torch it does not work with) skips the vllm level with the import's error,
    rather than failing each vllm run."""
    bn = _runner()
    fake = tmp_path / "vllm"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('carried vLLM lacks pydantic_core')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{ROOT}")
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    why = bn._vllm_why_not()
    assert why is not None
    assert "found but does not import" in why and "lacks pydantic_core" in why


def test_dry_run_fio_once_per_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fio runs with the tier level, or with the vllm level when it runs alone."""
    bn = _runner()
    monkeypatch.setattr(bn, "_vllm_why_not", lambda: None)
    fio = tmp_path / "bin" / "fio"
    fio.parent.mkdir()
    fio.write_text("#!/bin/sh\necho fio-test\n")
    fio.chmod(0o755)
    drives = _drives(tmp_path, 2)
    for levels, with_fio in (("tier,vllm", {"tier"}), ("vllm", {"vllm"})):
        out = tmp_path / f"{levels}.json"
        args = ["--dry-run", "--drives", ",".join(drives), "--fio", str(fio)]
        assert bn.main([*args, "--levels", levels, "--out", str(out)]) == 0
        doc = json.loads(out.read_text())
        assert doc["plan"]["fio"] == f"{fio} (fio-test)"
        got = {r["level"] for r in doc["runs"] if "--compare-fio" in r["command"].split()}
        assert got == with_fio


def test_bad_input_names_the_problem(tmp_path: Path) -> None:
    bn = _runner()
    with pytest.raises(SystemExit, match=r"--drives .*nope: not a directory"):
        bn.main(["--dry-run", "--drives", str(tmp_path / "nope")])
    with pytest.raises(SystemExit, match=r"--counts 'x': use integers"):
        bn.main(["--dry-run", "--drives", str(tmp_path), "--counts", "x"])
    with pytest.raises(SystemExit, match=r"--levels 'disk': use tier, vllm"):
        bn.main(["--dry-run", "--drives", str(tmp_path), "--levels", "disk"])
    with pytest.raises(SystemExit, match=r"--fio .*: not an executable named fio"):
        bn.main(["--dry-run", "--drives", str(tmp_path), "--fio", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"--load-requests 0: requests in flight are >= 1"):
        bn.main(["--dry-run", "--drives", str(tmp_path), "--load-requests", "0"])
    with pytest.raises(SystemExit, match=r"--primary-per-drive 2097152: less than one chunk"):
        bn.main(["--dry-run", "--drives", str(tmp_path), "--primary-per-drive", "2m",
                 "--load-requests", "2"])  # fmt: skip


def test_bench_dirs_option(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``nvmetier bench --dirs``: the drives given, checked before the run."""
    from nvmetier.bench import main

    assert main(["--dirs", f"{tmp_path},{tmp_path / 'gone'}", "--size", "4m"]) == 2
    assert "--dirs " + str(tmp_path / "gone") + ": not a directory" in capsys.readouterr().err
    assert main(["--dirs", str(tmp_path), "--loop-drives", "1"]) == 2
    assert "not both" in capsys.readouterr().err


def test_smallest_real_run(tmp_path: Path) -> None:
    drives = _drives(tmp_path, 2)
    out = tmp_path / "node.json"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "bench_node.py"),
            *("--drives", ",".join(drives), "--counts", "1,2,4", "--levels", "tier"),
            *("--bs", "1m", "--bytes-per-drive", "8m", "--engine", "threads"),
            *("--fio", "none", "--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert [(x["drives"], x["level"], x["rc"]) for x in doc["runs"]] == [
        (1, "tier", 0),
        (2, "tier", 0),
    ]
    assert [x["bytes"] for x in doc["runs"]] == [8 << 20, 16 << 20]
    assert {s["what"] for s in doc["skipped"]} >= {"4 drives", "fio"}
    assert doc["machine"]["host_cpus"] == os.cpu_count()
    rows = doc["rows"]
    assert [(x["drives"], x["target"], x["cpu_of"]) for x in rows] == [
        (1, "nvmetier-threads", "process"),
        (2, "nvmetier-threads", "process"),
    ]
    for x in rows:
        assert x["store_bytes"] == x["load_bytes"] == (8 << 20) * x["drives"]
        assert x["store_gbps"] > 0 and x["load_gbps"] > 0 and x["errors"] == 0
        assert x["store_cpu_s_per_gb"] >= 0 and x["load_cpu_s_per_gb"] >= 0
        assert "store_vs_fio" not in x  # no fio rows to compare with
        # Every run is profiled: item 2's floor (one cold XXH3 pass) beside each row.
        assert x["xxh3_cold_s_per_gb"] > 0
        assert isinstance(x["store_within_floor"], bool)
        assert isinstance(x["load_within_floor"], bool)
    header = next(line for line in r.stdout.splitlines() if line.startswith("drives"))
    assert header.split()[:5] == ["drives", "level", "target", "store", "GB/s"]
    assert header.rstrip().endswith("XXH3 cold  beyond XXH3 st/ld")
    assert "skipped: fio: --fio none" in r.stdout
    # Everything the runs made in the drives was removed.
    assert all(not os.listdir(d) for d in drives)


def test_out_of_time_runs_are_skipped_not_squeezed(tmp_path: Path) -> None:
    """A run whose share of --budget-s moves too little is skipped, with why."""
    bn = _runner()
    drives = _drives(tmp_path, 1)
    out = tmp_path / "node.json"
    args = ["--drives", drives[0], "--levels", "tier", "--fio", "none", "--engine", "threads"]
    assert bn.main([*args, "--budget-s", "2", "--out", str(out)]) == 1  # nothing measured
    doc = json.loads(out.read_text())
    assert doc["rows"] == [] and "rc" not in doc["runs"][0]
    assert "out of time" in doc["runs"][0]["skipped"]
    assert any(s["what"] == "tier level at 1 drives" for s in doc["skipped"])


def test_first_run_of_a_vllm_only_plan_gets_its_share() -> None:
    """The vllm level alone at 1,2,4,8 drives in 260 s: the first run moved
    nothing on the device machine, because its fixed cost (20 s) was taken
    from its own byte-proportional share (2/30 of the time) instead of from
    the time left. Every run's fixed cost comes off the total first."""
    bn = _runner()
    gib = 1 << 30
    runs = [{"drives": n, "level": "vllm", "planned_bytes": 2 * gib * n} for n in (1, 2, 4, 8)]
    first, todo = runs[0], runs[1:]
    # 260 s - 4 x 20 s = 180 s for moving bytes; the first run's share is 2/30 of it.
    expected_s = (260 - 4 * bn.FIXED_S["vllm"]) * 2 / 30
    guess = bn.FIRST_RATE / bn.VLLM_SLOWER
    assert bn.bytes_that_fit(260.0, first, todo, {}) == int(guess * expected_s)
    assert bn.bytes_that_fit(260.0, first, todo, {}) >= bn.FLOOR_PER_DRIVE
    # A measured rate replaces the guess; out of time, nothing fits.
    assert bn.bytes_that_fit(260.0, first, todo, {"vllm": 1e9}) == int(1e9 * expected_s)
    assert bn.bytes_that_fit(60.0, first, todo, {"vllm": 1e9}) == 0


def _result(target: str, phase: str, rnd: int, gbps: float, s_per_gb: float, **extra) -> dict:
    cpu = (
        {"usr_s_per_gb": s_per_gb, "sys_s_per_gb": 0.0}
        if target == "fio"
        else {"usr_s_per_gb": 1.0, "sys_s_per_gb": 1.0, "tier_s_per_gb": s_per_gb}
    )
    return {
        "target": target,
        "phase": phase,
        "bytes": 1 << 30,
        "bw_gbps": gbps,
        "cpu": cpu,
        "errors": extra.pop("errors", 0),
        "extra": {"round": rnd, **extra},
    }


def test_rounds_give_medians_ranges_and_the_median_per_round_ratio_to_fio() -> None:
    """Three rounds: each figure is the median over them, and the ratio to fio
    the median of each round's ratio (not the ratio of the medians: fio's GB/s
    moves between rounds as much as ours)."""
    bn = _runner()
    prof = {"beyond_its_xxh3_s_per_gb": 0.02, "within_floor": True, "xxh3": {"cold_s_per_gb": 0.1}}
    ours_load = [(4.0, 0.15), (8.0, 0.13), (6.0, 0.14)]
    fio_load = [8.0, 4.0, 5.0]  # per-round ratios 0.5, 2.0, 1.2 -> 1.2; medians 6.0/5.0 -> 1.2
    ours_store = [(3.0, 0.16), (3.0, 0.17), (3.0, 0.18)]
    fio_store = [2.0, 6.0, 3.0]  # ratios 1.5, 0.5, 1.0 -> 1.0; medians 3.0 / 3.0 -> 1.0
    results = []
    for rnd in range(3):
        within = rnd != 1  # one round over the floor
        results += [
            _result("nvmetier-uring", "write", rnd, *ours_store[rnd], xxh3_s_per_gb=0.04,
                    cpu_profile={**prof, "within_floor": within}),
            _result("nvmetier-uring", "read", rnd, *ours_load[rnd], xxh3_s_per_gb=0.04,
                    cpu_profile=prof, errors=rnd),
            _result("fio", "write", rnd, fio_store[rnd], 0.07),
            _result("fio", "read", rnd, fio_load[rnd], 0.01),
        ]  # fmt: skip
    # Ratios that differ from the ratio of the medians: round 2's fio is slow.
    results[-1]["bw_gbps"] = 2.0  # fio load ratios 0.5, 2.0, 3.0 -> 2.0; medians 6.0/4.0 = 1.5
    rows = {r["target"]: r for r in bn.rows_of({"results": results}, 2, "vllm")}
    ours, fio = rows["nvmetier-uring"], rows["fio"]
    assert ours["load_gbps"] == 6.0 and ours["load_gbps_range"] == [4.0, 8.0]
    assert ours["load_rounds"] == ours["store_rounds"] == 3
    assert ours["load_cpu_s_per_gb"] == 0.14 and ours["store_cpu_s_per_gb"] == 0.17
    assert ours["load_vs_fio"] == 2.0 and ours["load_vs_fio_rounds"] == [0.5, 2.0, 3.0]
    assert ours["store_vs_fio"] == 1.0 and ours["store_vs_fio_rounds"] == [1.5, 0.5, 1.0]
    assert ours["errors"] == 0 + 1 + 2
    assert ours["store_within_floor"] is False and ours["load_within_floor"] is True
    assert ours["cpu_of"] == "tier" and fio["cpu_of"] == "fio"
    assert fio["load_gbps"] == 4.0 and "load_vs_fio" not in fio
    # The per-round median is kept where add_fio_ratios would take the medians' ratio.
    bn.add_fio_ratios(list(rows.values()))
    assert ours["load_vs_fio"] == 2.0
    # One round: as before, the figures of that round, no range.
    one = bn.rows_of({"results": results[:4]}, 2, "vllm")
    ours1 = next(r for r in one if r["target"] == "nvmetier-uring")
    assert ours1["load_gbps"] == 4.0 and "load_gbps_range" not in ours1
    bn.add_fio_ratios(one)
    assert ours1["load_vs_fio"] == 0.5 and ours1["store_vs_fio"] == 1.5


def test_rounds_reach_the_bench_and_share_the_runs_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--rounds 3``: every run asks ``nvmetier bench --rounds 3``, and a run
    whose share of the budget moves B bytes gets B / 3 a round."""
    bn = _runner()
    drives = _drives(tmp_path, 2)
    seen: list[list[str]] = []
    fits = 3 * (192 << 20)  # three rounds of 192 MiB over 2 drives (the plan: 4 GiB)

    def fake_run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess:
        argv = cmd[3:]
        seen.append(argv)
        size = bn.parse_size(argv[argv.index("--size") + 1])
        rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 1
        res = [
            _result("nvmetier-threads", ph, rnd, 1.0, 0.1)
            for rnd in range(rounds)
            for ph in ("write", "read")
        ]
        for r in res:
            r["bytes"] = size
        kw["stdout"].write(json.dumps({"results": res, "machine": {}}))  # type: ignore[union-attr]
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bn.subprocess, "run", fake_run)
    monkeypatch.setattr(bn, "bytes_that_fit", lambda *a: fits)
    out = tmp_path / "node.json"
    args = ["--drives", ",".join(drives), "--counts", "2", "--levels", "tier", "--fio", "none"]
    assert bn.main([*args, "--engine", "threads", "--rounds", "3", "--out", str(out)]) == 0
    (argv,) = seen
    assert argv[argv.index("--rounds") + 1] == "3"
    doc = json.loads(out.read_text())
    assert doc["plan"]["rounds"] == 3
    assert doc["runs"][0]["bytes"] == 192 << 20 and "cut" in doc["runs"][0]
    (row,) = doc["rows"]
    assert row["store_rounds"] == row["load_rounds"] == 3
    # One round asks for none.
    seen.clear()
    monkeypatch.setattr(bn, "bytes_that_fit", lambda *a: 1 << 40)
    assert bn.main([*args, "--engine", "threads", "--out", str(out)]) == 0
    assert "--rounds" not in seen[0]
    with pytest.raises(SystemExit, match=r"--rounds 0: give 1 or more"):
        bn.main(["--dry-run", "--drives", str(tmp_path), "--rounds", "0"])
