"""``nvmetier purge`` and ``nvmetier info --retention`` on the command line:
output, exit codes, JSON, one-line user errors."""

from __future__ import annotations

import nvmetier._table as _table
import pytest

from tests.cli.clikit import assert_one_line_error, run_cli, run_json
from tests.fault.faultkit import key, open_store, store_keys

pytestmark = pytest.mark.timeout(120)

S = 1_000_000_000


@pytest.fixture
def root(tmp_path, buf) -> str:
    r = str(tmp_path / "kv")
    store = open_store(r, buf)
    _table._set_wall_clock_offset_ns(-2 * 86400 * S)  # two days ago
    try:
        assert store_keys(store, buf, [key(i) for i in range(6)]).success
    finally:
        _table._set_wall_clock_offset_ns(0)
    assert store_keys(store, buf, [key(100 + i) for i in range(4)], job_id=2).success
    store.close()
    return r


def test_purge_older_than_prints_what_it_removed_and_exits_0(root) -> None:
    proc = run_cli("purge", root, "--older-than", "1d")
    assert proc.returncode == 0, proc.stderr
    assert "removed 6 chunks" in proc.stdout and "no process attached" in proc.stdout
    code, out = run_json("info", root)
    assert code == 0 and out["stores"][0]["slots_used"] == 4


def test_purge_all_json(root) -> None:
    code, out = run_json("purge", root, "--all")
    assert code == 0 and out["exit_code"] == 0 and out["all"] is True
    (s,) = out["stores"]
    assert s["removed"] == 10 and s["error"] is None and s["model"] == "fault/test"


def test_purge_of_a_live_store_exits_0_and_the_process_sees_misses(root, buf) -> None:
    store = open_store(root, buf)
    try:
        proc = run_cli("purge", root, "--all")
        assert proc.returncode == 0, proc.stderr
        assert "removed 10 chunks" in proc.stdout
        assert not any(store.contains(key(100 + i)) for i in range(4))
    finally:
        store.close()


def test_purge_of_a_store_held_exclusively_exits_4(root, buf) -> None:
    store = open_store(root, buf, sharing="process")
    try:
        proc = run_cli("purge", root, "--all")
    finally:
        store.close()
    assert proc.returncode == 4
    assert "not purged" in proc.stdout and "exclusively" in proc.stdout


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["purge", "{root}"], 16),
        (["purge", "{root}", "--all", "--older-than", "1h"], 16),
        (["purge", "{root}", "--older-than", "soon"], 16),
        (["purge", "{tmp}/missing", "--all"], 8),
        (["purge", "{root}", "--all", "--model", "nope"], 8),
        (["info", "{root}", "--retention", "-1h"], 16),
    ],
    ids=["no-what", "both", "bad-duration", "missing-root", "no-such-model", "bad-retention"],
)
def test_purge_user_errors_are_one_line(tmp_path, root, args, code) -> None:
    proc = run_cli(*(a.format(tmp=tmp_path, root=root) for a in args))
    assert proc.returncode == code
    assert_one_line_error(proc)


def test_info_reports_ages_against_a_given_retention(root) -> None:
    code, out = run_json("info", root, "--retention", "1d")
    assert code == 0
    (s,) = out["stores"]
    assert s["retention_s"] == 86400 and s["retention_source"] == "--retention"
    assert s["past_retention"] == 6
    assert sum(s["retention_ages"].values()) == 10
    text = run_cli("info", root, "--retention", "1d").stdout
    assert "6 records past it" in text


def test_info_reports_the_retention_of_the_latest_opener(root, buf) -> None:
    store = open_store(root, buf, retention="36h")
    store.close()
    code, out = run_json("info", root)
    assert code == 0
    (s,) = out["stores"]
    assert s["retention_s"] == 36 * 3600 and s["retention_source"] == "table"
    assert s["past_retention"] == 6
