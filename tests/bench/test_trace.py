"""The trace level's pure parts: parsing, routing, pacing, the exact-LRU bound.

No disk beyond ``tmp_path`` trace files, no threads, no vLLM; each test runs in
milliseconds. The answers of the LRU tests are worked out by hand in comments.
"""

from __future__ import annotations

import gzip
import json
import lzma
import random

import pytest

from nvmetier.bench import trace as T


def _req(ids: list[int], ts: float = 0.0, tokens: int | None = None) -> T.TraceRequest:
    n = len(ids) * 512 if tokens is None else tokens
    return T.TraceRequest(0, ts, n, 1, tuple(ids))


def _line(ts: float = 0, n: int = 1000, ids: list[int] | None = None, **extra: object) -> str:
    obj: dict[str, object] = {
        "timestamp": ts,
        "input_length": n,
        "output_length": 5,
        "hash_ids": [0, 1] if ids is None else ids,
    }
    obj.update(extra)
    return json.dumps(obj)


# ------------------------------------------------------------------ parsing
def test_a_mooncake_line_gives_its_fields() -> None:
    r = T.parse_line(_line(27482, 6955, [46, 47, 2353]), "t.jsonl:3")
    assert r == T.TraceRequest(3, 27482.0, 6955, 5, (46, 47, 2353))


