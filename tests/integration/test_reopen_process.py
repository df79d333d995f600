"""A store written by one process is served by the next (warm restart)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.integration.helpers import key, load_keys, make_store

pytestmark = pytest.mark.timeout(120)

WRITER = textwrap.dedent(
    """
    import mmap, sys
    sys.path.insert(0, {repo!r})
    from tests.integration.helpers import key, make_store, store_keys
    buf = memoryview(mmap.mmap(-1, 64 * 65536))
    store = make_store({root!r}, buf)
    outcome, = store_keys(store, buf, [key(i) for i in range(48)])
    assert outcome.success
    store.close()
    """
)


def test_reopen_in_a_new_process_serves_every_chunk(tmp_path, buffer) -> None:
    import pathlib

    repo = str(pathlib.Path(__file__).resolve().parents[2])
    script = WRITER.format(repo=repo, root=str(tmp_path))
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    store = make_store(str(tmp_path), buffer)
    keys = [key(i) for i in range(48)]
    assert all(store.contains(k) for k in keys)
    outcome, good = load_keys(store, buffer, keys)
    assert outcome.success and good == keys
    store.close()


def test_second_opener_of_an_exclusive_store_gets_a_clear_error(tmp_path, buffer) -> None:
    store = make_store(str(tmp_path), buffer, sharing="process")
    import pathlib

    repo = str(pathlib.Path(__file__).resolve().parents[2])
    script = textwrap.dedent(
        f"""
        import mmap, sys
        sys.path.insert(0, {repo!r})
        from nvmetier.errors import StoreLockedError
        from tests.integration.helpers import make_store
        try:
            make_store({str(tmp_path)!r}, memoryview(mmap.mmap(-1, 64 * 65536)), sharing="node")
        except StoreLockedError as exc:
            print(exc)
            sys.exit(3)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 3, proc.stderr
    assert "in use by another process" in proc.stdout
    import os

    assert f"pid {os.getpid()}" in proc.stdout
    store.close()
