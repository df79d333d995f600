"""The kept ``staging`` file and the probe's scratch files against hostile
or broken states: corrupt, truncated, wrong-version, deeply nested or
mistyped JSON, a FIFO or a symlink in the file's place, a symlink at the
temporary path ``save`` writes, and a probe killed mid-way. Each must fall
back cleanly (the store probes again and says why in one warning), never
crash the open or ``nvmetier info``, never block, never follow a link
(about 2 s: two store opens with a probe)."""

from __future__ import annotations

import json
import logging
import mmap
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from nvmetier import staging_probe
from nvmetier.bench.tier import vllm_like_primary
from nvmetier.config import TierConfig
from nvmetier.info import format_info, info
from nvmetier.store import BlockStore
from nvmetier.store_dir import probe_o_direct

ROW = 256 << 10


def _good(**over: Any) -> dict[str, Any]:
    res: dict[str, Any] = {
        "staging": "on",
        "why": "staging on: it moves more bytes",
        "chunk_bytes": ROW,
        "drives": 1,
        "measured_at": "2026-01-01T00:00:00Z",
    }
    res.update(over)
    return res


def _raw(content: str | bytes) -> bytes:
    return content.encode() if isinstance(content, str) else content


def _file(engines: Any, version: Any = 1) -> str:
    return json.dumps({"version": version, "engines": engines})