def test_blank_lines_are_skipped_and_the_rest_read_in_order(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(_line(0) + "\n\n   \n" + _line(5, ids=[0, 2]) + "\n")
    reqs, notes = T.read_trace(str(path))
    assert [(r.line, r.hash_ids) for r in reqs] == [(1, (0, 1)), (4, (0, 2))]
    assert notes == []


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{not json", "not a JSON object"),
        ("[1, 2]", "not a JSON object but list"),
        (_line(ts=-1), "'timestamp'"),
        (_line(ts=True), "'timestamp'"),
        (_line(n=-5), "'input_length'"),
        (_line(n=1.5), "'input_length'"),
        (_line(ids=[0, "a"]), "'hash_ids'"),
        (_line(ids=[0, -1]), "'hash_ids'"),
        (json.dumps({"timestamp": 0, "input_length": 5}), "'hash_ids'"),
        (_line(output_length="x"), "'output_length'"),
    ],
)
def test_a_bad_line_is_an_error_naming_file_and_line(tmp_path, text: str, says: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(_line(0) + "\n\n" + text + "\n" + _line(9) + "\n")
    with pytest.raises(T.TraceError) as exc:
        T.read_trace(str(path))
    assert f"{path}:3: " in str(exc.value)
    assert says in str(exc.value)


def test_a_trace_without_requests_is_an_error(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n  \n")
    with pytest.raises(T.TraceError, match="no requests"):
        T.read_trace(str(path))


@pytest.mark.parametrize("suffix", ["gz", "xz"])
def test_compressed_traces_are_read(tmp_path, suffix: str) -> None:
    path = tmp_path / f"t.jsonl.{suffix}"
    opener = gzip.open if suffix == "gz" else lzma.open
    with opener(path, "wt", encoding="utf-8") as f:
        f.write(_line(0) + "\n" + _line(1) + "\n")
    reqs, _ = T.read_trace(str(path))
    assert len(reqs) == 2


def test_limit_keeps_the_first_requests_of_the_file(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(_line(i) + "\n" for i in range(10)))
    reqs, _ = T.read_trace(str(path), limit=3)
    assert [r.timestamp_ms for r in reqs] == [0, 1, 2]


def test_requests_out_of_timestamp_order_are_sorted_with_a_note(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(_line(5, ids=[1]) + "\n" + _line(0, ids=[2]) + "\n" + _line(5, ids=[3]) + "\n")
    reqs, notes = T.read_trace(str(path))
    assert [r.hash_ids for r in reqs] == [(2,), (1,), (3,)]  # stable among equal timestamps
    assert notes and "1 requests were out of timestamp order" in notes[0]


def test_block_tokens_count_a_partial_last_block() -> None:
    assert T.TraceRequest(1, 0, 1100, 0, (1, 2, 3)).block_tokens(512) == [512, 512, 76]
    # More hash ids than the prompt fills: the extra blocks carry no tokens.
    assert T.TraceRequest(1, 0, 600, 0, (1, 2, 3)).block_tokens(512) == [512, 88, 0]


# ------------------------------------------------------------------ routing
def test_round_robin_cycles_through_the_replicas() -> None:
    reqs = [_req([i]) for i in range(7)]
    assert T.route(reqs, 3, "round-robin") == [0, 1, 2, 0, 1, 2, 0]


def test_random_route_is_seeded_and_in_range() -> None:
    reqs = [_req([i]) for i in range(200)]
    a = T.route(reqs, 4, "random", seed=1)
    assert a == T.route(reqs, 4, "random", seed=1)
    assert a != T.route(reqs, 4, "random", seed=2)
    assert set(a) == {0, 1, 2, 3}


def test_affinity_sends_one_prefix_to_one_replica_and_spreads_prefixes() -> None:
    # Every request starts with the same system-prompt block 0, as in the
    # published traces; the second block tells conversations apart.
    convs = [[0, c, 1000 + c] for c in range(1, 41)]
    reqs = [_req([*ids, 5000 + turn]) for turn in range(3) for ids in convs]
    routes = T.route(reqs, 4, "affinity", affinity_blocks=2)
    by_conv: dict[int, set[int]] = {}
    for r, x in zip(reqs, routes, strict=True):
        by_conv.setdefault(r.hash_ids[1], set()).add(x)
    assert all(len(v) == 1 for v in by_conv.values())
    assert len({next(iter(v)) for v in by_conv.values()}) == 4
    # With one block, the shared system prompt sends everything to one replica.
    assert len(set(T.route(reqs, 4, "affinity", affinity_blocks=1))) == 1


def test_an_unknown_route_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown route"):
        T.route([_req([1])], 2, "least-loaded")


# ------------------------------------------------------------------- pacing
def test_due_offsets_are_relative_to_the_first_request_and_divided_by_speedup() -> None:
    reqs = [_req([1], ts) for ts in (1000, 1000, 2000, 5000)]
    assert T.due_offsets_s(reqs, 2.0) == [0.0, 0.0, 0.5, 2.0]
    with pytest.raises(ValueError):
        T.due_offsets_s(reqs, 0.0)


class _FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.idles: list[float] = []

    def __call__(self) -> float:
        return self.now

    def idle(self, left_s: float) -> None:
        self.idles.append(round(left_s, 6))
        self.now += min(0.25, left_s)  # one engine step, then sleep at most 0.25 s


def test_paced_idles_until_each_request_is_due() -> None:
    clock = _FakeClock()
    got = list(T.paced([0.0, 0.5, 0.5], clock.now, clock, clock.idle))
    assert got == [(0, 0.0), (1, 0.0), (2, 0.0)]
    assert clock.idles == [0.5, 0.25]
    assert clock.now == 100.5


def test_a_late_request_starts_at_once_and_reports_its_lag() -> None:
    clock = _FakeClock()
    out = []
    for i, lag in T.paced([0.0, 0.1, 0.2], clock.now, clock, clock.idle):
        out.append((i, round(lag, 6)))
        clock.now += 0.3  # serving takes longer than the gaps
    assert out == [(0, 0.0), (1, 0.2), (2, 0.4)]
    assert clock.idles == []


# -------------------------------------------------------------- exact LRU
def test_lru_counts_prefix_hits_within_its_capacity() -> None:
    # capacity 2: [1,2] misses both; [1,2] hits both; [3,4] misses and evicts
    # 1 and 2; [1,2] misses both again. 2 hits of 8 blocks.
    reqs = [_req([1, 2]), _req([1, 2]), _req([3, 4]), _req([1, 2])]
    h = T.lru_hits(reqs, 2, 512)
    assert (h.blocks, h.total_blocks) == (2, 8)
    assert h.block_ratio == 0.25


def test_lru_stops_counting_at_the_first_miss_of_a_request() -> None:
    # [2] caches 2; [1,2]: 1 misses, so 2 is not a hit although it is cached
    # (vLLM loads a prefix only); then [1,2] hits both.
    reqs = [_req([2]), _req([1, 2]), _req([1, 2])]
    assert T.lru_hits(reqs, 3, 512).blocks == 2


def test_lru_refreshes_blocks_referenced_after_the_first_miss() -> None:
    # capacity 3 (least recent first). [1,2,3] -> 1 2 3. [9,2]: 9 misses and
    # evicts 1; 2 is cached but after the miss, so not a hit, yet it is stored
    # again, so it becomes the most recent -> 3 9 2. [4] evicts 3 -> 9 2 4.
    # [2] hits; without the refresh, [4] would have evicted 2 instead.
    reqs = [_req([1, 2, 3]), _req([9, 2]), _req([4]), _req([2])]
    assert T.lru_hits(reqs, 3, 512).blocks == 1


def test_lru_token_ratio_weights_the_partial_last_block() -> None:
    reqs = [_req([1, 2], tokens=600), _req([1, 2], tokens=600)]
    h = T.lru_hits(reqs, 10, 512)
    assert (h.blocks, h.tokens, h.total_tokens) == (2, 600, 1200)
    assert h.token_ratio == 0.5


def test_stack_depths_agree_with_the_lru_at_every_capacity() -> None:
    rng = random.Random(7)
    for _ in range(20):
        reqs = []
        for _ in range(rng.randint(1, 40)):
            n = rng.randint(1, 6)
            start = rng.choice([0, 0, 10, 20])
            ids = [start + j if rng.random() < 0.8 else rng.randint(30, 60) for j in range(n)]
            reqs.append(_req(ids, tokens=n * 512 - rng.randint(0, 511)))
        prof = T.DepthProfile.of(reqs, 512)
        for cap in range(1, 30):
            want = T.lru_hits(reqs, cap, 512)
            got = prof.hits(cap)
            assert (got.blocks, got.tokens) == (want.blocks, want.tokens), cap


def test_curve_splits_the_capacity_between_replicas() -> None:
    # Every request is [1,2], alternately on replica 0 and 1. One shared store
    # of 2 blocks: every request after the first hits both. Two stores of 1
    # block: each replica's LRU holds only 2 when 1 is looked up, never a hit.
    reqs = [_req([1, 2]) for _ in range(6)]
    shared = T.DepthProfile.of(reqs, 512)
    split = [T.DepthProfile.of(reqs[0::2], 512), T.DepthProfile.of(reqs[1::2], 512)]
    curve = T.capacity_curve(shared, split, [2, 4])
    assert curve["shared_block_ratio"] == [round(10 / 12, 5), round(10 / 12, 5)]
    # At 4 blocks in all, each replica's 2 hold its prefix: 2 misses each.
    assert curve["per_replica_block_ratio"] == [0.0, round(8 / 12, 5)]


# -------------------------------------------------------------------- sizes
def test_scale_accepts_fractions_and_rejects_nonsense() -> None:
    assert T.parse_scale("1/1024") == 1 / 1024
    assert T.parse_scale("0.5") == 0.5
    for bad in ("0", "2", "1/0", "x"):
        with pytest.raises(ValueError):
            T.parse_scale(bad)


def test_replayed_chunks_are_page_aligned() -> None:
    assert T.chunk_sizes(131072, 512, 1 / 1024) == (64 << 20, 64 << 10)
    assert T.chunk_sizes(110, 512, 1.0) == (56320, 57344)  # the nearest multiple of 4096
    assert T.chunk_sizes(8, 512, 1 / 1024) == (4096, 4096)


def test_tier_options_read_json_values_and_keep_strings() -> None:
    assert T.parse_tier_options(["ways=8", "sharing=process", "verify_checksums=false"]) == {
        "ways": 8,
        "sharing": "process",
        "verify_checksums": False,
    }
    with pytest.raises(ValueError, match="KEY=VALUE"):
        T.parse_tier_options(["ways"])
