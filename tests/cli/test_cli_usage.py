"""``nvmetier`` command line: help, exit codes, JSON, one-line user errors.

Runs ``python -m nvmetier.cli`` in subprocesses on stores written with
``BlockStore`` directly (no vLLM needed).
"""

from __future__ import annotations

import importlib.util
import os
import pty
import subprocess
import sys

import pytest

from nvmetier.files import INDEX_NAME, SUPERBLOCK_NAME
from tests.cli.clikit import REPO, assert_one_line_error, run_cli, run_json
from tests.fault.faultkit import (
    flip_bit,
    key,
    open_store,
    read_superblock,
    snapshot,
    store_dir,
    store_keys,
)

pytestmark = pytest.mark.timeout(120)

N_KEYS = 16


def _write_store(root: str, buf: memoryview, trial: int = 0) -> None:
    store = open_store(root, buf)
    assert store_keys(store, buf, [key(i, trial) for i in range(N_KEYS)]).success
    store.close()


@pytest.fixture
def root(tmp_path, buf) -> str:
    r = str(tmp_path / "kv")
    _write_store(r, buf)
    return r


def _corrupt_index(root: str) -> None:
    flip_bit(os.path.join(store_dir(root), INDEX_NAME), 5, 0)  # slot 0's record


# ---------------------------------------------------------------------- help
@pytest.mark.parametrize("command", [[], ["fsck"], ["info"]], ids=["nvmetier", "fsck", "info"])
def test_help_works_for_every_command(command) -> None:
    proc = run_cli(*command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: nvmetier")


def test_top_level_help_lists_every_command() -> None:
    out = run_cli("--help").stdout
    assert all(c in out for c in ("fsck", "info", "bench"))


def test_bench_help_is_delegated_or_a_one_line_error() -> None:
    proc = run_cli("bench", "--help")
    if importlib.util.find_spec("nvmetier.bench") is None:
        assert proc.returncode == 8
        assert_one_line_error(proc)
    else:
        assert proc.returncode == 0, proc.stderr
        assert "usage" in proc.stdout.lower()


# -------------------------------------------------------------- user errors
@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["fsck", "{tmp}/missing"], 8),
        (["info", "{tmp}/missing"], 8),
        (["fsck", "{tmp}/file"], 8),
        (["fsck", "{tmp}/empty"], 8),
        (["info", "{tmp}/empty"], 8),
        (["fsck", "--json", "{tmp}/missing"], 8),
        (["fsck"], 16),
        (["frobnicate"], 16),
        ([], 16),
        (["fsck", "{tmp}/empty", "--bogus"], 16),
    ],
    ids=[
        "fsck-missing-root",
        "info-missing-root",
        "fsck-root-is-a-file",
        "fsck-no-store",
        "info-no-store",
        "fsck-json-missing-root",
        "fsck-no-root",
        "unknown-command",
        "no-command",
        "unknown-option",
    ],
)
def test_user_error_is_one_line_without_traceback(tmp_path, args, code) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    proc = run_cli(*(a.format(tmp=tmp_path) for a in args))
    assert proc.returncode == code
    assert_one_line_error(proc)


def test_json_mode_reports_a_root_level_error_as_json(tmp_path) -> None:
    code, out = run_json("fsck", str(tmp_path / "missing"))
    assert code == 8 and out["exit_code"] == 8 and "does not exist" in out["error"]


