"""A simulated power loss with ``verify_checksums: false`` never serves
another key's bytes (issue 15, item 9).

A writer process (``kill_writer.py``) stores new keys into a small store, so
its slots are evicted and rewritten all the time. While it runs, the store's
files are copied at random instants, the index before the data files (what a
power loss can leave: the index page and the data reach the media at
different moments), and each copy is opened (a first attach after an unclean
shutdown: the superblock says the store was open) with verification on, and
off. Every chunk a load reports is compared with the bytes its key was stored
with: none may be another key's. With verification off that holds because the
table keeps every slot rebuilt after an unclean shutdown unverified (checked
at its next load) until one check passed.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from nvmetier.files import DATA_NAME
from tests.fault.faultkit import ROWS, STORE_NAME, key, load_keys, new_buffer, open_store

WRITER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kill_writer.py")
SLOW = os.environ.get("NVMETIER_SLOW") == "1"
COPIES = 16 if SLOW else 5
TRIAL = 77

pytestmark = pytest.mark.timeout(600)


def _copy(src: str, dst: str, rng: random.Random) -> None:
    """Copy the store directory ``src``: everything but the data files at one
    instant, the data files up to 30 ms later."""
    os.makedirs(dst)
    names = sorted(os.listdir(src))
    data = [n for n in names if n.startswith(DATA_NAME)]
    for n in names:
        if n not in data:
            shutil.copyfile(os.path.join(src, n), os.path.join(dst, n))
    time.sleep(rng.uniform(0.0, 0.03))
    for n in data:
        shutil.copyfile(os.path.join(src, n), os.path.join(dst, n))


def _submitted(journal: str) -> int:
    with open(journal, "rb") as f:
        lines = f.read().decode().split("\n")[:-1]
    return max((int(v) for t, _, v in (ln.partition(" ") for ln in lines) if t == "B"), default=0)


@pytest.fixture(scope="module")
def copies(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], int]:
    base = str(tmp_path_factory.mktemp("power_loss"))
    root = os.path.join(base, "kv")
    os.makedirs(root)
    journal = os.path.join(base, "journal")
    rng = random.Random(9)
    with open(os.path.join(base, "stderr"), "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, WRITER, root, journal, str(TRIAL)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
        )
    out: list[str] = []
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline() == b"ready\n"
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        time.sleep(0.3)  # past the first eviction: slots are being rewritten
        for i in range(COPIES):
            time.sleep(rng.uniform(0.0, 0.05))
            dst = os.path.join(base, f"copy{i}")
            _copy(os.path.join(root, STORE_NAME), os.path.join(dst, STORE_NAME), rng)
            out.append(dst)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return out, _submitted(journal)


@pytest.mark.parametrize("verify", [True, False])
def test_a_power_loss_copy_never_serves_another_keys_bytes(
    copies: tuple[list[str], int], verify: bool, tmp_path
) -> None:
    roots, submitted = copies
    assert submitted > 0
    keys = [key(i, TRIAL) for i in range(submitted)]
    hits = checked = 0  # loads reported; loads of unverified slots that verified
    wrong: dict[int, list[bytes]] = {}
    for n, src in enumerate(roots):
        root = str(tmp_path / f"open{n}")
        shutil.copytree(src, root)  # each run opens its own copy
        buf = new_buffer()
        store = open_store(root, buf, verify_checksums=verify)
        try:
            for start in range(0, len(keys), ROWS):
                part = [k for k in keys[start : start + ROWS] if store.contains(k)]
                if not part:
                    continue
                _outcome, ok, bad = load_keys(store, buf, part, job_id=start + 1)
                hits += len(ok)
                if bad:
                    wrong[n] = wrong.get(n, []) + bad
            checked += store.stats()["loads_verified_unverified"]
        finally:
            store.close()
            buf.release()
    assert not wrong, f"loads served another key's bytes: {sum(map(len, wrong.values()))}"
    assert hits > 0, "no copy held a chunk: the test checked nothing"
    # Slots rebuilt after the unclean shutdown are checked whatever the config says.
    assert checked > 0
