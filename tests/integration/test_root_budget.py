"""The root budget (issue 30): one bound on every store under a root_dir,
the stores that give way, stores made smaller or refused, the filesystem
reserve, ``nvmetier info``/``budget`` and the metrics. Real files in
``tmp_path``; several models are several layout identities (their own
stores), some of another chunk size."""

from __future__ import annotations

import itertools
import json
import os
import threading

import pytest

from nvmetier import budget
from nvmetier.cli import main as cli_main
from nvmetier.config import TierConfig
from nvmetier.errors import ConfigError, StoreSpaceError
from nvmetier.store import BlockStore
from tests.integration.helpers import ROW, fill_rows, key, payload, run

MiB = 1 << 20


def model(i: int, chunk: int = ROW) -> dict[str, object]:
    return {"model_name": f"model-{i}", "chunk_bytes": chunk}


def open_model(root, buffer, i: int, *, chunk: int = ROW, **over) -> BlockStore:
    raw = {"root_dir": str(root), "capacity_bytes": "16MiB", "ways": 8}
    raw.update(over)
    return BlockStore(
        TierConfig.from_dict(raw),
        store_name=f"model-{i}_{chunk}",
        identity=model(i, chunk),
        buffer=buffer,
        row_bytes=chunk,
    )


def store_and_check(store: BlockStore, buffer, first: int, n: int = 8) -> None:
    """Store ``n`` keys, then load them back: every byte is the key's own."""
    assert store.row_bytes == ROW
    keys = [key(first + i) for i in range(n)]
    rows = list(range(n))
    fill_rows(buffer, keys, rows)
    store.submit_store(1, keys, rows)
    run(store)
    buffer[: n * ROW] = bytes(n * ROW)
    store.submit_load(2, keys, rows)
    (out,) = run(store)
    assert out.success
    for k, r in zip(keys, rows, strict=True):
        assert buffer[r * ROW : (r + 1) * ROW] == payload(k)


class Sampler:
    """``du`` of the root sampled in a background thread while a test runs."""

    def __init__(self, root) -> None:
        self.root = str(root)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, budget.root_used_bytes(self.root))
            self._stop.wait(0.001)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, budget.root_used_bytes(self.root))


def test_the_budget_is_recorded_with_the_root_and_another_value_is_refused(
    tmp_path, buffer
) -> None:
    s = open_model(tmp_path, buffer, 0, root_budget_bytes="40MiB")
    s.close()
    assert budget.read_budget(str(tmp_path)) == 40 * MiB
    doc = json.loads((tmp_path / budget.BUDGET_NAME).read_text())
    assert doc["budget_bytes"] == 40 * MiB and doc["format"] == budget.BUDGET_FORMAT
    with pytest.raises(ConfigError) as err:
        open_model(tmp_path, buffer, 1, root_budget_bytes="50MiB")
    msg = str(err.value)
    assert str(40 * MiB) in msg and str(50 * MiB) in msg
    assert "nvmetier budget" in msg and "--set" in msg


def test_a_process_stating_no_budget_follows_the_record(tmp_path, buffer) -> None:
    budget.write_budget(str(tmp_path), 20 * MiB)
    a = open_model(tmp_path, buffer, 0)
    a.close()
    b = open_model(tmp_path, buffer, 1)  # the record binds it: 0 gives way
    b.close()
    assert not (tmp_path / "model-0_65536").exists()
    assert budget.root_used_bytes(str(tmp_path)) <= 20 * MiB


def test_the_least_recently_used_dead_store_gives_way(tmp_path, buffer) -> None:
    over = {"root_budget_bytes": "40MiB"}
    for i in (0, 1):
        open_model(tmp_path, buffer, i, **over).close()
    # Model 0 used again after model 1: model 1 is the least recently used.
    s0 = open_model(tmp_path, buffer, 0, **over)
    store_and_check(s0, buffer, 0)
    s0.close()
    s2 = open_model(tmp_path, buffer, 2, **over)
    assert s2.stats()["stores_removed_for_budget"] == 1
    assert s2.sb.n_slots * s2.sb.slot_bytes > 14 * MiB  # not made smaller
    s2.close()
    assert (tmp_path / "model-0_65536").exists()
    assert not (tmp_path / "model-1_65536").exists()
    assert budget.root_used_bytes(str(tmp_path)) <= 40 * MiB
    s0 = open_model(tmp_path, buffer, 0, **over)  # its chunks survived
    try:
        assert all(s0.contains(key(i)) for i in range(8))
    finally:
        s0.close()


