"""Filesystems a store can live on (issue 15, item 8), and the space error.

The filesystem type is injected (``nvmetier.store_dir.fs_type``, a test hook):
the checks are about what the store does on NFS, overlayfs or btrfs, which
this machine need not have.
"""

from __future__ import annotations

import collections
import logging
import os
import re

import pytest

from nvmetier import files, store_dir
from nvmetier.errors import ConfigError, StoreSpaceError
from nvmetier.files import INDEX_NAME, TABLE_NAME, StoreFiles

ROW = 65536
IDENTITY = {"model_name": "fs-test", "chunk_bytes": ROW}

NETWORK = {
    "NFS": 0x6969,
    "SMB": 0x517B,
    "SMB2": 0xFE534D42,
    "CIFS": 0xFF534D42,
    "Lustre": 0x0BD00BD0,
    "CephFS": 0x00C36400,
    "GPFS": 0x47504653,
    "BeeGFS": 0x19830326,
    "FUSE": 0x65735546,
}
OVERLAY, BTRFS, ZFS = 0x794C7630, 0x9123683E, 0x2FC12FC1


def open_files(root: str, sharing: str = "node") -> StoreFiles:
    return StoreFiles.open(
        [root],
        "store",
        capacity_bytes=8 << 20,
        chunk_bytes=ROW,
        ways=8,
        identity=IDENTITY,
        o_direct=False,
        sharing=sharing,
    )


@pytest.fixture
def fs(monkeypatch):
    """Set the filesystem type every directory reports."""

    def set_type(kind: int) -> None:
        monkeypatch.setattr(store_dir, "fs_type", lambda _path: kind)

    return set_type


def test_statfs_reads_this_machines_filesystem_type(tmp_path) -> None:
    assert files.statfs_type(str(tmp_path)) != 0
    assert files.statfs_type("/proc") == 0x9FA0  # PROC_SUPER_MAGIC


@pytest.mark.parametrize("name", sorted(NETWORK))
def test_sharing_node_is_refused_on_a_network_filesystem(tmp_path, fs, name) -> None:
    fs(NETWORK[name])
    root = str(tmp_path / "kv")
    with pytest.raises(ConfigError) as err:
        open_files(root)
    msg = str(err.value)
    assert name in msg
    assert 'sharing: "process"' in msg
    assert "'fs' tier" in msg
    assert os.listdir(root) == []  # refused before anything was created


@pytest.mark.parametrize("name", ["NFS", "FUSE"])
def test_sharing_process_opens_on_a_network_filesystem(tmp_path, fs, name) -> None:
    fs(NETWORK[name])
    open_files(str(tmp_path / "kv"), sharing="process").close()


def test_overlayfs_warns_that_containers_do_not_share(tmp_path, fs, caplog) -> None:
    fs(OVERLAY)
    with caplog.at_level(logging.WARNING, logger="nvmetier"):
        open_files(str(tmp_path / "kv")).close()
    assert any("overlayfs" in r.getMessage() for r in caplog.records)


def _fully_written(path: str) -> bool:
    """No hole and no unwritten (fallocated) extent: SEEK_HOLE finds the end."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.lseek(fd, 0, os.SEEK_HOLE) == os.fstat(fd).st_size
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", [BTRFS, ZFS], ids=["btrfs", "zfs"])
def test_mapped_files_are_written_in_full_where_fallocate_reserves_nothing(
    tmp_path, fs, kind
) -> None:
    fs(kind)
    f = open_files(str(tmp_path / "kv"))
    try:
        for name in (INDEX_NAME, TABLE_NAME):
            assert _fully_written(os.path.join(f.dirs[0], name)), name
    finally:
        f.close()


def test_the_space_error_gives_readable_sizes_and_the_fix(tmp_path, monkeypatch) -> None:
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(files.shutil, "disk_usage", lambda _p: usage(1 << 40, 0, 5 << 20))
    with pytest.raises(StoreSpaceError) as err:
        open_files(str(tmp_path / "kv"))
    msg = str(err.value)
    assert re.search(r"\d{6,}", msg.replace(str(tmp_path), "")) is None, msg
    assert "5.00 MiB free" in msg
    assert "lower capacity_bytes" in msg
    assert "fits" in msg
