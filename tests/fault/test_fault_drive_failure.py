"""The drive under a live store fails (its ext4 shut down, as when a device
drops off the bus), and a store is opened on a filesystem that answers every
file with an error: jobs fail with the errno, nothing raises on the data path,
the store closes, and an open says which store, which file, which error and
what to do (``StoreIOError``, still an ``OSError``).

The drive is a RAM-backed ext4 loop device (``nvmetier.bench.drives``): root,
losetup and mkfs.ext4, else skipped with the reason."""

from __future__ import annotations

import errno
import fcntl
import os

import pytest

from nvmetier import store as store_mod
from nvmetier.bench.drives import check_can_make_drives, loop_drives
from nvmetier.errors import NvmeTierError, StoreIOError
from tests.fault.faultkit import STORE_NAME, key, load_keys, open_store, store_keys

pytestmark = pytest.mark.timeout(120)

# FS_IOC_SHUTDOWN (_IOR('X', 125, __u32)); NOLOGFLUSH: the device is gone.
FS_IOC_SHUTDOWN = 0x8004587D
SHUTDOWN_NOLOGFLUSH = 2


def _shut_down(mountpoint: str) -> None:
    fd = os.open(mountpoint, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, FS_IOC_SHUTDOWN, SHUTDOWN_NOLOGFLUSH.to_bytes(4, "little"))
    finally:
        os.close(fd)


@pytest.mark.skipif(check_can_make_drives() is not None, reason=check_can_make_drives() or "")
def test_a_drive_that_fails_under_a_live_store_fails_jobs_never_the_caller(buf) -> None:
    with loop_drives(1, 96 << 20, lambda _m: None) as (mnt,):
        root = os.path.join(mnt, "kv")
        store = open_store(root, buf)
        try:
            first = [key(i) for i in range(16)]
            assert store_keys(store, buf, first).success
            _shut_down(mnt)
            # Every job fails (EIO), none raises; the chunks already stored
            # are not dropped for it (an I/O error is no proof of bad bytes):
            # a chunk whose read failed is a miss until rewritten, its record
            # kept.
            stored = store_keys(store, buf, [key(100 + i) for i in range(8)], job_id=3)
            assert not stored.success and not stored.successful_keys
            loaded, ok, wrong = load_keys(store, buf, first, job_id=4)
            assert not loaded.success and ok == [] and wrong == []
            stats = store.stats()
            assert stats["write_errors"] >= 8 and stats["read_errors"] >= 1
            assert stats["checksum_failures"] == 0 and stats["slots_used"] == len(first)
        finally:
            store.close()  # returns: the clean flag is not written, which is fine
        # A new open on the dead filesystem: one clear error, an OSError too.
        with pytest.raises(StoreIOError) as info:
            open_store(root, buf)
        err = info.value
        assert isinstance(err, OSError) and isinstance(err, NvmeTierError)
        assert err.errno == errno.EIO
        msg = str(err)
        assert STORE_NAME in msg and root in msg and "errno 5" in msg
        assert "dmesg" in msg and "another drive" in msg
        assert err.filename and err.filename.startswith(root)


def test_an_open_error_names_the_store_the_file_the_error_and_the_fix(
    tmp_path, buf, monkeypatch
) -> None:
    # The same message for every errno the filesystem can answer with; the
    # common ones get their own fix, the rest a generic one.
    root = str(tmp_path / "kv")
    where = os.path.join(root, STORE_NAME, "lock.init")
    for code, fix in [
        (errno.EROFS, "read-only"),
        (errno.EACCES, "owner or mode"),
        (errno.ENOSPC, "capacity_bytes"),
        (errno.ELOOP, "check the filesystem"),
    ]:

        def failing_open(*_a, _code=code, **_kw):
            raise OSError(_code, os.strerror(_code), where)

        monkeypatch.setattr(store_mod.StoreFiles, "open", failing_open)
        with pytest.raises(StoreIOError) as info:
            open_store(root, buf)
        msg = str(info.value)
        assert f"errno {code}" in msg and os.strerror(code) in msg and where in msg
        assert fix in msg
        assert info.value.errno == code


@pytest.mark.skipif(check_can_make_drives() is not None, reason=check_can_make_drives() or "")
def test_retention_drops_on_a_dead_drive_touch_only_memory(buf) -> None:
    # The index is a shared mapping: chunks that expire after the drive
    # failed are dropped (their records zeroed in the mapping, their index
    # pages written back clean before the failure) without a fault, and the
    # store still closes.
    import time

    with loop_drives(1, 96 << 20, lambda _m: None) as (mnt,):
        store = open_store(os.path.join(mnt, "kv"), buf, retention="2s")
        try:
            keys = [key(i) for i in range(32)]
            assert store_keys(store, buf, keys).success
            os.sync()  # the index pages are clean: a new write must fault them in
            _shut_down(mnt)
            time.sleep(2.2)
            assert not any(store.lookup(k) for k in keys)
            stats = store.stats()
            assert stats["retention_expired"] == len(keys) and stats["slots_used"] == 0
        finally:
            store.close()
