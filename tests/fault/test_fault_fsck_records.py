"""fsck on records that verify but are wrong (misplaced, duplicate) and on
damaged store files; fsck agrees with what a store open drops."""

from __future__ import annotations

import os

import pytest

from nvmetier import format as fmt
from nvmetier import fsck
from nvmetier.files import DATA_NAME, INDEX_NAME
from tests.fault.faultkit import (
    key,
    live_records,
    open_store,
    read_superblock,
    store_dir,
    store_keys,
)

pytestmark = pytest.mark.timeout(60)

N_KEYS = 16


@pytest.fixture
def root(tmp_path, buf) -> str:
    r = str(tmp_path / "kv")
    store = open_store(r, buf)
    assert store_keys(store, buf, [key(i) for i in range(N_KEYS)]).success
    store.close()
    return r


def _write_record(root: str, slot: int, record: bytes) -> None:
    fd = os.open(os.path.join(store_dir(root), INDEX_NAME), os.O_RDWR)
    try:
        os.pwrite(fd, record, slot * fmt.RECORD_BYTES)
    finally:
        os.close(fd)


def _free_slot(root: str, same_set_as: int | None = None) -> int:
    """A slot no record uses (in the set of slot ``same_set_as`` if given)."""
    sb = read_superblock(store_dir(root))
    used = {r.slot for r in live_records(store_dir(root))}
    for slot in range(sb.n_slots):
        if slot in used:
            continue
        if same_set_as is None or slot // sb.ways == same_set_as // sb.ways:
            return slot
    raise AssertionError("no free slot")


def _plant_misplaced(root: str) -> int:
    """A verifying record of a key that hashes to another set."""
    sb = read_superblock(store_dir(root))
    slot = _free_slot(root)
    k = next(
        key(i, trial=9)
        for i in range(1000)
        if fmt.set_of(key(i, trial=9), sb.n_sets) != slot // sb.ways
    )
    _write_record(root, slot, fmt.pack_record(slot, k, 0, 1))
    return slot


def _plant_duplicate(root: str) -> int:
    """A verifying record of a key an earlier slot of its set already holds."""
    recs = live_records(store_dir(root))
    sb = read_superblock(store_dir(root))
    for rec in recs:
        try:
            slot = _free_slot(root, rec.slot)
        except AssertionError:
            continue
        if slot > rec.slot:
            _write_record(root, slot, fmt.pack_record(slot, rec.key, rec.payload_checksum, 1))
            return slot
    raise AssertionError(f"no set with a free slot after a used one ({sb.n_sets} sets)")


PLANTS = pytest.mark.parametrize(
    ("plant", "kind"),
    [(_plant_misplaced, "misplaced"), (_plant_duplicate, "duplicate")],
    ids=["misplaced", "duplicate"],
)


@PLANTS
def test_fsck_reports_verifying_but_wrong_records(root, plant, kind) -> None:
    slot = plant(root)
    res = fsck.check_store(store_dir(root))
    assert res.exit_code == fsck.EXIT_UNCORRECTED
    assert [(e.kind, e.slot) for e in res.errors] == [(kind, slot)]


@PLANTS
def test_store_open_drops_what_fsck_reports(root, buf, plant, kind) -> None:
    plant(root)
    store = open_store(root, buf)
    dropped = store.stats()["records_dropped_at_open"]
    present = sum(store.contains(key(i)) for i in range(N_KEYS))
    store.close()
    assert dropped == 1 and present == N_KEYS
    assert fsck.check_store(store_dir(root)).exit_code == fsck.EXIT_CLEAN


@PLANTS
def test_fsck_repair_zeroes_only_the_wrong_record(root, plant, kind) -> None:
    slot = plant(root)
    assert fsck.check_store(store_dir(root), repair=True).exit_code == fsck.EXIT_CORRECTED
    res = fsck.check_store(store_dir(root), deep=True)
    assert res.exit_code == fsck.EXIT_CLEAN and res.live == N_KEYS
    assert slot not in {r.slot for r in live_records(store_dir(root))}


@pytest.mark.parametrize(
    ("damage", "kind"),
    [
        (lambda d: os.unlink(os.path.join(d, INDEX_NAME)), "index_missing"),
        (lambda d: os.truncate(os.path.join(d, INDEX_NAME), 4096), "index_size"),
        (lambda d: os.unlink(os.path.join(d, DATA_NAME)), "data_missing"),
        (lambda d: os.truncate(os.path.join(d, DATA_NAME), 65536), "data_size"),
    ],
    ids=["index-missing", "index-short", "data-missing", "data-short"],
)
def test_fsck_leaves_damaged_files_for_a_person(root, damage, kind) -> None:
    damage(store_dir(root))
    res = fsck.check_store(store_dir(root), deep=True, repair=True)
    assert res.exit_code == fsck.EXIT_UNCORRECTED
    assert kind in {e.kind for e in res.errors} and res.repaired == 0


def test_fsck_names_a_store_of_another_format_version_not_damage(root) -> None:
    # A superblock in another format version (another nvmetier made it): a
    # superblock error whose hint says so, never "the files are damaged".
    from nvmetier.files import SUPERBLOCK_NAME

    path = os.path.join(store_dir(root), SUPERBLOCK_NAME)
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, (fmt.FORMAT_VERSION + 1).to_bytes(4, "little"), 8)  # after the magic
    finally:
        os.close(fd)
    res = fsck.check_store(store_dir(root))
    assert res.exit_code == fsck.EXIT_UNCORRECTED
    assert [e.kind for e in res.errors] == ["superblock"]
    assert res.format_version == fmt.FORMAT_VERSION + 1
    text = fsck.format_result(res)
    assert f"format version {fmt.FORMAT_VERSION + 1}" in text
    assert "another nvmetier made this store" in text and "damaged" not in text
