"""A CPU tier smaller than a prompt never makes the disk tier a loss (issue 21).

The scenario of the report: vLLM's CPU tier holds 13 chunks, three prompts of
39 chunks each are all on disk after a restart, and vLLM's connector looks
them up step after step (``connector_model``). Through the real
``TieringOffloadingManager`` and CPU primary tier.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
from vllm.v1.kv_offload.config import OffloadingModelConfig

from nvmetier.errors import ConfigError
from nvmetier.vllm import METRIC_PREFIX, NvmeTierManager
from nvmetier.vllm.harness import SimulatedEngine, key_of
from tests.vllm.conftest import nvme_tier
from tests.vllm.connector_model import ConnectorModel

CPU_CHUNKS = 13
PROMPT_CHUNKS = 39
N_PROMPTS = 3
MAX_STEPS = 40


def prompt_keys(i: int) -> list[bytes]:
    return [key_of(1000 * (i + 1) + j) for j in range(PROMPT_CHUNKS)]


def restarted_engine(
    make_engine: Callable[..., SimulatedEngine], root: str, **tier_kw: Any
) -> SimulatedEngine:
    """Every prompt's chunks on disk, then a new engine on the same disk
    (an empty CPU tier), as after a restart of ``vllm serve``."""
    first = make_engine([nvme_tier(root)], cpu_chunks=CPU_CHUNKS)
    for i in range(N_PROMPTS):
        first.store_all(prompt_keys(i), batch=8)
    first.shutdown()
    eng = make_engine([nvme_tier(root, **tier_kw)], cpu_chunks=CPU_CHUNKS)
    assert all(eng.tiers[0].store.contains(k) for i in range(N_PROMPTS) for k in prompt_keys(i))
    return eng


def counters(eng: SimulatedEngine) -> dict[str, float]:
    values = eng.manager.get_stats().reduce()
    label = (eng.tiers[0].tier_label,)
    return {
        name: values.get(f"{METRIC_PREFIX}{name}:{label}", 0)
        for name in ("hits_not_loaded", "lookups_withheld", "ops_read")
    }


@pytest.mark.parametrize("reads_land_in_step", [True, False])
def test_three_long_prompts_load_what_fits_in_one_go_and_read_at_most_the_cpu_tier(
    tmp_path, make_engine, reads_land_in_step: bool
) -> None:
    eng = restarted_engine(make_engine, str(tmp_path / "kv"))
    model = ConnectorModel(eng, reads_land_in_step=reads_land_in_step)
    prompts = [model.add(f"p{i}", prompt_keys(i)) for i in range(N_PROMPTS)]
    # Steps of 1 ms when reads may take longer than a step: a request then
    # waits for its reads over several steps, and reads nothing more meanwhile.
    max_steps = MAX_STEPS if reads_land_in_step else 10_000
    model.run(max_steps, step_s=0.0 if reads_land_in_step else 0.001)
    model.drain()

    # No request is deferred for good: each is scheduled once its reads landed.
    assert all(p.finished for p in prompts), [p.deferred_steps for p in prompts]
    chunk_bytes = eng.chunk_bytes
    for p in prompts:
        # Disk bytes read per prompt: at most twice the CPU tier's size.
        assert model.chunks_read[p.ctx.req_id] * chunk_bytes <= 2 * CPU_CHUNKS * chunk_bytes
        # What it loads is the prefix it read, all of it, with the right bytes.
        assert p.hit_chunks == model.chunks_read[p.ctx.req_id]
        assert p.correct_chunks == p.hit_chunks
    # The first prompt fills the CPU tier and loads all of it in one go; the
    # others see the CPU tier taken by the first one's plan and compute (as
    # with no disk tier), instead of evicting the first one's chunks.
    first, *others = prompts
    assert first.hit_chunks == CPU_CHUNKS
    assert all(p.hit_chunks == 0 for p in others)
    if reads_land_in_step:
        assert first.scheduled_step == 2  # reads in step 1, loaded in step 2
    # Every HIT answered was loaded: the others were told MISS, not a HIT
    # vLLM then found no CPU slot for.
    got = counters(eng)
    assert got["hits_not_loaded"] == 0
    assert got["ops_read"] == CPU_CHUNKS
    assert got["lookups_withheld"] >= 1 + len(others)  # the first one's 14th chunk, theirs


def test_one_long_prompt_loads_the_cpu_tier_worth_once(tmp_path, make_engine) -> None:
    eng = restarted_engine(make_engine, str(tmp_path / "kv"))
    model = ConnectorModel(eng, reads_land_in_step=True)
    p = model.add("solo", prompt_keys(0))
    model.run(MAX_STEPS)
    assert p.finished
    assert p.hit_chunks == p.correct_chunks == CPU_CHUNKS
    assert model.chunks_read["solo"] == CPU_CHUNKS
    assert p.deferred_steps == 1  # the one step its reads took
    assert counters(eng)["hits_not_loaded"] == 0


def test_a_prompt_that_fits_loads_entirely(tmp_path, make_engine) -> None:
    eng = restarted_engine(make_engine, str(tmp_path / "kv"))
    model = ConnectorModel(eng, reads_land_in_step=True)
    keys = prompt_keys(1)[:10]
    p = model.add("short", keys)
    model.run(MAX_STEPS)
    assert p.finished and p.hit_chunks == p.correct_chunks == len(keys)
    got = counters(eng)
    assert got["hits_not_loaded"] == 0 and got["lookups_withheld"] == 0


def test_prompts_arriving_one_after_another_each_load_a_cpu_tier_worth(
    tmp_path, make_engine
) -> None:
    eng = restarted_engine(make_engine, str(tmp_path / "kv"))
    model = ConnectorModel(eng, reads_land_in_step=False)
    prompts = []
    for i in range(N_PROMPTS):
        prompts.append(model.add(f"seq{i}", prompt_keys(i)))
        model.run(10_000, step_s=0.001)
    assert all(p.finished for p in prompts)
    assert [p.hit_chunks for p in prompts] == [CPU_CHUNKS] * N_PROMPTS
    assert all(p.correct_chunks == CPU_CHUNKS for p in prompts)
    assert all(model.chunks_read[p.ctx.req_id] == CPU_CHUNKS for p in prompts)


def test_promotion_fraction_bounds_one_request_to_its_share(tmp_path, make_engine) -> None:
    eng = restarted_engine(make_engine, str(tmp_path / "kv"), promotion_fraction=0.5)
    model = ConnectorModel(eng, reads_land_in_step=True)
    prompts = [model.add(f"p{i}", prompt_keys(i)) for i in range(N_PROMPTS)]
    model.run(MAX_STEPS)
    assert all(p.finished for p in prompts)
    # 6 chunks each for the first two; the third plans the one slot left.
    assert [p.hit_chunks for p in prompts] == [6, 6, 1]
    assert all(p.correct_chunks == p.hit_chunks for p in prompts)
    assert counters(eng)["hits_not_loaded"] == 0  # nothing answered HIT past the room


def test_without_the_guard_vllm_rereads_the_cpu_tier_every_step(tmp_path, make_engine) -> None:
    """The report's storm, reproduced by the model: why the guard exists. With
    every HIT answered, the first prompt promotes a CPU tier's worth, evicts
    it for the next one, and is deferred step after step, reading all along
    and loading nothing; the counter says so."""
    eng = restarted_engine(make_engine, str(tmp_path / "kv"), promotion_guard=False)
    model = ConnectorModel(eng, reads_land_in_step=True)
    first = model.add("p0", prompt_keys(0))
    model.run(12)
    assert not first.finished and first.hit_chunks == 0
    assert model.chunks_read["p0"] > 2 * CPU_CHUNKS
    got = counters(eng)
    assert got["hits_not_loaded"] >= 10  # one a step: the HIT past the full CPU tier
    assert got["lookups_withheld"] == 0


def test_a_prompt_whose_head_is_in_the_cpu_tier_keeps_it_and_reads_nothing_over_it(
    tmp_path, make_engine
) -> None:
    """The CPU tier's lookups do not refresh recency, so a promotion would
    evict the prompt's own head first and the prompt would load nothing."""
    eng = restarted_engine(make_engine, str(tmp_path / "kv"))
    model = ConnectorModel(eng, reads_land_in_step=True)
    first = model.add("p0", prompt_keys(0))
    model.run(MAX_STEPS)
    assert first.finished and first.hit_chunks == CPU_CHUNKS
    # The same prompt again: its first 13 chunks are in the CPU tier, the
    # CPU tier has no room for more of it.
    again = model.add("p0-again", prompt_keys(0))
    model.run(MAX_STEPS)
    assert again.finished
    assert again.hit_chunks == again.correct_chunks == CPU_CHUNKS
    assert model.chunks_read["p0-again"] == 0
    assert again.deferred_steps == 0