HOSTILE: dict[str, str | bytes] = {
    "deep_array": "[" * 100_000,
    "deep_object": '{"version": 1, "engines": ' + '{"a": ' * 50_000 + "1" + "}" * 50_001,
    "truncated": _file({"threads": _good()})[:40],
    "binary": b"\xff\xfe\x00\x01garbage",
    "huge_int": '{"version": 1, "engines": {"threads": ' + "9" * 5000 + "}}",
    "version_2": _file({"threads": _good()}, version=2),
    "version_str": _file({"threads": _good()}, version="1"),
    "version_true": _file({"threads": _good()}, version=True),
    "top_list": "[1, 2]",
    "engines_list": '{"version": 1, "engines": [1]}',
    "result_int": _file({"threads": 5}),
    "drives_true": _file({"threads": _good(drives=True)}),
    "chunk_str": _file({"threads": _good(chunk_bytes="262144")}),
    "chunk_negative": _file({"threads": _good(chunk_bytes=-ROW)}),
    "why_inf": _file({"threads": _good(why=float("inf"))}),
    "why_huge": _file({"threads": _good(why="x" * 500_000)}),
    "measured_at_list": _file({"threads": _good(measured_at=[1])}),
    "staging_maybe": _file({"threads": _good(staging="maybe")}),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_kept_file_is_ignored_with_one_clear_warning(name: str, tmp_path, caplog) -> None:
    (tmp_path / "staging").write_bytes(_raw(HOSTILE[name]))
    assert staging_probe.load(str(tmp_path)) == {}
    with caplog.at_level(logging.WARNING, logger="nvmetier.staging_probe"):
        assert staging_probe.kept(str(tmp_path), "threads", ROW, 1) is None
    (rec,) = caplog.records
    assert "ignoring the staging probe kept in" in rec.getMessage()
    assert str(tmp_path / "staging") in rec.getMessage()


def test_a_good_result_beside_a_malformed_one_is_kept(tmp_path, caplog) -> None:
    (tmp_path / "staging").write_text(_file({"threads": _good(), "uring": {"staging": 1}}))
    assert staging_probe.load(str(tmp_path)) == {"threads": _good()}
    with caplog.at_level(logging.WARNING, logger="nvmetier.staging_probe"):
        assert staging_probe.kept(str(tmp_path), "threads", ROW, 1) == _good()
    assert "engine(s) uring is malformed" in caplog.text
    # save() keeps the good one and drops the malformed one.
    staging_probe.save(str(tmp_path), "uring", _good(staging="off"))
    assert staging_probe.load(str(tmp_path)) == {"threads": _good(), "uring": _good(staging="off")}


def test_no_file_is_not_worth_a_warning(tmp_path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="nvmetier.staging_probe"):
        assert staging_probe.kept(str(tmp_path), "threads", ROW, 1) is None
    assert not caplog.records


def test_a_fifo_a_directory_or_a_symlink_in_its_place_is_refused_unread(tmp_path) -> None:
    target = tmp_path / "elsewhere.json"
    target.write_text(_file({"threads": _good()}))
    path = tmp_path / "staging"
    os.mkfifo(path)  # opening it for reading would block until a writer came
    t0 = time.monotonic()
    assert staging_probe._read(str(tmp_path)) == ({}, "it is not a regular file")
    assert time.monotonic() - t0 < 5
    path.unlink()
    path.mkdir()
    assert staging_probe._read(str(tmp_path))[0] == {}
    path.rmdir()
    path.symlink_to(target)
    results, why = staging_probe._read(str(tmp_path))
    assert results == {} and why is not None and "cannot be opened" in why
    path.unlink()
    with open(path, "wb") as f:  # past the size a kept result ever has
        f.truncate(staging_probe.MAX_FILE_BYTES + 1)
    results, why = staging_probe._read(str(tmp_path))
    assert results == {} and why is not None and "more than a kept result" in why


def test_save_never_follows_a_link_at_its_temporary_path(tmp_path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    tmp = tmp_path / f"staging.tmp-{os.getpid()}"
    tmp.symlink_to(victim)
    staging_probe.save(str(tmp_path), "threads", _good())
    assert victim.read_bytes() == b"keep me"
    assert staging_probe.load(str(tmp_path)) == {"threads": _good()}
    assert not tmp.exists() and not tmp.is_symlink()


@pytest.fixture
def shm_region() -> Iterator[mmap.mmap]:
    region = vllm_like_primary(8 * ROW, tag="test-attacks")
    yield region
    region.close()


def _open(root: str, region: mmap.mmap) -> BlockStore:
    return BlockStore(
        TierConfig.from_dict({"root_dir": root, "capacity_bytes": 16 << 20, "persist": True}),
        store_name="t",
        identity={"t": 1},
        buffer=memoryview(region),
        row_bytes=ROW,
        engine="threads",
    )


def test_a_store_over_a_hostile_file_opens_probes_and_replaces_it(
    shm_region: mmap.mmap, tmp_path, monkeypatch, caplog
) -> None:
    root = str(tmp_path)
    ok, why = probe_o_direct(root)
    if not ok:
        pytest.skip(f"O_DIRECT unavailable in {root}: {why}")
    staging_probe._MEMO.clear()
    monkeypatch.setattr(staging_probe, "_MEMO", {})
    _open(root, shm_region).close()
    store_dir = str(tmp_path / "t")
    assert os.path.isdir(store_dir)
    for content in (HOSTILE["deep_object"], HOSTILE["result_int"]):
        with open(os.path.join(store_dir, "staging"), "wb") as f:
            f.write(_raw(content))
        # info reads the kept file without opening the store.
        text = format_info(info(root))
        assert "staging (threads)" not in text
        staging_probe._MEMO.clear()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="nvmetier.staging_probe"):
            store = _open(root, shm_region)
        try:
            probed = store.describe()["staging_probe"]
            assert probed is not None and "kept with the store" not in store.staging_reason
        finally:
            store.close()
        assert "ignoring the staging probe kept in" in caplog.text
        assert staging_probe.load(store_dir) == {"threads": probed}


def test_a_probe_killed_mid_way_leaves_no_scratch_file(tmp_path) -> None:
    """SIGKILL at the worst moment (the scratch file made, not yet unlinked)
    leaves nothing on disk: no name to clean, nothing charged to the root."""
    ok, why = probe_o_direct(str(tmp_path))
    if not ok:
        pytest.skip(f"O_DIRECT unavailable in {tmp_path}: {why}")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child dies before it returns
        try:
            real_fallocate = os.posix_fallocate

            def die(fd: int, off: int, size: int) -> None:
                real_fallocate(fd, off, size)
                os.kill(os.getpid(), signal.SIGKILL)

            os.posix_fallocate = die  # type: ignore[assignment]
            os.unlink = lambda *_a, **_k: os.kill(os.getpid(), signal.SIGKILL)  # type: ignore[assignment]
            staging_probe._probe_files([str(tmp_path)], 1 << 20)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert os.listdir(tmp_path) == []
