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


def _fake_report(path, bws: dict[tuple[str, str], float]) -> str:
    results = []
    for (target, phase), gbps in bws.items():
        results.append(
            {
                "level": "vllm",
                "target": target,
                "phase": phase,
                "bs": 65536,
                "bytes": int(gbps * 1e9),
                "runtime_s": 1.0,
                "ops": 1,
                "clat_ns": {},
                "cpu": {"usr_s": gbps, "sys_s": 0.0, "tier_s": gbps / 2},
                "errors": 0,
            }
        )
    path.write_text(json.dumps({"results": results}))
    return str(path)


def test_summarize_reports_medians_ranges_and_ratios(tmp_path, capsys) -> None:
    paths = [
        _fake_report(
            tmp_path / f"r{i}.json",
            {("nvmetier-threads", "write"): t, ("nvmetier-uring", "write"): u},
        )
        for i, (t, u) in enumerate([(1.0, 1.5), (2.0, 1.0), (3.0, 2.0)])
    ]
    assert bench.main(["--summarize", *paths]) == 0
    out = capsys.readouterr().out
    assert "3 reports" in out
    # medians 2.0 (threads) and 1.5 (uring): ratio 0.75
    assert "| store | 64KiB | 2.000 (1.00-3.00) | 1.500 (1.00-2.00) | 0.75 |" in out
    # CPU 1 s of usr per GB for every run; the tier's half of it
    assert "| store | 64KiB | 1.00 (tier 0.50) | 1.00 (tier 0.50) | 1.00 (tier 1.00) |" in out


