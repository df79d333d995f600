"""Bit flips at random offsets of the data file and of the index.

A flipped bit is never served (the load of that key fails, or the key is a
miss), is always counted (``checksum_failures`` or
``records_dropped_at_open``), is found by ``nvmetier fsck`` (exit 4), fixed
by ``--repair`` (exit 1), after which fsck is clean (exit 0).
"""

from __future__ import annotations

import os
import random

import pytest

from nvmetier import format as fmt
from nvmetier.cli import main as cli_main
from nvmetier.errors import FormatError
from nvmetier.files import DATA_NAME, INDEX_NAME, SUPERBLOCK_NAME
from tests.fault.faultkit import (
    ROW,
    flip_bit,
    key,
    live_records,
    load_keys,
    open_store,
    read_superblock,
    store_dir,
    store_keys,
)

pytestmark = pytest.mark.timeout(60)

N_KEYS = 48
SEEDS = range(4)


@pytest.fixture
def root(tmp_path, buf) -> str:
    """A closed store holding ``N_KEYS`` keys."""
    r = str(tmp_path / "kv")
    store = open_store(r, buf)
    outcome = store_keys(store, buf, [key(i) for i in range(N_KEYS)])
    assert outcome.success
    store.close()
    return r


def _flip_data(root: str, seed: int) -> tuple[bytes, int]:
    """Flip one bit inside the chunk of a random live slot: (its key, its slot)."""
    rng = random.Random(seed)
    rec = rng.choice(live_records(store_dir(root)))
    sb = read_superblock(store_dir(root))
    _, offset = sb.slot_location(rec.slot)
    flip_bit(
        os.path.join(store_dir(root), DATA_NAME),
        offset + rng.randrange(sb.chunk_bytes),
        rng.randrange(8),
    )
    return rec.key, rec.slot


def _flip_index(root: str, seed: int) -> int:
    """Flip one bit at a random offset of the index's records: the slot hit."""
    rng = random.Random(seed)
    sb = read_superblock(store_dir(root))
    offset = rng.randrange(sb.index_bytes)
    flip_bit(os.path.join(store_dir(root), INDEX_NAME), offset, rng.randrange(8))
    return offset // fmt.RECORD_BYTES


def _fsck(root: str, *args: str) -> int:
    return cli_main(["fsck", root, *args])


# ----------------------------------------------------------------- data file
@pytest.mark.parametrize("seed", SEEDS)
def test_data_bit_flip_is_never_served(root, buf, seed) -> None:
    bad, _ = _flip_data(root, seed)
    store = open_store(root, buf)
    keys = [key(i) for i in range(N_KEYS)]
    outcome, ok, wrong = load_keys(store, buf, keys)
    store.close()
    assert not outcome.success
    assert set(ok) == set(keys) - {bad}
    assert wrong == []


@pytest.mark.parametrize("seed", SEEDS)
def test_data_bit_flip_is_counted_and_becomes_a_miss(root, buf, seed) -> None:
    bad, _ = _flip_data(root, seed)
    store = open_store(root, buf)
    load_keys(store, buf, [bad])
    stats = store.stats()
    hit = store.lookup(bad)
    store.release_holds()
    store.close()
    assert stats["checksum_failures"] == 1
    assert not hit


@pytest.mark.parametrize("seed", SEEDS)
def test_fsck_deep_finds_data_bit_flip(root, seed, capsys) -> None:
    _, slot = _flip_data(root, seed)
    assert _fsck(root) == 0  # without --deep the payload is not read
    assert _fsck(root, "--deep") == 4
    assert f"slot {slot}: payload checksum mismatch" in capsys.readouterr().out


@pytest.mark.parametrize("seed", SEEDS)
def test_fsck_repair_fixes_data_bit_flip_then_fsck_is_clean(root, buf, seed) -> None:
    bad, _ = _flip_data(root, seed)
    assert _fsck(root, "--deep", "--repair") == 1
    assert _fsck(root, "--deep") == 0
    store = open_store(root, buf)
    present = [k for k in (key(i) for i in range(N_KEYS)) if store.contains(k)]
    store.close()
    assert set(present) == {key(i) for i in range(N_KEYS)} - {bad}


# --------------------------------------------------------------------- index
@pytest.mark.parametrize("seed", SEEDS)
def test_index_bit_flip_is_dropped_at_open_and_counted(root, buf, seed) -> None:
    was = {r.slot: r.key for r in live_records(store_dir(root))}
    slot = _flip_index(root, seed)
    store = open_store(root, buf)
    dropped = store.stats()["records_dropped_at_open"]
    keys = [key(i) for i in range(N_KEYS)]
    present = [k for k in keys if store.contains(k)]
    _, ok, wrong = load_keys(store, buf, present)
    store.close()
    assert dropped == 1
    lost = set(keys) - set(present)
    # Only the key of the flipped record (if it held one) is gone.
    assert lost <= {was.get(slot)}
    assert wrong == [] and set(ok) == set(present)


@pytest.mark.parametrize("seed", SEEDS)
def test_fsck_finds_index_bit_flip(root, seed, capsys) -> None:
    slot = _flip_index(root, seed)
    assert _fsck(root) == 4
    assert f"record: slot {slot}:" in capsys.readouterr().out


@pytest.mark.parametrize("seed", SEEDS)
def test_fsck_repair_fixes_index_bit_flip_then_fsck_is_clean(root, seed) -> None:
    _flip_index(root, seed)
    assert _fsck(root, "--repair") == 1
    assert _fsck(root, "--deep") == 0


def test_fsck_repair_never_rewrites_good_records(root, seed=0) -> None:
    slot = _flip_index(root, seed)
    path = os.path.join(store_dir(root), INDEX_NAME)
    rb = fmt.RECORD_BYTES
    with open(path, "rb") as f:
        before = f.read()
    assert _fsck(root, "--repair") == 1
    with open(path, "rb") as f:
        after = f.read()
    assert after[slot * rb : (slot + 1) * rb] == fmt.EMPTY_RECORD
    assert before[: slot * rb] == after[: slot * rb]
    assert before[(slot + 1) * rb :] == after[(slot + 1) * rb :]


# ---------------------------------------------------------------- superblock
def test_superblock_bit_flip_is_refused_at_open_and_left_for_a_person(root, buf) -> None:
    flip_bit(os.path.join(store_dir(root), SUPERBLOCK_NAME), 40, 3)
    with pytest.raises(FormatError, match="superblock"):
        open_store(root, buf)
    assert _fsck(root, "--repair") == 4


def test_data_bit_flip_outside_live_slots_is_harmless(root, buf) -> None:
    sb = read_superblock(store_dir(root))
    used = {r.slot for r in live_records(store_dir(root))}
    free = next(s for s in range(sb.n_slots) if s not in used and sb.slot_location(s)[0] == 0)
    flip_bit(os.path.join(store_dir(root), DATA_NAME), sb.slot_location(free)[1] + ROW // 2, 0)
    assert _fsck(root, "--deep") == 0
