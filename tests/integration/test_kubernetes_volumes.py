"""What Kubernetes volumes do to a store, played on real files
(docs/operations.md, "Kubernetes"): a pod's ``securityContext`` (a non-root
``runAsUser``, an ``fsGroup``), the kubelet's ownership change of a volume
under ``fsGroup``, a Secret's key file, and how a preallocated store counts
against an ``emptyDir``'s ``sizeLimit`` (allocated blocks, as ``du``).

The pod's user is played by a forked child that drops to uid 1000 with
fsGroup 2000 as a supplementary group (so it needs root; skipped otherwise),
and the kubelet by the parent, doing what ``SetVolumeOwnership``
(kubernetes ``pkg/volume/volume_linux.go``) does under ``fsGroup``: chown
every file to the group, chmod files ``| 0660`` (``| 0440`` on a read-only
volume such as a Secret), directories ``| 0660 | 0110 | setgid``.
"""

from __future__ import annotations

import json
import mmap
import os
import stat
import subprocess
import tempfile
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from nvmetier import crypto
from nvmetier.errors import ConfigError
from tests.integration.helpers import ROW, key, load_keys, make_store, store_keys

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0, reason="switching to the pod's uid needs root"),
]

RUN_AS_USER = 1000  # securityContext.runAsUser (and runAsGroup)
FS_GROUP = 2000  # securityContext.fsGroup
KEYS = [key(i) for i in range(8)]


def as_pod_user(fn: Callable[[], Any], uid: int = RUN_AS_USER) -> Any:
    """``fn()`` in a forked child running as the pod's user (uid and gid
    ``uid``, supplementary group fsGroup, umask 022 as container runtimes set);
    its JSON-able result, or the child's exception re-raised as
    ``ChildError``."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(read_fd)
            os.setgroups([FS_GROUP])
            os.setgid(uid)
            os.setuid(uid)
            os.umask(0o022)
            out: dict[str, Any] = {"result": fn()}
        except BaseException as exc:
            code = 1
            out = {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}
        with os.fdopen(write_fd, "w") as f:
            json.dump(out, f)
        os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        data = f.read()
    os.waitpid(pid, 0)
    out = json.loads(data)
    if "error" in out:
        raise ChildError(out["error"], out["tb"])
    return out["result"]


class ChildError(Exception):
    """An exception the pod user's child raised (its message and traceback)."""


def kubelet_set_volume_ownership(root: str, read_only: bool = False) -> None:
    """What the kubelet does to a volume's files under ``fsGroup``
    (``SetVolumeOwnership`` with ``fsGroupChangePolicy: Always``, at every
    mount; ``OnRootMismatch`` skips it when the root already matches)."""
    mask = 0o440 if read_only else 0o660
    for d, _dirs, files in os.walk(root):
        for path in [d, *(os.path.join(d, f) for f in files)]:
            st = os.lstat(path)
            os.lchown(path, -1, FS_GROUP)
            extra = mask | stat.S_ISGID | 0o110 if stat.S_ISDIR(st.st_mode) else mask
            os.chmod(path, stat.S_IMODE(st.st_mode) | extra)


@pytest.fixture
def volume() -> Iterator[str]:
    """An emptyDir as the kubelet makes it for a pod with ``fsGroup``: a
    directory 0777 | setgid, group fsGroup, under a folder the pod's user
    can reach (pytest's own tmp_path is private to root)."""
    base = tempfile.mkdtemp(prefix="nvmetier-k8s-")
    os.chmod(base, 0o755)
    path = os.path.join(base, "kv")
    os.mkdir(path)
    os.chown(path, 0, FS_GROUP)
    os.chmod(path, 0o777 | stat.S_ISGID)
    try:
        yield path
    finally:
        subprocess.run(["rm", "-rf", base], check=False, timeout=60)


def fill_store(root: str, **config: Any) -> dict[str, Any]:
    """In the pod: open a store, store and load back chunks, close it."""
    mm = mmap.mmap(-1, 64 * ROW)
    buffer = memoryview(mm)
    try:
        store = make_store(root, buffer, **config)
        try:
            (stored,) = store_keys(store, buffer, KEYS)
            loaded, good = load_keys(store, buffer, KEYS)
        finally:
            store.close()
        return {"stored": stored.success, "loaded": loaded.success, "good": len(good)}
    finally:
        buffer.release()
        mm.close()


def reload_store(root: str, **config: Any) -> int:
    """In the pod: reopen the store and count the chunks that load verified."""
    mm = mmap.mmap(-1, 64 * ROW)
    buffer = memoryview(mm)
    try:
        store = make_store(root, buffer, **config)
        try:
            _outcome, good = load_keys(store, buffer, KEYS)
        finally:
            store.close()
        return len(good)
    finally:
        buffer.release()
        mm.close()


def modes(root: str) -> dict[str, tuple[int, int, int]]:
    """path relative to ``root`` -> (permission bits with setgid, uid, gid)."""
    out: dict[str, tuple[int, int, int]] = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(d, name))
            mode = stat.S_IMODE(st.st_mode) & (0o777 | stat.S_ISGID)
            out[os.path.relpath(os.path.join(d, name), root)] = (mode, st.st_uid, st.st_gid)
    return out


