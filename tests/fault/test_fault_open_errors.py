"""Opening a store that cannot be used: one clear error, nothing changed.

Every test snapshots the directory tree (paths, modes, sizes, SHA-256 of
every file) before the failing open and compares it after.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest

from nvmetier import format as fmt
from nvmetier.errors import ConfigError, FormatError
from nvmetier.files import DATA_NAME, INDEX_NAME, SUPERBLOCK_NAME
from tests.fault.faultkit import (
    IDENTITY,
    key,
    open_store,
    read_superblock,
    snapshot,
    store_dir,
    store_keys,
)

pytestmark = pytest.mark.timeout(60)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def root(tmp_path, buf) -> str:
    """A closed store holding 8 keys."""
    r = str(tmp_path / "kv")
    store = open_store(r, buf)
    assert store_keys(store, buf, [key(i) for i in range(8)]).success
    store.close()
    return r


def _mark_crashed(root: str) -> None:
    """Make the superblock say 'not closed cleanly', as after a kill -9."""
    sdir = store_dir(root)
    sb = dataclasses.replace(read_superblock(sdir), clean=False)
    with open(os.path.join(sdir, SUPERBLOCK_NAME), "r+b") as f:
        f.write(fmt.pack_superblock(sb))


def test_second_process_gets_store_locked_error_naming_the_pid(root, buf) -> None:
    store = open_store(root, buf)
    try:
        before = snapshot(root)
        script = textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {REPO!r})
            from nvmetier.errors import StoreLockedError
            from tests.fault.faultkit import new_buffer, open_store
            try:
                open_store({root!r}, new_buffer(), sharing="process")
            except StoreLockedError as exc:
                print(exc)
                sys.exit(3)
            """
        )
        proc = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
        )
        after = snapshot(root)
    finally:
        store.close()
    assert proc.returncode == 3, proc.stderr
    assert f"pid {os.getpid()}" in proc.stdout
    assert after == before


def test_other_layout_identity_is_a_format_error_and_changes_nothing(root, buf) -> None:
    before = snapshot(root)
    with pytest.raises(FormatError, match="another layout identity"):
        open_store(root, buf, identity={**IDENTITY, "dtype": "bf16"})
    assert snapshot(root) == before


def test_truncated_data_file_is_a_format_error_and_changes_nothing(root, buf) -> None:
    path = os.path.join(store_dir(root), DATA_NAME)
    os.truncate(path, os.path.getsize(path) // 2)
    before = snapshot(root)
    with pytest.raises(FormatError, match="truncated"):
        open_store(root, buf)
    assert snapshot(root) == before


def test_missing_index_is_a_format_error_and_changes_nothing(root, buf) -> None:
    os.unlink(os.path.join(store_dir(root), INDEX_NAME))
    before = snapshot(root)
    with pytest.raises(FormatError, match="index"):
        open_store(root, buf)
    assert snapshot(root) == before


def test_failed_open_of_a_crashed_store_keeps_it_marked_unclean(root, buf) -> None:
    _mark_crashed(root)
    os.unlink(os.path.join(store_dir(root), INDEX_NAME))
    before = snapshot(root)
    with pytest.raises(FormatError):
        open_store(root, buf)
    assert snapshot(root) == before


def test_root_that_is_a_file_is_a_config_error_and_changes_nothing(tmp_path, buf) -> None:
    path = tmp_path / "kv"
    path.write_bytes(b"not a directory")
    before = snapshot(str(tmp_path))
    with pytest.raises(ConfigError, match="is a file"):
        open_store(str(path), buf)
    assert snapshot(str(tmp_path)) == before


@pytest.mark.skipif(
    os.geteuid() == 0, reason="root bypasses directory permissions, so chmod cannot stop writes"
)
def test_read_only_root_is_a_config_error_and_changes_nothing(tmp_path, buf) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        before = snapshot(str(tmp_path))
        with pytest.raises(ConfigError, match=r"writable|cannot be created"):
            open_store(str(ro / "kv"), buf)
        assert snapshot(str(tmp_path)) == before
    finally:
        ro.chmod(0o700)


def test_crash_restart_logs_one_line_however_many_records_it_drops(root, buf, caplog) -> None:
    # After a kill (every stop of `vllm serve`), the unfinished writes' records
    # are dropped: one line for the whole open, not one per slot.
    _mark_crashed(root)
    index = os.path.join(store_dir(root), INDEX_NAME)
    with open(index, "r+b") as f:
        for slot in range(64):  # garbage over several records
            f.seek(slot * fmt.RECORD_BYTES + 8)
            f.write(b"\xff" * 8)
    caplog.set_level("INFO", logger="nvmetier")
    store = open_store(root, buf)
    store.close()
    lines = [r for r in caplog.records if r.levelno >= 30]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert "not closed cleanly" in lines[0].getMessage()
    assert "records dropped" in lines[0].getMessage()
    assert "; 0 unfinished" not in lines[0].getMessage()
