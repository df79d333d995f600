"""An encrypted NvmeTierManager under vLLM's real orchestrator: chunks
promoted byte-exact, a sealed store of its own (a plaintext one under the
same root_dir is never read), KV events naming vLLM's keys, a rotated key a
cold cache."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("nvmetier._crypto")

from vllm.v1.kv_offload.base import LookupResult, Medium

from nvmetier.vllm.harness import key_of
from tests.vllm.conftest import new_key, nvme_tier

pytestmark = pytest.mark.timeout(180)


def sealed_tier(tmp_path, key_path: str, **kw):
    return nvme_tier(str(tmp_path / "kv"), encryption={"key_file": key_path}, **kw)


def test_encrypted_tier_promotes_the_same_bytes(tmp_path, make_engine) -> None:
    eng = make_engine([sealed_tier(tmp_path, new_key(tmp_path))])
    store = eng.tiers[0].store
    assert store.sealed and store.describe()["encryption"] == "aes-256-gcm/v1"
    keys = [key_of(i) for i in range(64)]
    eng.store_all(keys)
    eng.reset_primary()
    for start in range(0, 64, 16):
        part = keys[start : start + 16]
        assert set(eng.promote(part).values()) == {LookupResult.HIT}
        assert eng.verify(part) == len(part)
        eng.reset_primary()


def test_a_plaintext_tier_and_an_encrypted_one_keep_separate_stores(tmp_path, make_engine) -> None:
    plain = make_engine([nvme_tier(str(tmp_path / "kv"))])
    keys = [key_of(i) for i in range(8)]
    plain.store_all(keys)
    plain.shutdown()
    sealed = make_engine([sealed_tier(tmp_path, new_key(tmp_path))])
    sealed.reset_primary()
    assert set(sealed.promote(keys).values()) == {LookupResult.MISS}
    assert len(os.listdir(tmp_path / "kv")) == 2


def test_a_key_rotated_with_rekey_keeps_the_cache_hot(tmp_path, make_engine) -> None:
    from nvmetier import rekey
    from nvmetier.errors import ConfigError

    a, b = new_key(tmp_path, "a"), new_key(tmp_path, "b")
    first = make_engine([sealed_tier(tmp_path, a)])
    keys = [key_of(i) for i in range(16)]
    first.store_all(keys)
    first.shutdown()
    with pytest.raises(ConfigError, match="nvmetier rekey"):
        make_engine([sealed_tier(tmp_path, b)])  # another key file opens nothing
    assert all(r.rekeyed for r in rekey.rekey(str(tmp_path / "kv"), a, b))
    second = make_engine([sealed_tier(tmp_path, b)])
    second.reset_primary()
    assert set(second.promote(keys).values()) == {LookupResult.HIT}
    assert second.verify(keys) == len(keys)


def test_events_of_an_encrypted_tier_name_vllms_keys(tmp_path, make_engine) -> None:
    eng = make_engine(
        [
            sealed_tier(
                tmp_path, new_key(tmp_path), capacity_bytes="2MiB", ways=2, enable_kv_events=True
            )
        ],
        enable_kv_cache_events=True,
    )
    store = eng.tiers[0].store
    keys = [key_of(i) for i in range(3 * store.sb.n_slots)]
    eng.store_all(keys)
    events = [e for e in eng.manager.take_events() if e.medium is Medium.STORAGE]
    stored = [k for e in events if not e.removed for k in e.keys]
    removed = [k for e in events if e.removed for k in e.keys]
    assert set(stored) <= set(keys) and set(removed) <= set(keys)
    assert len(stored) == store.stats()["ops_written"]
    assert len(removed) == store.stats()["evictions"] > 0
    holds = {k for k in keys if store.contains(k)}
    assert holds == set(stored) - set(removed)