# ---------------------------------------------------------------- exit codes
def test_fsck_of_a_clean_store_exits_0(root) -> None:
    proc = run_cli("fsck", "--deep", root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{N_KEYS} live" in proc.stdout and "clean" in proc.stdout


def test_fsck_accepts_a_store_directory_as_root(root) -> None:
    code, out = run_json("fsck", store_dir(root))
    assert code == 0 and [s["path"] for s in out["stores"]] == [store_dir(root)]


def test_fsck_of_a_corrupt_store_exits_4(root) -> None:
    _corrupt_index(root)
    code, out = run_json("fsck", root)
    assert code == 4
    (store,) = out["stores"]
    assert [(e["slot"], e["kind"]) for e in store["errors"]] == [(0, "record")]
    assert store["repaired"] == 0 and store["exit_code"] == 4


def test_fsck_repair_exits_1_and_a_second_fsck_exits_0(root) -> None:
    _corrupt_index(root)
    code, out = run_json("fsck", "--repair", root)
    assert code == 1 and out["stores"][0]["repaired"] == 1
    assert run_cli("fsck", "--deep", root).returncode == 0


def test_fsck_of_a_store_with_a_bad_superblock_exits_4(root) -> None:
    flip_bit(os.path.join(store_dir(root), SUPERBLOCK_NAME), 30, 1)
    code, out = run_json("fsck", root)
    assert code == 4 and out["stores"][0]["errors"][0]["kind"] == "superblock"


def test_fsck_of_a_truncated_data_file_exits_4_with_deep(root) -> None:
    path = os.path.join(store_dir(root), "data")
    os.truncate(path, os.path.getsize(path) // 2)
    code, out = run_json("fsck", "--deep", root)
    assert code == 4
    assert "data_size" in {e["kind"] for e in out["stores"][0]["errors"]}


def test_fsck_exit_codes_of_several_stores_are_or_ed(tmp_path, buf) -> None:
    root = str(tmp_path / "kv")
    _write_store(root, buf)
    other = str(tmp_path / "kv2")
    _write_store(other, buf, trial=1)
    os.rename(store_dir(other), os.path.join(root, "second-store"))
    _corrupt_index(root)
    code, out = run_json("fsck", root)
    assert code == 4
    assert sorted(s["exit_code"] for s in out["stores"]) == [0, 4]


def test_fsck_repair_of_a_store_in_use_exits_8_naming_the_pid(root, buf) -> None:
    store = open_store(root, buf)
    try:
        proc = run_cli("fsck", "--repair", root)
    finally:
        store.close()
    assert proc.returncode == 8
    assert_one_line_error(proc)
    assert f"in use by another process (pid {os.getpid()})" in proc.stderr
    assert "refuses" in proc.stderr


def test_fsck_checks_a_live_store_read_only_and_names_its_sharers(root, buf) -> None:
    store = open_store(root, buf)
    try:
        before = snapshot(root)
        proc = run_cli("fsck", "--deep", root)
        code, out = run_json("fsck", root)
        after = snapshot(root)
    finally:
        store.close()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"pid {os.getpid()}" in proc.stdout
    assert code == 0 and out["stores"][0]["sharers"] == [os.getpid()]
    assert after == before


def test_fsck_of_a_live_store_still_reports_real_corruption(root, buf) -> None:
    _corrupt_index(root)
    store = open_store(root, buf)  # the open drops the bad record itself
    try:
        _corrupt_index(root)  # corrupt it again while the store is attached
        proc = run_cli("fsck", root)
    finally:
        store.close()
    assert proc.returncode == 4, proc.stdout


def test_read_only_fsck_changes_no_file(root) -> None:
    _corrupt_index(root)
    before = snapshot(root)
    assert run_cli("fsck", "--deep", root).returncode == 4
    assert snapshot(root) == before


# --------------------------------------------------------------------- info
def test_info_json_reports_geometry_usage_and_engines(root) -> None:
    code, out = run_json("info", root)
    assert code == 0
    (s,) = out["stores"]
    sb = read_superblock(store_dir(root))
    assert s["slots_total"] == sb.n_slots and s["slots_used"] == N_KEYS
    assert s["bytes_used"] == N_KEYS * sb.slot_bytes
    assert sum(s["ages"].values()) == N_KEYS
    assert s["clean_shutdown"] is True and s["in_use_by"] is None
    assert s["identity"]["model_name"] == "fault/test"
    m = out["machine"]
    assert isinstance(m["uring_usable"], bool) and m["uring_reason"]
    assert isinstance(m["o_direct_usable"], bool) and m["o_direct_reason"]
    pages = m["cpu_tier_pages"]
    assert pages["shm_dir"] == "/dev/shm"
    assert "error" in pages or 0.0 <= pages["huge_page_share"] <= 1.0


def test_info_says_which_pages_vllms_cpu_tier_gets_here(root) -> None:
    proc = run_cli("info", root)
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if "CPU tier pages:" in ln)
    assert "/dev/shm huge=" in line
    assert ("4 KiB pages" in line) or ("2 MiB huge pages" in line) or ("unknown" in line)


def test_info_reports_a_store_in_use(root, buf) -> None:
    store = open_store(root, buf)
    try:
        proc = run_cli("info", root)
    finally:
        store.close()
    assert proc.returncode == 0, proc.stderr
    assert f"in use:          yes, by pid {os.getpid()}" in proc.stdout


def test_info_counts_bad_records(root) -> None:
    _corrupt_index(root)
    code, out = run_json("info", root)
    assert code == 0 and out["stores"][0]["bad_records"] == 1
    assert out["stores"][0]["slots_used"] == N_KEYS - 1


# ----------------------------------------------------------------- progress
def test_progress_bar_only_on_a_terminal(root) -> None:
    piped = run_cli("fsck", "--deep", root)
    assert piped.returncode == 0 and "\r" not in piped.stderr + piped.stdout
    master, slave = pty.openpty()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "nvmetier.cli", "fsck", "--deep", root],
            stdout=subprocess.PIPE,
            stderr=slave,
            cwd=REPO,
            timeout=60,
        )
        os.close(slave)
        slave = -1
        chunks = []
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the terminal's other side is closed
                break
            if not data:
                break
            chunks.append(data)
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)
    assert proc.returncode == 0
    assert b"\r" in b"".join(chunks) and b"reading" in b"".join(chunks)


# ------------------------------------------------------------ striped stores
def test_fsck_of_a_striped_store_reports_other_paths_unchecked(tmp_path, buf) -> None:
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    store = open_store(roots, buf)
    assert store_keys(store, buf, [key(i) for i in range(N_KEYS)]).success
    store.close()
    code, out = run_json("fsck", "--deep", roots[0])
    (s,) = out["stores"]
    assert code == 0 and s["n_paths"] == 2 and s["live"] == N_KEYS
    assert s["deep_checked"] + s["deep_unchecked"] == N_KEYS and s["deep_unchecked"] > 0


def test_fsck_of_a_secondary_root_says_where_the_superblock_is(tmp_path, buf) -> None:
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    open_store(roots, buf).close()
    proc = run_cli("fsck", roots[1])
    assert proc.returncode == 8
    assert_one_line_error(proc)
    assert "first root_dir entry" in proc.stderr
