"""A small trace replay through vLLM's orchestrator: two replica processes.

Real vLLM ``TieringOffloadingManager`` + CPU primary + our tier per replica, on
one root in ``tmp_path``; every hit is verified byte for byte. The check on the
exact-LRU bound allows for timing only: with a capacity larger than the trace,
no replica can hit more than the LRU of its store.
"""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.spec")

from nvmetier import bench

pytestmark = pytest.mark.timeout(180)


def _conversations(path, n: int = 48, seed: int = 3) -> None:
    """Multi-turn conversations sharing a system prompt (block 0): each turn
    repeats its conversation's blocks and adds two new ones."""
    rng = random.Random(seed)
    convs: list[list[int]] = []
    nxt = 1
    lines = []
    for i in range(n):
        if convs and rng.random() < 0.65:
            conv = rng.choice(convs)
            conv += [nxt, nxt + 1]
        else:
            conv = [0, nxt, nxt + 1]
            convs.append(conv)
        nxt += 2
        ids = list(conv)
        lines.append(
            json.dumps(
                {
                    "timestamp": i * 20,
                    "input_length": len(ids) * 512 - 37,
                    "output_length": 8,
                    "hash_ids": ids,
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")


def test_two_replicas_replay_verifies_every_hit_and_stays_within_the_lru_bound(
    tmp_path, capsys
) -> None:
    trace = tmp_path / "conv.jsonl"
    _conversations(trace)
    plot = tmp_path / "curve.png"
    rc = bench.main(
        [
            "--level",
            "trace",
            "--trace",
            str(trace),
            "--replicas",
            "2",
            "--route",
            "affinity",
            "--speedup",
            "4",
            "--bytes-per-token",
            "32",  # 16 KiB chunks
            "--scale",
            "1",
            "--capacity",
            "8m",  # more than the trace holds: the bound is every reuse
            "--primary-chunks",
            "24",  # small, so that reuse reaches the disk tier
            "--iodepth",
            "4",
            "--dir",
            str(tmp_path / "run"),
            "--plot",
            str(plot),
            "--output-format",
            "json",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    t = json.loads(out)["trace"]
    rp, total, bound = t["replay"], t["total"], t["bound"]
    assert rp["stores"] in ("shared", "per-rank")
    assert rp["chunk_bytes_real"] == rp["chunk_bytes_replayed"] == 16 << 10
    assert [r["requests"] for r in t["replicas"]] == rp["requests_per_replica"]
    assert sum(rp["requests_per_replica"]) == t["trace"]["requests"] == 48

    assert total["wrong_chunks"] == 0
    assert total["verified_chunks"] == total["offload"]["hit_blocks"] > 0
    assert total["disk"]["hit_blocks"] > 0
    assert total["failed_jobs"] == {"load": 0, "store": 0}
    for r in [*t["replicas"], total]:
        for part in ("offload", "disk"):
            assert 0.0 <= r[part]["block_hit_ratio"] <= 1.0
            assert 0.0 <= r[part]["token_hit_ratio"] <= 1.0
        assert r["disk"]["hit_blocks"] <= r["offload"]["hit_blocks"]

    # Nothing can be hit before its first reference; and a replica sees only
    # its own store when the stores are per rank.
    assert total["offload"]["hit_blocks"] <= bound["infinite"]["hit_blocks"]
    which = "shared" if rp["stores"] == "shared" else "per_replica"
    slack = max(2, total["offload"]["blocks"] // 50)
    assert total["offload"]["hit_blocks"] <= bound[which]["hit_blocks"] + slack
    assert bound["per_replica"]["hit_blocks"] <= bound["shared"]["hit_blocks"]

    for key in ("shared_token_ratio", "per_replica_token_ratio"):
        ys = t["curve"][key]
        assert ys == sorted(ys)
    assert plot.stat().st_size > 0
    assert not (tmp_path / "run" / "trace").exists()  # removed without --keep


def test_trace_level_without_a_trace_is_a_usage_error(tmp_path, capsys) -> None:
    assert bench.main(["--level", "trace", "--dir", str(tmp_path)]) == 2
    assert "--trace FILE" in capsys.readouterr().err


def test_a_bad_trace_line_fails_before_any_replica_starts(tmp_path, capsys) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 5, "hash_ids": [1]}\n{"timestamp": 1}\n')
    assert bench.main(["--level", "trace", "--trace", str(trace), "--dir", str(tmp_path)]) == 2
    assert f"{trace}:2: " in capsys.readouterr().err