def test_store_of_a_non_root_pod_is_private_to_its_user_in_the_fsgroup_volume(volume) -> None:
    assert as_pod_user(lambda: fill_store(volume)) == {"stored": True, "loaded": True, "good": 8}
    found = modes(volume)
    assert "store" in found and "store/data" in found
    for path, (mode, uid, gid) in found.items():
        # Owned by runAsUser; the group is fsGroup (the setgid volume root);
        # directories 0700 (setgid inherited), files 0600: nobody else in
        # fsGroup reads the KV.
        assert uid == RUN_AS_USER, path
        assert gid == FS_GROUP, path
        want = 0o700 | stat.S_ISGID if os.path.isdir(os.path.join(volume, path)) else 0o600
        assert mode == want, f"{path}: {mode:o}"


def test_store_stays_usable_after_the_kubelet_regroups_the_volume(volume) -> None:
    # A persistent volume under fsGroupChangePolicy: Always: at the next
    # pod's mount the kubelet adds group rw to every file of the store.
    as_pod_user(lambda: fill_store(volume))
    kubelet_set_volume_ownership(volume)
    assert modes(volume)["store/data"][0] == 0o660
    assert as_pod_user(lambda: reload_store(volume)) == len(KEYS)


def test_pod_of_another_user_is_refused_the_store_naming_its_directory(volume) -> None:
    as_pod_user(lambda: fill_store(volume))
    with pytest.raises(ChildError, match=r"store directory .*store' is not writable"):
        as_pod_user(lambda: reload_store(volume), uid=RUN_AS_USER + 1)


def test_host_path_created_by_the_kubelet_is_refused_as_not_writable(volume) -> None:
    # hostPath with type DirectoryOrCreate: root's, 0755, no fsGroup applied.
    host_path = os.path.join(os.path.dirname(volume), "host")
    os.mkdir(host_path, 0o755)
    with pytest.raises(ChildError, match=r"root_dir .* is not writable by this process"):
        as_pod_user(lambda: fill_store(host_path))


def secret_key_file(directory: str, mode: int) -> str:
    """A key file as a Secret volume holds it: root-owned; under fsGroup,
    group fsGroup and ``defaultMode | 0440``."""
    path = os.path.join(directory, "kv.key")
    with open(path, "wb") as f:
        f.write(os.urandom(crypto.KEY_BYTES))
    os.chown(path, 0, FS_GROUP)
    os.chmod(path, mode)
    return path


def test_key_file_from_a_secret_under_fsgroup_is_refused_naming_its_mode(volume) -> None:
    secret_dir = os.path.join(os.path.dirname(volume), "secret")
    os.mkdir(secret_dir, 0o755)
    # defaultMode: 0400, and the kubelet's fsGroup ownership change of the
    # read-only Secret volume.
    path = secret_key_file(secret_dir, 0o400)
    kubelet_set_volume_ownership(secret_dir, read_only=True)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o440
    with pytest.raises(ChildError) as err:
        as_pod_user(lambda: crypto.load_key_file(path))
    message = str(err.value)
    assert ConfigError.__name__ in message and "mode 0440" in message and "chmod 600" in message


def test_key_file_copied_by_the_init_container_is_accepted(volume) -> None:
    secret_dir = os.path.join(os.path.dirname(volume), "secret")
    key_dir = os.path.join(os.path.dirname(volume), "key")  # the Memory emptyDir
    os.mkdir(secret_dir, 0o755)
    os.mkdir(key_dir)
    os.chown(key_dir, 0, FS_GROUP)
    os.chmod(key_dir, 0o777 | stat.S_ISGID)
    src = secret_key_file(secret_dir, 0o400)
    kubelet_set_volume_ownership(secret_dir, read_only=True)
    dst = os.path.join(key_dir, "kv.key")
    # The manifest's init container, run as the pod's user.
    subprocess.run(
        ["sh", "-c", f"install -m 0600 {src} {dst}"],
        check=True,
        user=RUN_AS_USER,
        group=RUN_AS_USER,
        extra_groups=[FS_GROUP],
        timeout=30,
    )
    st = os.stat(dst)
    assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o600, RUN_AS_USER)
    result = as_pod_user(lambda: fill_store(volume, encryption={"key_file": dst}))
    assert result == {"stored": True, "loaded": True, "good": len(KEYS)}


def du_bytes(path: str, *flags: str) -> int:
    out = subprocess.run(
        ["du", "-s", "--block-size=1", *flags, path],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return int(out.split()[0])


def test_preallocated_store_counts_in_full_against_a_size_limit(volume) -> None:
    # The kubelet measures an emptyDir as du does (allocated blocks): a new
    # store counts its whole capacity_bytes at creation, before any chunk is
    # written, and no file is sparse (apparent size = allocated size).
    capacity = 16 << 20
    mm = mmap.mmap(-1, 64 * ROW)
    buffer = memoryview(mm)
    try:
        store = make_store(volume, buffer, capacity_bytes=capacity)
        try:
            assert store.stats()["bytes_used"] == 0
            allocated = du_bytes(volume)
        finally:
            store.close()
    finally:
        buffer.release()
        mm.close()
    apparent = du_bytes(volume, "--apparent-size")
    assert 0.95 * capacity <= allocated <= capacity
    assert abs(apparent - allocated) <= 0.01 * capacity
