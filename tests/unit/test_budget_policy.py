"""The root budget's configuration keys and policy arithmetic (no disk)."""

from __future__ import annotations

import pytest

from nvmetier import budget
from nvmetier.config import TierConfig
from nvmetier.errors import ConfigError

GiB = 1 << 30


def cfg(**over) -> TierConfig:
    return TierConfig.from_dict({"root_dir": "/tmp/x", "capacity_bytes": "8GiB", **over})


def test_budget_keys_take_sizes_and_default_to_unbounded() -> None:
    c = cfg(root_budget_bytes="500GiB", min_capacity_bytes="2GiB", fs_reserve_bytes="2GiB")
    assert (c.root_budget_bytes, c.min_capacity_bytes, c.fs_reserve_bytes) == (
        500 * GiB,
        2 * GiB,
        2 * GiB,
    )
    d = cfg()
    assert d.root_budget_bytes is None and d.min_capacity_bytes is None
    assert d.fs_reserve_bytes is None and d.fs_reserve_fraction == 0.05


@pytest.mark.parametrize(
    ("over", "words"),
    [
        ({"root_budget_bytes": "lots"}, "root_budget_bytes='lots'"),
        ({"root_budget_bytes": 0}, "root_budget_bytes=0"),
        ({"min_capacity_bytes": "9GiB"}, "min_capacity_bytes="),
        ({"fs_reserve_fraction": 1.5}, "fs_reserve_fraction=1.5"),
        ({"fs_reserve_fraction": True}, "fs_reserve_fraction=True"),
    ],
)
def test_bad_budget_values_name_the_key_and_value(over, words) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        cfg(**over)


def test_the_filesystem_reserve_is_a_few_percent_at_least_1_gib() -> None:
    p = budget.Policy()
    assert p.reserve_bytes(100 * GiB) == 5 * GiB
    assert p.reserve_bytes(10 * GiB) == GiB
    # A small dedicated volume is not left unusable: half of it.
    assert p.reserve_bytes(96 << 20) == 48 << 20
    assert budget.Policy(fs_reserve_bytes=2 * GiB).reserve_bytes(GiB) == 2 * GiB
    assert budget.Policy(fs_reserve_bytes=0, fs_reserve_fraction=0).reserve_bytes(GiB) == 0
    assert cfg(fs_reserve_bytes=0).fs_reserve_bytes == 0


def test_the_floor_is_a_quarter_of_capacity_unless_stated() -> None:
    assert budget.Policy().floor_bytes(8 * GiB) == 2 * GiB
    assert budget.Policy(min_capacity_bytes=8 * GiB).floor_bytes(8 * GiB) == 8 * GiB
    assert budget.Policy.from_config(cfg(root_budget_bytes="1TiB")).budget_bytes == 1 << 40
