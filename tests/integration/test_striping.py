"""Several drives: slots striped over one data file per root."""

from __future__ import annotations

import os

import pytest

from nvmetier.engine import usable_cpus
from tests.integration.helpers import ROW, key, load_keys, make_store, payload, store_keys

pytestmark = pytest.mark.timeout(120)


def test_slots_stripe_over_every_root(tmp_path, buffer) -> None:
    roots = [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")]
    store = make_store(roots, buffer, capacity_bytes="16MiB")
    keys = [key(i) for i in range(40)]
    store_keys(store, buffer, keys)
    per_root = [0, 0]
    for k in keys:
        file_idx, offset = store.sb.slot_location(store.slot_of(k))
        with open(os.path.join(roots[file_idx], "store", "data"), "rb") as f:
            f.seek(offset)
            assert f.read(ROW) == payload(k)
        per_root[file_idx] += 1
    assert min(per_root) >= 10
    assert os.path.exists(os.path.join(roots[0], "store", "index"))
    outcome, good = load_keys(store, buffer, keys)
    assert outcome.success and good == keys
    store.close()


def test_capacity_is_the_total_over_roots(tmp_path, buffer) -> None:
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    store = make_store(roots, buffer, capacity_bytes="16MiB")
    sizes = [os.path.getsize(os.path.join(r, "store", "data")) for r in roots]
    assert sizes[0] == sizes[1]
    assert sum(sizes) <= 16 << 20
    store.close()


def test_capacity_per_path_bounds_each_drive(tmp_path, buffer) -> None:
    from tests.integration.helpers import disk_usage_bytes

    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    store = make_store(roots, buffer, capacity_bytes=["6MiB", "4MiB"])
    assert disk_usage_bytes(roots[0]) <= 6 << 20
    assert disk_usage_bytes(roots[1]) <= 4 << 20
    # The smaller drive decides: its budget less one block for its directory.
    assert store.sb.n_slots == 2 * (((4 << 20) - 4096) // ROW // 8 * 8)
    keys = [key(i) for i in range(20)]
    store_keys(store, buffer, keys)
    assert load_keys(store, buffer, keys)[1] == keys
    store.close()


def test_capacity_list_must_match_root_dir(tmp_path, buffer) -> None:
    from nvmetier.errors import ConfigError

    with pytest.raises(ConfigError, match="one capacity per root_dir"):
        make_store([str(tmp_path / "a")], buffer, capacity_bytes=["1GiB", "1GiB"])


@pytest.mark.parametrize("io_workers", [1, 2, 3, "auto"])
def test_several_io_workers_store_and_load_over_two_roots(
    tmp_path, buffer, io_workers, monkeypatch
) -> None:
    """Under both engines (the thread engine ignores io_workers): every key
    stored over two roots loads back with verified checksums."""
    monkeypatch.delenv("NVMETIER_IO_WORKERS", raising=False)  # the count is asserted
    roots = [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")]
    store = make_store(roots, buffer, capacity_bytes="16MiB", io_workers=io_workers)
    try:
        keys = [key(i) for i in range(40)]
        (outcome,) = store_keys(store, buffer, keys)
        assert outcome.success
        outcome, good = load_keys(store, buffer, keys)
        assert outcome.success and good == keys
        info = store.describe()
        if info["engine"] == "uring":
            # Both roots are on one filesystem here: "auto" is one worker,
            # two when the store stages (the buffer is in 4 KiB pages), at
            # most the usable CPUs.
            auto = min(2 if info["staging"] else 1, usable_cpus())
            assert info["workers"] == (auto if io_workers == "auto" else io_workers)
    finally:
        store.close()
