"""The purge log's own module (issue 31, item 6): its format round-trips,
a log that is not whole is no log, and the data path reads it without
importing the purge command."""

from __future__ import annotations

import subprocess
import sys

from nvmetier import purge, purge_log


def test_a_log_round_trips_and_replaces_the_old_one(tmp_path) -> None:
    keys = [b"a" * 36, b"b" * 88, b""]
    purge_log.write_log(str(tmp_path), 3, 5, keys)
    assert purge_log.read_log(str(tmp_path)) == (3, 5, keys)
    purge_log.write_log(str(tmp_path), 6, 6, [b"c"])
    assert purge_log.read_log(str(tmp_path)) == (6, 6, [b"c"])
    assert purge_log.removed_since(str(tmp_path), 5) == [b"c"]
    assert purge_log.removed_since(str(tmp_path), 6) == []
    assert not [p for p in tmp_path.iterdir() if p.name != purge_log.LOG_NAME]


def test_a_log_that_is_not_whole_is_no_log(tmp_path) -> None:
    data = purge_log.pack_log(1, 2, [b"k" * 36, b"j" * 36])
    assert purge_log.unpack_log(data) == (1, 2, [b"k" * 36, b"j" * 36])
    for cut in (0, 31, 32, len(data) - 1):
        assert purge_log.unpack_log(data[:cut]) is None
    assert purge_log.unpack_log(b"X" + data[1:]) is None
    (tmp_path / purge_log.LOG_NAME).write_bytes(data[:40])
    assert purge_log.read_log(str(tmp_path)) == (0, 0, [])
    assert purge_log.read_log(str(tmp_path / "none")) == (0, 0, [])


def test_stale_temporary_logs_are_removed(tmp_path) -> None:
    (tmp_path / f"{purge_log.LOG_NAME}.tmp-12345").write_bytes(b"x")
    (tmp_path / "superblock").write_bytes(b"y")
    purge_log.remove_stale_logs(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["superblock"]


def test_the_purge_command_reexports_the_log_and_the_store_does_not_import_it() -> None:
    assert purge.read_log is purge_log.read_log and purge.write_log is purge_log.write_log
    assert purge.LOG_NAME == purge_log.LOG_NAME
    code = (
        "import sys, nvmetier.store; "
        "sys.exit('nvmetier.purge' in sys.modules or 'nvmetier.purge_log' not in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