def test_a_prompt_with_a_short_head_in_the_cpu_tier_promotes_only_the_room_left(
    tmp_path, make_engine
) -> None:
    eng = restarted_engine(make_engine, str(tmp_path / "kv"))
    model = ConnectorModel(eng, reads_land_in_step=True)
    keys = prompt_keys(0)
    head = model.add("head", keys[:5])
    model.run(MAX_STEPS)
    assert head.finished and head.hit_chunks == 5
    whole = model.add("whole", keys)
    model.run(MAX_STEPS)
    # 5 chunks in the CPU tier, 8 promoted next to them: 13 loaded in one go.
    assert whole.finished
    assert whole.hit_chunks == whole.correct_chunks == CPU_CHUNKS
    assert model.chunks_read["whole"] == CPU_CHUNKS - 5


@pytest.mark.parametrize("gpu_cached", [5, 20])
def test_a_head_in_the_gpu_prefix_cache_leaves_the_whole_cpu_tier_for_disk_hits(
    tmp_path, make_engine, gpu_cached: int
) -> None:
    """The walk starts after the GPU prefix-cache head, and the guard sees it
    start there (the head is not in the CPU tier): the whole CPU tier's worth
    of the rest is promoted and loaded in one go."""
    eng = restarted_engine(make_engine, str(tmp_path / "kv"))
    model = ConnectorModel(eng, reads_land_in_step=True)
    p = model.add("warm", prompt_keys(0), gpu_cached=gpu_cached)
    model.run(MAX_STEPS)
    assert p.finished
    assert p.hit_chunks == p.correct_chunks == CPU_CHUNKS
    assert model.chunks_read["warm"] == CPU_CHUNKS
    assert p.deferred_steps == 1


