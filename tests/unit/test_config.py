"""TierConfig parsing and validation (no disk)."""

from __future__ import annotations

import pytest

from nvmetier.config import TierConfig, format_size, parse_size
from nvmetier.errors import ConfigError

BASE = {"root_dir": "/mnt/nvme/kv", "capacity_bytes": "1GiB"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("500GiB", 500 << 30),
        ("1.5TB", 1_500_000_000_000),
        ("64MiB", 64 << 20),
        ("64M", 64 << 20),
        ("4096", 4096),
        (4096, 4096),
        (" 2 gib ", 2 << 30),
    ],
)
def test_parse_size_accepts_units(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "abc", "10XB", "-5GiB", 0, -1, True, 1.5, None])
def test_parse_size_rejects_with_key_and_value(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(bad, "capacity_bytes")
    assert "capacity_bytes" in str(info.value)


def test_format_size_is_human_readable() -> None:
    assert format_size(1 << 30) == "1.00 GiB"
    assert format_size(10) == "10 B"


def test_defaults_apply() -> None:
    cfg = TierConfig.from_dict(BASE)
    assert cfg.root_dir == ("/mnt/nvme/kv",)
    assert cfg.capacity_bytes == 1 << 30
    assert cfg.io_engine == "auto"
    assert cfg.verify_checksums is True
    assert cfg.o_direct == "auto"
    assert cfg.persist is True


def test_unknown_key_names_it_and_suggests_the_closest() -> None:
    with pytest.raises(ConfigError) as info:
        TierConfig.from_dict({**BASE, "capacity_byte": "1GiB"})
    msg = str(info.value)
    assert "'capacity_byte'" in msg
    assert "did you mean 'capacity_bytes'" in msg
    assert "accepted keys" in msg


@pytest.mark.parametrize("missing", ["root_dir", "capacity_bytes"])
def test_missing_required_key_is_named(missing: str) -> None:
    raw = dict(BASE)
    del raw[missing]
    with pytest.raises(ConfigError, match=missing):
        TierConfig.from_dict(raw)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("io_engine", "spdk"),
        ("io_threads", 0),
        ("io_threads", "8"),
        ("ways", 0),
        ("ways", True),
        ("queue_depth", 100000),
        ("verify_checksums", "yes"),
        ("o_direct", "maybe"),
        ("enable_kv_events", 1),
        ("persist", None),
        ("admit_after_lookups", -1),
        ("locality", "mars"),
        ("max_inflight_bytes", "lots"),
        ("io_workers", 0),
        ("io_workers", 65),
        ("io_workers", "4"),
        ("io_workers", "many"),
        ("io_workers", True),
        ("io_workers", 2.0),
    ],
)
def test_bad_value_names_key_and_value(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        TierConfig.from_dict({**BASE, key: value})
    assert key in str(info.value)
    assert repr(value) in str(info.value) or str(value) in str(info.value)


def test_root_dir_list_is_one_path_per_drive() -> None:
    cfg = TierConfig.from_dict({**BASE, "root_dir": ["/a", "/b"]})
    assert cfg.root_dir == ("/a", "/b")


@pytest.mark.parametrize("roots", [[], ["/a", "/a"], [""], 5])
def test_bad_root_dir_list_is_rejected(roots: object) -> None:
    with pytest.raises(ConfigError, match="root_dir"):
        TierConfig.from_dict({**BASE, "root_dir": roots})


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        TierConfig.from_dict({**BASE, "ways": -3})


def test_io_workers_is_auto_by_default_and_takes_a_count() -> None:
    assert TierConfig.from_dict(BASE).io_workers == "auto"
    assert TierConfig.from_dict({**BASE, "io_workers": 4}).io_workers == 4


def test_io_workers_error_says_what_is_accepted() -> None:
    with pytest.raises(ConfigError, match="'auto' or an integer from 1 to 64"):
        TierConfig.from_dict({**BASE, "io_workers": 0})


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("24h", 86400.0), ("90s", 90.0), ("15m", 900.0), ("7d", 604800.0), (30, 30.0), ("45", 45.0)],
)
def test_retention_accepts_durations(text: object, seconds: float) -> None:
    assert TierConfig.from_dict({**BASE, "retention": text}).retention == seconds


def test_retention_is_off_by_default() -> None:
    assert TierConfig.from_dict(BASE).retention is None
    assert TierConfig.from_dict({**BASE, "retention": None}).retention is None


@pytest.mark.parametrize("bad", ["", "soon", "3w", "-5m", 0, -1, True, [1], float("nan")])
def test_retention_rejects_with_key_value_and_fix(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        TierConfig.from_dict({**BASE, "retention": bad})
    text = str(info.value)
    assert "retention" in text and repr(bad) in text and "'24h'" in text


def test_encryption_takes_a_key_file() -> None:
    cfg = TierConfig.from_dict({**BASE, "encryption": {"key_file": "/etc/nvmetier/key"}})
    assert cfg.encryption == {"key_file": "/etc/nvmetier/key"}
    assert TierConfig.from_dict(BASE).encryption is None


@pytest.mark.parametrize(
    "bad",
    ["/etc/key", {"keyfile": "/k"}, {"key_file": ""}, {"key_file": 3}, {"key_file": "/k", "x": 1}],
)
def test_encryption_rejects_other_shapes_with_the_fix(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        TierConfig.from_dict({**BASE, "encryption": bad})
    text = str(info.value)
    assert "encryption=" in text and "key_file" in text and "head -c 32 /dev/urandom" in text


@pytest.mark.parametrize("value", [-1, 1 << 21, True, "4096", 1.5])
def test_a_bad_recency_refresh_chunks_names_key_and_value(value: object) -> None:
    with pytest.raises(ConfigError, match="recency_refresh_chunks") as info:
        TierConfig.from_dict({**BASE, "recency_refresh_chunks": value})
    assert repr(value) in str(info.value)


def test_recency_refresh_is_on_by_default_and_zero_turns_it_off() -> None:
    assert TierConfig.from_dict(BASE).recency_refresh_chunks == 4096
    assert TierConfig.from_dict({**BASE, "recency_refresh_chunks": 0}).recency_refresh_chunks == 0