def test_a_live_store_is_never_removed_and_a_refusal_names_it(tmp_path, buffer) -> None:
    over = {"root_budget_bytes": "36MiB", "min_capacity_bytes": "16MiB"}
    live = open_model(tmp_path, buffer, 0, **over)
    try:
        store_and_check(live, buffer, 100)
        open_model(tmp_path, buffer, 1, **over).close()
        second = open_model(tmp_path, buffer, 2, **over)  # 1 gives way, not 0
        assert not (tmp_path / "model-1_65536").exists()
        with pytest.raises(StoreSpaceError) as err:
            open_model(tmp_path, buffer, 3, **over)  # both others live
        msg = str(err.value)
        assert "model-0_65536" in msg and "model-2_65536" in msg
        assert f"pid {os.getpid()}" in msg
        assert "nvmetier budget" in msg
        second.close()
        assert (tmp_path / "model-0_65536").exists()
        store_and_check(live, buffer, 100)
    finally:
        live.close()


def test_a_store_is_made_smaller_down_to_its_floor_and_reopens_at_that_size(
    tmp_path, buffer
) -> None:
    over = {"root_budget_bytes": "28MiB", "min_capacity_bytes": "8MiB"}
    live = open_model(tmp_path, buffer, 0, **over)
    try:
        small = open_model(tmp_path, buffer, 1, **over)
        made = small.sb.n_slots * small.sb.slot_bytes
        assert 8 * MiB <= made < 12 * MiB
        store_and_check(small, buffer, 7)
        small.close()
        assert budget.root_used_bytes(str(tmp_path)) <= 28 * MiB
        again = open_model(tmp_path, buffer, 1, **over)  # same config: no ConfigError
        assert again.sb.n_slots * again.sb.slot_bytes == made
        assert all(again.contains(key(7 + i)) for i in range(8))
        again.close()
    finally:
        live.close()


def test_a_store_below_its_floor_is_refused(tmp_path, buffer) -> None:
    over = {"root_budget_bytes": "28MiB", "min_capacity_bytes": "16MiB"}
    live = open_model(tmp_path, buffer, 0, **over)
    try:
        with pytest.raises(StoreSpaceError, match="min_capacity_bytes"):
            open_model(tmp_path, buffer, 1, **over)
        assert not (tmp_path / "model-1_65536").exists()  # nothing left behind
    finally:
        live.close()


# Three models in the default run (6 orders); NVMETIER_SLOW=1: four (24).
MODELS = 4 if os.environ.get("NVMETIER_SLOW") == "1" else 3


