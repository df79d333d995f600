"""The Kubernetes manifest of docs/k8s/ and the YAML recipes of
docs/operations.md: valid against the Kubernetes API schemas (offline, with
kubernetes-validate: what ``kubectl --dry-run=client`` checks without a
cluster), and consistent with nvmetier: the tier config they embed parses
with ``TierConfig``, the store's budget fits under the volume's sizeLimit,
the grace period outlasts ``--shutdown-timeout``. No disk, no cluster."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import kubernetes_validate
import pytest
import yaml

from nvmetier.config import TierConfig, parse_size

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MANIFEST = os.path.join(REPO, "docs", "k8s", "vllm-nvmetier.yaml")
OPERATIONS = os.path.join(REPO, "docs", "operations.md")
K8S_SECTION = "## Running on Kubernetes"
# The oldest Kubernetes minor still maintained, and the newest the schemas know.
K8S_VERSIONS = ("1.32.0", kubernetes_validate.latest_version())
NVME_TYPES = ("nvme", "NvmeTierManager")
# What the engine, the store and the processes' exit need after
# --shutdown-timeout's drain ends (an idle CPU server took 20.9 s on a loaded
# 2-core VM: docs/operations.md).
SHUTDOWN_MARGIN_S = 30

_QUANTITY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "": 1}
_QUANTITY |= {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity_bytes(q: str | int) -> int:
    """A Kubernetes quantity (``100Gi``, ``9G``, ``1048576``) in bytes."""
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|k|M|G|T|)", str(q))
    assert m, f"quantity {q!r} is not in a form this test reads"
    return int(m.group(1)) * _QUANTITY[m.group(2)]


def manifest_docs() -> list[dict[str, Any]]:
    with open(MANIFEST, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d]


def recipe_docs() -> list[tuple[str, dict[str, Any]]]:
    """Every object of the ```yaml blocks of docs/operations.md's Kubernetes
    section (other sections' YAML is tier config), with a label."""
    with open(OPERATIONS, encoding="utf-8") as f:
        text = f.read()
    start = text.index(K8S_SECTION)
    end = text.find("\n## ", start + len(K8S_SECTION))
    text = text[start : end if end >= 0 else len(text)]
    out = []
    for i, block in enumerate(re.findall(r"```yaml\n(.*?)```", text, re.S)):
        for doc in yaml.safe_load_all(block):
            if doc:
                out.append((f"block {i + 1}: {doc.get('kind')} {doc['metadata']['name']}", doc))
    return out


def pod_specs() -> list[tuple[str, dict[str, Any]]]:
    """(where, pod spec) of every workload of the manifest and the recipes."""
    docs = [("manifest", d) for d in manifest_docs()] + recipe_docs()
    out = []
    for where, doc in docs:
        if doc["kind"] == "Pod":
            out.append((where, doc["spec"]))
        elif doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
            out.append((where, doc["spec"]["template"]["spec"]))
    return out


def tier_configs(container: dict[str, Any]) -> list[dict[str, Any]]:
    """The nvmetier entries of the container's ``--kv-transfer-config``."""
    argv = [*container.get("command", []), *container.get("args", [])]
    if "--kv-transfer-config" not in argv:
        return []
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    tiers = kv["kv_connector_extra_config"]["secondary_tiers"]
    return [t for t in tiers if t["type"] in NVME_TYPES]


def parsed_tier_config(raw: dict[str, Any]) -> TierConfig:
    return TierConfig.from_dict({k: v for k, v in raw.items() if k not in ("type", "module_path")})


def mount_of(pod: dict[str, Any], container: dict[str, Any], path: str) -> dict[str, Any]:
    """The volume whose mount in ``container`` holds ``path`` (longest prefix)."""
    best = None
    for m in container.get("volumeMounts", []):
        mp = m["mountPath"].rstrip("/") + "/"
        if (path.rstrip("/") + "/").startswith(mp) and (
            best is None or len(mp) > len(best["mountPath"])
        ):
            best = m
    assert best is not None, f"{path} is on no volume of container {container['name']}"
    (volume,) = [v for v in pod["volumes"] if v["name"] == best["name"]]
    return volume


def nvmetier_containers() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    out = []
    for where, pod in pod_specs():
        for c in pod["containers"]:
            if tier_configs(c):
                out.append((where, pod, c))
    return out


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifest_is_valid_kubernetes(version: str) -> None:
    docs = manifest_docs()
    assert {d["kind"] for d in docs} >= {"Deployment"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_operations_recipes_are_valid_kubernetes(version: str) -> None:
    recipes = recipe_docs()
    assert len(recipes) >= 4  # emptyDir, local PV + PVC, shared PVC, pod
    for where, doc in recipes:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"docs/operations.md {where}: {exc}") from exc


def test_schema_check_rejects_a_misspelt_field() -> None:
    # The check above can fail: strict mode refuses unknown fields.
    (deployment,) = [d for d in manifest_docs() if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    pod["securityContext"]["fsGroupp"] = 2000
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


def test_every_nvmetier_config_parses_with_tierconfig() -> None:
    found = nvmetier_containers()
    assert any(where == "manifest" for where, _, _ in found)
    for where, _pod, container in found:
        for raw in tier_configs(container):
            cfg = parsed_tier_config(raw)
            assert cfg.capacity_bytes > 0, where


def test_store_budget_fits_under_the_volume_size_limit() -> None:
    docs = [d for _, d in recipe_docs()] + manifest_docs()
    claims = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PersistentVolumeClaim"}
    checked = 0
    for where, pod, container in nvmetier_containers():
        for raw in tier_configs(container):
            cfg = parsed_tier_config(raw)
            budget = parse_size(raw.get("root_budget_bytes", cfg.capacity_bytes), "budget")
            assert cfg.capacity_bytes <= budget, where
            for root in cfg.root_dir:
                volume = mount_of(pod, container, root)
                limit = volume.get("emptyDir", {}).get("sizeLimit")
                claim = volume.get("persistentVolumeClaim", {}).get("claimName")
                if claim is not None and claim in claims:
                    limit = claims[claim]["spec"]["resources"]["requests"]["storage"]
                if limit is not None:
                    assert budget < quantity_bytes(limit), (
                        f"{where}: root_budget_bytes {budget} is not under the sizeLimit {limit} "
                        f"of {root}: the kubelet would evict the pod, or the store not fit"
                    )
                    checked += 1
    assert checked >= 2  # the manifest's emptyDir and the recipes' claim


def test_key_file_is_on_a_memory_volume_the_pod_can_own() -> None:
    for where, pod, container in nvmetier_containers():
        for raw in tier_configs(container):
            key_file = (raw.get("encryption") or {}).get("key_file")
            if key_file is None:
                continue
            volume = mount_of(pod, container, key_file)
            # Not the Secret itself: its files are root's, 0440 under fsGroup,
            # and load_key_file refuses both (tests/integration/test_kubernetes_volumes.py).
            assert "secret" not in volume, where
            assert volume.get("emptyDir", {}).get("medium") == "Memory", where


def test_grace_period_outlasts_shutdown_timeout() -> None:
    for where, pod, container in nvmetier_containers():
        argv = [*container.get("command", []), *container.get("args", [])]
        assert "--shutdown-timeout" in argv, f"{where}: without it a stop kills the engine core"
        timeout = float(argv[argv.index("--shutdown-timeout") + 1])
        grace = pod.get("terminationGracePeriodSeconds", 30)
        assert grace >= timeout + SHUTDOWN_MARGIN_S, where


def test_dev_shm_holds_the_cpu_tier() -> None:
    for where, pod, container in nvmetier_containers():
        argv = [*container.get("command", []), *container.get("args", [])]
        kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        cpu_bytes = int(kv["kv_connector_extra_config"]["cpu_bytes_to_use"])
        shm = mount_of(pod, container, "/dev/shm")
        assert shm["emptyDir"]["medium"] == "Memory", where
        assert quantity_bytes(shm["emptyDir"]["sizeLimit"]) > cpu_bytes, where


def test_pods_run_as_non_root_with_a_fixed_hash_seed() -> None:
    for where, pod, container in nvmetier_containers():
        sc = pod["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] > 0, where
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert env.get("PYTHONHASHSEED") not in (None, "random"), where


def test_manifest_pod_has_an_fsgroup_that_skips_the_relabel_walk_and_health_probes() -> None:
    ((_, pod, container),) = [f for f in nvmetier_containers() if f[0] == "manifest"]
    sc = pod["securityContext"]
    assert sc["fsGroup"] > 0 and sc["fsGroupChangePolicy"] == "OnRootMismatch"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health", probe
