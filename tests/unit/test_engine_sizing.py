"""How the engine is sized from the drives: worker count and bytes in flight
(pure functions, no engine started)."""

from __future__ import annotations

import os

import pytest

from nvmetier.engine import count_drives, inflight_bytes, resolve_workers, usable_cpus

KIB, MIB = 1 << 10, 1 << 20


@pytest.mark.parametrize(
    ("drives", "chunk", "cap", "expected"),
    [
        (1, 2 * MIB, 256 * MIB, 64 * MIB),  # 32 chunks of 2 MiB
        (2, 2 * MIB, 256 * MIB, 128 * MIB),  # per drive, so twice for two
        (2, 8 * MIB, 256 * MIB, 128 * MIB),  # 64 MiB per drive at most
        (1, 64 * KIB, 256 * MIB, 32 * MIB),  # 32 MiB per drive at least
        (8, 2 * MIB, 256 * MIB, 256 * MIB),  # capped by max_inflight_bytes
        (2, 2 * MIB, 16 * MIB, 16 * MIB),
    ],
)
def test_inflight_bytes_is_per_drive_and_capped(drives, chunk, cap, expected) -> None:
    assert inflight_bytes(drives, chunk, cap) == expected


def test_files_on_one_filesystem_are_one_drive(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("NVMETIER_IO_WORKERS", raising=False)
    fds = [os.open(tmp_path / f"f{i}", os.O_RDWR | os.O_CREAT, 0o600) for i in range(3)]
    try:
        assert count_drives(fds) == 1
        assert resolve_workers("auto", fds) == 1
    finally:
        for fd in fds:
            os.close(fd)


def test_staging_gives_each_drive_two_auto_workers_within_the_cpus(monkeypatch) -> None:
    import nvmetier.engine as engine

    monkeypatch.delenv("NVMETIER_IO_WORKERS", raising=False)
    monkeypatch.setattr(engine, "count_drives", lambda fds: 1)
    monkeypatch.setattr(engine, "usable_cpus", lambda: 8)
    assert resolve_workers("auto", [], per_drive=2) == 2
    assert resolve_workers("auto", []) == 1
    assert resolve_workers(3, [], per_drive=2) == 3  # an explicit count is kept
    monkeypatch.setattr(engine, "usable_cpus", lambda: 1)
    assert resolve_workers("auto", [], per_drive=2) == 1


def test_auto_workers_never_exceed_the_usable_cpus(tmp_path, monkeypatch) -> None:
    import nvmetier.engine as engine

    monkeypatch.delenv("NVMETIER_IO_WORKERS", raising=False)
    monkeypatch.setattr(engine, "count_drives", lambda fds: 16)
    assert resolve_workers("auto", []) == min(16, usable_cpus())
    assert resolve_workers(3, []) == 3


def test_nvmetier_io_workers_overrides_the_config(monkeypatch) -> None:
    monkeypatch.setenv("NVMETIER_IO_WORKERS", "3")
    assert resolve_workers("auto", []) == 3
    assert resolve_workers(1, []) == 3


@pytest.mark.parametrize("bad", ["0", "65", "two", "-1"])
def test_a_bad_nvmetier_io_workers_is_a_config_error(monkeypatch, bad) -> None:
    from nvmetier.errors import ConfigError

    monkeypatch.setenv("NVMETIER_IO_WORKERS", bad)
    with pytest.raises(ConfigError, match="NVMETIER_IO_WORKERS"):
        resolve_workers("auto", [])