# ------------------------------------------------------------ start-up warning
def _warnings(caplog) -> list[str]:  # type: ignore[no-untyped-def]
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


needs_max_model_len = pytest.mark.skipif(
    "max_model_len" not in getattr(OffloadingModelConfig, "__dataclass_fields__", {}),
    reason="this vLLM (0.32) passes no max_model_len to the offloading config",
)


@needs_max_model_len
def test_a_cpu_tier_smaller_than_one_longest_request_is_warned_at_start(
    tmp_path, make_engine, caplog
) -> None:
    caplog.set_level(logging.WARNING, logger="nvmetier")
    # 16 tokens a chunk: 624 tokens are 39 chunks, 13 fit.
    make_engine([nvme_tier(str(tmp_path / "kv"))], cpu_chunks=CPU_CHUNKS, max_model_len=624)
    msgs = [m for m in _warnings(caplog) if "cpu_bytes_to_use" in m]
    assert len(msgs) == 1
    need = 39 * (64 << 10)
    assert f"at least {need} " in msgs[0] and "13 chunks" in msgs[0] and "has 39" in msgs[0]


@needs_max_model_len
def test_a_cpu_tier_that_holds_the_longest_request_is_not_warned(
    tmp_path, make_engine, caplog
) -> None:
    caplog.set_level(logging.WARNING, logger="nvmetier")
    make_engine([nvme_tier(str(tmp_path / "a"))], cpu_chunks=CPU_CHUNKS, max_model_len=13 * 16)
    make_engine([nvme_tier(str(tmp_path / "b"))], cpu_chunks=CPU_CHUNKS)  # length unknown
    assert not [m for m in _warnings(caplog) if "cpu_bytes_to_use" in m]


def test_hits_not_loaded_is_a_labelled_counter() -> None:
    defs = NvmeTierManager.build_metric_definitions({})
    meta = defs[f"{METRIC_PREFIX}hits_not_loaded"]
    assert type(meta).__name__ == "OffloadingCounterMetadata"
    assert meta.labelnames == ("tier",)
    assert METRIC_PREFIX + "hits_not_loaded" == "vllm:nvmetier_hits_not_loaded"


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, "half", True])
def test_a_bad_promotion_fraction_is_refused_naming_the_range(tmp_path, bad: object) -> None:
    from nvmetier.config import TierConfig

    with pytest.raises(ConfigError, match=r"promotion_fraction=.* \(0, 1\]"):
        TierConfig.from_dict(
            {"root_dir": str(tmp_path), "capacity_bytes": "1MiB", "promotion_fraction": bad}
        )


# ------------------------------------------------------------ the guard alone
class _Ctx:
    def __init__(self, req_id: str) -> None:
        self.req_id = req_id


def test_hits_not_loaded_are_logged_at_most_once_a_minute_with_the_count(caplog) -> None:
    from nvmetier.vllm.promotion import PromotionGuard

    caplog.set_level(logging.WARNING, logger="nvmetier")
    guard = PromotionGuard(13, tier_label="1:nvme")
    for step in range(3):
        ctx = _Ctx(f"r{step}")
        assert guard.admits(b"k%d" % step, ctx)
        guard.note_hit(b"k%d" % step, ctx)
        guard.end_step()  # no submit_load took it
    msgs = [m for m in _warnings(caplog) if "were not loaded" in m]
    assert len(msgs) == 1 and "1 disk hits of 1 requests" in msgs[0]
    assert guard.stats()["hits_not_loaded"] == 3


def test_a_loaded_hit_is_not_counted_and_a_round_lasts_one_step() -> None:
    from nvmetier.vllm.promotion import PromotionGuard

    guard = PromotionGuard(4)
    ctx = _Ctx("r")
    for key in (b"a", b"b"):
        assert guard.admits(key, ctx)
        guard.note_hit(key, ctx)
    guard.note_loaded([b"a", b"b"])
    guard.end_step()
    got = guard.stats()
    assert (got["hits_not_loaded"], got["lookups_withheld"]) == (0, 0)
    assert not guard.admits(b"c", ctx)  # the next step: the round is over
    assert guard.admits(b"c", _Ctx("other"))  # another request is not
    guard.finish("r")
    assert guard.admits(b"c", ctx)  # forgotten once finished
    assert guard.stats()["lookups_withheld"] == 1