def test_summarize_of_an_unreadable_report_is_an_error(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    assert bench.main(["--summarize", str(bad)]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_tier_clock_counts_time_inside_wrapped_methods_only() -> None:
    import time

    class Tier:
        def lookup(self, key):
            end = time.thread_time() + 0.02
            while time.thread_time() < end:
                pass
            return key

    tier = Tier()
    clock = bench._TierClock(tier)
    cpu = clock.start()
    assert tier.lookup("k") == "k"
    end = time.thread_time() + 0.02  # outside the tier: not counted
    while time.thread_time() < end:
        pass
    usr, sys_ = cpu.stop()
    inside = clock.inside_ns / 1e9
    assert 0.015 <= inside < 0.035
    assert cpu.thread_s >= inside + 0.015
    assert clock.tier_s(cpu, usr, sys_) >= inside
    # The breakdown names each method called, with its calls and its share.
    by = clock.by_method_us(chunks=1)
    assert list(by) == ["lookup"] and by["lookup"]["calls"] == 1
    assert 15_000 <= by["lookup"]["us_per_chunk"] < 35_000
    clock.remove()
    assert "lookup" not in vars(tier)


def test_tier_clock_times_a_callable_the_instance_holds() -> None:
    # A tier may answer vLLM through a callable set on the instance (ours
    # sets its native lookup there): vLLM calls that, so the clock times it,
    # and puts it back when removed; a second clock does not wrap twice.
    import time

    class Tier:
        def lookup(self, key):
            return "class"

    tier = Tier()

    def own(key):
        end = time.thread_time() + 0.02
        while time.thread_time() < end:
            pass
        return "own"

    tier.lookup = own
    clock = bench._TierClock(tier)
    clock.start()
    assert tier.lookup("k") == "own"
    assert 0.015 <= clock.inside_ns / 1e9 < 0.035
    assert clock.by_method_us(chunks=1)["lookup"]["calls"] == 1
    again = bench._TierClock(tier)
    assert "lookup" not in again.by_method
    again.remove()
    clock.remove()
    assert vars(tier)["lookup"] is own


@pytest.mark.timeout(180)
def test_vllm_level_times_lookups_that_reach_the_store(tmp_path, capsys) -> None:
    # Through vLLM's real orchestrator: every timed lookup of a stored key is
    # a HIT (the store's index answered it), every absent key a MISS; none
    # is cut short by the promotion guard's per-request budget.
    pytest.importorskip("vllm.v1.kv_offload.tiering")
    report = _run(
        capsys,
        "--level",
        "vllm",
        "--bs",
        "64k",
        "--size",
        "4m",
        "--engine",
        "threads",
        "--no-fs-tier",
        "--lookups",
        "300",
        "--primary",
        "1m",  # a 16-chunk CPU tier: 300 HITs would exceed one request's budget
        "--dir",
        str(tmp_path),
        "--no-drop-caches",
    )
    (lk,) = report["lookup_latency"].values()
    assert lk["results"] == {"HIT": 300, "MISS": 300}
    assert lk["hit_ns"]["p50"] > 0 and lk["miss_ns"]["p50"] > 0


@pytest.mark.timeout(180)
def test_vllm_level_load_window_loads_every_chunk(tmp_path, capsys) -> None:
    """``--load-requests 3``: three requests in flight through vLLM's
    orchestrator, each a third of a 16-chunk primary (5 chunks, the last
    request shorter); every stored chunk is promoted, lands and verifies,
    as with one request at a time (a few seconds)."""
    pytest.importorskip("vllm.v1.kv_offload.tiering")
    report = _run(
        capsys,
        *("--level", "vllm", "--bs", "64k", "--size", "4m", "--engine", "threads"),
        *("--no-fs-tier", "--lookups", "10", "--primary", "1m", "--load-requests", "3"),
        *("--dir", str(tmp_path), "--no-drop-caches"),
    )
    (load,) = [r for r in report["results"] if r["phase"] == "read"]
    extra = load["extra"]
    assert extra["load_requests_in_flight"] == 3
    assert extra["chunks_per_request"] == 5
    assert load["bytes"] == 4 << 20 and load["errors"] == 0
    assert extra["lookup_misses"] == 0
    got, of = extra["verified_sample"].split("/")
    assert got == of and int(of) > 0


def test_vllm_level_load_window_must_be_positive(tmp_path, capsys) -> None:
    from nvmetier.bench import main

    rc = main(["--level", "vllm", "--load-requests", "0", "--dir", str(tmp_path)])
    assert rc == 2
    assert "--load-requests 0" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_tier_level_profile_breaks_the_cpu_down_per_gb(tmp_path, capsys) -> None:
    """``--profile`` at the tier level: every phase says where its CPU went
    (hashing counted natively, by thread, beside one XXH3 pass measured in
    the same run); about 1 s."""
    report = _run(
        capsys,
        "--level",
        "tier",
        "--rw",
        "rw",
        "--bs",
        "64k",
        "--size",
        "4m",
        "--iodepth",
        "4",
        "--dir",
        str(tmp_path),
        "--no-drop-caches",
        "--profile",
    )
    for r in report["results"]:
        prof = r["extra"]["cpu_profile"]
        native = prof["native_bytes"]
        # Checksums on: every byte moved is hashed once, alone or fused with
        # the staging copy.
        assert native["hash_bytes"] + native["copy_hash_bytes"] >= r["bytes"]
        assert prof["tier_s_per_gb"] > 0
        assert prof["threads"] and "main (caller)" in prof["threads"]
        assert prof["xxh3"]["impl"] in ("avx512", "avx2", "baseline")
        assert prof["xxh3"]["warm_s_per_gb"] > 0 and prof["xxh3"]["cold_s_per_gb"] > 0


def test_vllm_level_queue_bound_holds_a_primary() -> None:
    """A store phase cascades up to the whole primary at once: the tier's
    queue bound (max_queued_bytes, 1 GiB by default) must hold that much, or
    the tier drops stores by design and the load phase counts misses. On the
    device machine a 4 GiB primary lost 6,648 of 7,208 chunks that way."""
    import argparse

    from nvmetier.bench.vllm import _vllm_tier_dict

    def tier(primary: int, options: list[str] | None = None) -> dict:
        args = argparse.Namespace(primary=primary, iodepth=32, direct=1, tier_option=options)
        return _vllm_tier_dict(args, "nvmetier-uring", ["/x"], 2 << 20, 2048)

    assert tier(4 << 30)["max_queued_bytes"] == 4 << 30
    assert tier(512 << 20)["max_queued_bytes"] == 1 << 30  # never below the default
    # --tier-option still has the last word.
    assert tier(4 << 30, ["max_queued_bytes=123456789"])["max_queued_bytes"] == 123456789
