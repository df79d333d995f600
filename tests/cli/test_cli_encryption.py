"""``nvmetier fsck --deep --key-file`` and ``nvmetier info`` on an encrypted
store: tags verified with the key, a clear answer without it, a tampered
chunk found, a rotated key's chunks told apart from corruption."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("nvmetier._crypto")

from nvmetier import crypto
from tests.cli.clikit import assert_one_line_error, run_cli, run_json
from tests.fault.faultkit import (
    ROW,
    key,
    live_records,
    open_store,
    read_superblock,
    store_dir,
    store_keys,
)

pytestmark = pytest.mark.timeout(120)

N_KEYS = 12


def new_key(tmp_path, name: str) -> str:
    path = tmp_path / name
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def sealed_root(tmp_path, buf) -> tuple[str, str]:
    root, key_path = str(tmp_path / "kv"), new_key(tmp_path, "key")
    store = open_store(root, buf, encryption={"key_file": key_path})
    assert store_keys(store, buf, [key(i) for i in range(N_KEYS)]).success
    store.close()
    return root, key_path


def test_deep_fsck_without_a_key_says_so_and_exits_8(sealed_root) -> None:
    root, _key = sealed_root
    proc = run_cli("fsck", "--deep", root)
    assert proc.returncode == 8
    assert "NOT verified" in proc.stdout and "--key-file" in proc.stdout
    code, out = run_json("fsck", "--deep", root)
    assert code == 8 and out["stores"][0]["deep_no_key"] is True


def test_plain_fsck_of_an_encrypted_store_is_clean(sealed_root) -> None:
    root, _key = sealed_root
    assert run_cli("fsck", root).returncode == 0


def test_deep_fsck_with_the_key_verifies_every_tag(sealed_root) -> None:
    root, key_path = sealed_root
    proc = run_cli("fsck", "--deep", "--key-file", key_path, root)
    assert proc.returncode == 0, proc.stdout
    assert f"{N_KEYS} tags verified" in proc.stdout


def test_deep_fsck_finds_a_tampered_chunk(sealed_root) -> None:
    root, key_path = sealed_root
    sdir = store_dir(root)
    slot = live_records(sdir)[0].slot
    _file, offset = read_superblock(sdir).slot_location(slot)
    with open(os.path.join(sdir, "data"), "r+b") as f:
        f.seek(offset + 100)
        b = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([b[0] ^ 4]))
    proc = run_cli("fsck", "--deep", "--key-file", key_path, root)
    assert proc.returncode == 4
    assert "authentication tag does not verify" in proc.stdout


def test_deep_fsck_with_another_key_reports_a_rotated_key_not_corruption(
    tmp_path, sealed_root
) -> None:
    root, _key = sealed_root
    other = new_key(tmp_path, "other")
    proc = run_cli("fsck", "--deep", "--key-file", other, root)
    assert proc.returncode == 0
    assert f"{N_KEYS} sealed under another key" in proc.stdout


def test_fsck_refuses_a_key_file_others_can_read(tmp_path, sealed_root) -> None:
    root, key_path = sealed_root
    os.chmod(key_path, 0o640)
    proc = run_cli("fsck", "--deep", "--key-file", key_path, root)
    assert proc.returncode == 8
    assert_one_line_error(proc)
    assert "chmod 600" in proc.stderr


def test_info_says_encrypted_with_the_key_fingerprint(sealed_root) -> None:
    root, key_path = sealed_root
    code, out = run_json("info", root)
    assert code == 0
    (s,) = out["stores"]
    assert s["encryption"] == "aes-256-gcm/v1"
    assert s["key_fingerprint"] == crypto.KeySet.from_file(key_path).fingerprint_hex
    assert s["chunk_bytes"] > ROW  # the sealed chunk's trailer
    assert "key fingerprint" in run_cli("info", root).stdout


def test_info_of_a_plaintext_store_says_none(tmp_path, buf) -> None:
    root = str(tmp_path / "kv")
    store = open_store(root, buf)
    store.close()
    assert "encryption:      none" in run_cli("info", root).stdout


def test_rekey_rewraps_so_the_old_key_opens_nothing_and_the_new_one_everything(
    tmp_path, sealed_root, buf
) -> None:
    root, old = sealed_root
    new = new_key(tmp_path, "new")
    data = os.path.join(store_dir(root), "data")
    before = open(data, "rb").read()  # noqa: SIM115
    code, out = run_json("rekey", root, "--key-file", old, "--new-key-file", new)
    assert code == 0, out
    (s,) = out["stores"]
    assert s["rekeyed"] and s["new_fingerprint"] == crypto.KeySet.from_file(new).fingerprint_hex
    assert open(data, "rb").read() == before  # noqa: SIM115  (no data rewritten)
    proc = run_cli("fsck", "--deep", "--key-file", new, root)
    assert proc.returncode == 0 and f"{N_KEYS} tags verified" in proc.stdout
    proc = run_cli("fsck", "--deep", "--key-file", old, root)
    assert f"{N_KEYS} sealed under another key" in proc.stdout
    # Both header copies hold the new wrapping: no copy the old key opens.
    ring = open(os.path.join(store_dir(root), "keys"), "rb").read()  # noqa: SIM115
    fp_old = crypto.KeySet.from_file(old).fingerprint
    assert fp_old not in ring[:8192]
    with pytest.raises(Exception, match="nvmetier rekey"):
        open_store(root, buf, encryption={"key_file": old})
    store = open_store(root, buf, encryption={"key_file": new})
    assert all(store.contains(key(i)) for i in range(N_KEYS))
    store.close()
    # again with the old key: that store is left (exit 4), named
    proc = run_cli("rekey", root, "--key-file", old, "--new-key-file", new)
    assert proc.returncode == 4 and "not rekeyed" in proc.stdout


def test_rekey_of_a_live_store_keeps_its_processes_serving(tmp_path, buf) -> None:
    root, old, new = str(tmp_path / "kv"), new_key(tmp_path, "old"), new_key(tmp_path, "new")
    store = open_store(root, buf, encryption={"key_file": old})
    assert store_keys(store, buf, [key(i) for i in range(4)]).success
    assert run_cli("rekey", root, "--key-file", old, "--new-key-file", new).returncode == 0
    assert store_keys(store, buf, [key(100 + i) for i in range(4)]).success
    store.close()
    store = open_store(root, buf, encryption={"key_file": new})
    assert all(store.contains(key(i)) for i in [0, 1, 2, 3, 100, 101, 102, 103])
    store.close()


def test_rekey_usage_and_operational_errors(tmp_path, sealed_root) -> None:
    root, old = sealed_root
    assert run_cli("rekey", root, "--key-file", old).returncode == 16
    proc = run_cli("rekey", root, "--key-file", old, "--new-key-file", old)
    assert proc.returncode == 8
    assert_one_line_error(proc)
    code, out = run_json(
        "rekey",
        str(tmp_path / "nothing"),
        "--key-file",
        old,
        "--new-key-file",
        new_key(tmp_path, "n"),
    )
    assert code == 8 and out["exit_code"] == 8