@pytest.mark.parametrize("order", list(itertools.permutations(range(MODELS))))
def test_models_starting_in_every_order_stay_under_the_budget(tmp_path, buffer, order) -> None:
    """Three (four) models, one of another chunk size (another layout), each
    stored and verified while the next starts, every other one left open;
    du sampled throughout."""
    limit = 40 * MiB
    over = {"root_budget_bytes": limit}
    with Sampler(tmp_path) as sampler:
        for n, i in enumerate(order):
            live = open_model(tmp_path, buffer, i, chunk=ROW if i != 2 else ROW // 2, **over)
            if live.row_bytes == ROW:
                store_and_check(live, buffer, 1000 * n)
            if n % 2 == 0:
                live.close()  # the others stay open: they must not be removed
            else:
                kept = live
        kept.close()
    assert sampler.peak <= limit, sampler.peak


def test_the_filesystem_reserve_makes_a_store_smaller_or_refuses_it(
    tmp_path, buffer, monkeypatch
) -> None:
    free = {"bytes": 1 << 40}
    monkeypatch.setattr(budget, "fs_space", lambda _p: (100 << 30, free["bytes"]))
    import nvmetier.files as files

    monkeypatch.setattr(
        files.shutil,
        "disk_usage",
        lambda _p: type("U", (), {"total": 100 << 30, "free": free["bytes"]})(),
    )
    # 100 GiB filesystem, reserve max(1 GiB, 5%) = 5 GiB: 5 GiB + 10 MiB free.
    free["bytes"] = (5 << 30) + 10 * MiB
    s = open_model(tmp_path, buffer, 0, min_capacity_bytes="4MiB")
    assert 4 * MiB <= s.sb.n_slots * s.sb.slot_bytes <= 10 * MiB
    s.close()
    free["bytes"] = (5 << 30) + 1 * MiB
    with pytest.raises(StoreSpaceError, match="fs_reserve"):
        open_model(tmp_path, buffer, 1)
    # No reserve: the whole free space may be used.
    open_model(
        tmp_path, buffer, 2, fs_reserve_bytes=0, fs_reserve_fraction=0, min_capacity_bytes=1 << 20
    ).close()


def test_info_reports_the_budget_and_each_stores_share(tmp_path, buffer, capsys) -> None:
    over = {"root_budget_bytes": "40MiB"}
    open_model(tmp_path, buffer, 0, **over).close()
    live = open_model(tmp_path, buffer, 1, **over)
    try:
        assert cli_main(["info", str(tmp_path), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        b = report["budget"]
        assert b["budget_bytes"] == 40 * MiB
        assert b["used_bytes"] == budget.root_used_bytes(str(tmp_path))
        by_name = {s["name"]: s for s in b["stores"]}
        assert by_name["model-1_65536"]["pids"] == [os.getpid()]
        assert by_name["model-0_65536"]["pids"] == []
        for s in by_name.values():
            assert s["last_use_ns"] > 0
            assert 30 < s["share_of_budget_pct"] < 50
        assert {"root", "stores", "machine"} <= set(report)  # the existing keys stay
        store = next(s for s in report["stores"] if s["path"].endswith("model-1_65536"))
        assert store["budget_share_pct"] == by_name["model-1_65536"]["share_of_budget_pct"]
        assert cli_main(["info", str(tmp_path)]) == 0
        text = capsys.readouterr().out
        assert "root budget:" in text and "40.00 MiB" in text
        stats = live.stats()
        assert stats["root_budget_bytes"] == 40 * MiB
        assert 0 < stats["root_used_bytes"] <= 40 * MiB
    finally:
        live.close()


def test_the_budget_command_sets_and_refuses_below_what_live_stores_hold(
    tmp_path, buffer, capsys
) -> None:
    root = str(tmp_path)
    live = open_model(tmp_path, buffer, 0)
    try:
        open_model(tmp_path, buffer, 1).close()
        # The dead model 1 gives way; the live model 0 (~16.5 MiB) fits.
        assert cli_main(["budget", root, "--set", "20MiB"]) == 0
        assert budget.read_budget(root) == 20 * MiB
        assert not (tmp_path / "model-1_65536").exists()
        capsys.readouterr()
        assert cli_main(["budget", root, "--set", "8MiB"]) == 4
        assert "not recorded" in capsys.readouterr().out
        assert budget.read_budget(root) == 20 * MiB
        assert (tmp_path / "model-0_65536").exists()
    finally:
        live.close()
    assert cli_main(["budget", root, "--unset", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["budget_bytes"] is None
    assert budget.read_budget(root) is None


def test_a_bad_record_is_refused_naming_the_file_and_the_fix(tmp_path) -> None:
    (tmp_path / budget.BUDGET_NAME).write_text('{"budget_bytes": -1}')
    with pytest.raises(ConfigError, match=r"nvmetier budget .* --set"):
        budget.read_budget(str(tmp_path))
    budget.write_budget(str(tmp_path), 3 << 30)
    assert budget.read_budget(str(tmp_path)) == 3 << 30
    budget.write_budget(str(tmp_path), None)
    assert budget.read_budget(str(tmp_path)) is None
