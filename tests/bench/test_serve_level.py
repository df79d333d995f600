"""The serve level's pieces that need no server: the documented command line,
the kv-transfer configs, the /metrics parser. (Real servers: tests/serve.)"""

from __future__ import annotations

import json
import os
import shlex

from nvmetier.bench.serve import (
    cpu_serve_argv,
    docs_serve_line,
    kv_transfer_config,
    metric_sum,
    parse_metrics,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_docs_show_the_cpu_serve_line_the_suite_builds() -> None:
    with open(os.path.join(ROOT, "docs", "vllm.md"), encoding="utf-8") as f:
        assert docs_serve_line() in f.read().splitlines()


def test_docs_line_is_a_shell_command_with_our_spec() -> None:
    words = shlex.split(docs_serve_line())
    assert words[:4] == ["PYTHONHASHSEED=0", "python", "-m", "nvmetier.vllm.serve"]
    kv = json.loads(words[words.index("--kv-transfer-config") + 1])
    extra = kv["kv_connector_extra_config"]
    assert (extra["spec_name"], extra["spec_module_path"]) == (
        "CpuTieringOffloadingSpec",
        "nvmetier.vllm.cpu",
    )
    assert extra["secondary_tiers"][0]["type"] == "nvme"


def test_no_tier_means_no_connector() -> None:
    assert kv_transfer_config(None) is None
    assert "--kv-transfer-config" not in cpu_serve_argv("m", 1, None)


def test_fs_tier_gets_no_capacity_key() -> None:
    kv = kv_transfer_config("fs", "/x")
    assert kv is not None
    assert kv["kv_connector_extra_config"]["secondary_tiers"] == [{"type": "fs", "root_dir": "/x"}]


def test_metrics_parser_sums_series_by_label() -> None:
    text = (
        "# HELP vllm:nvmetier_capacity_bytes x\n"
        'vllm:nvmetier_capacity_bytes{engine="0",tier="1:nvme"} 1.5e+07\n'
        'vllm:nvmetier_capacity_bytes{engine="1",tier="1:nvme"} 0.0\n'
        'vllm:kv_offload_total_bytes_total{engine="0",transfer_type="GPU_to_CPU"} 42.0\n'
    )
    m = parse_metrics(text)
    assert metric_sum(m, "vllm:nvmetier_capacity_bytes") == 1.5e7
    assert metric_sum(m, "vllm:kv_offload_total_bytes_total", transfer_type="GPU_to_CPU") == 42
    assert metric_sum(m, "vllm:kv_offload_total_bytes_total", transfer_type="CPU_to_GPU") == 0


def test_docs_gpu_line_differs_from_the_cpu_line_only_where_the_docs_say() -> None:
    from nvmetier.bench.serve import docs_gpu_serve_line

    with open(os.path.join(ROOT, "docs", "vllm.md"), encoding="utf-8") as f:
        assert docs_gpu_serve_line() in f.read().splitlines()
    cpu, gpu = shlex.split(docs_serve_line()), shlex.split(docs_gpu_serve_line())
    kv_cpu = json.loads(cpu.pop(cpu.index("--kv-transfer-config") + 1))
    kv_gpu = json.loads(gpu.pop(gpu.index("--kv-transfer-config") + 1))
    extra = kv_cpu["kv_connector_extra_config"]
    assert extra.pop("spec_module_path") == "nvmetier.vllm.cpu"
    extra["spec_name"] = "TieringOffloadingSpec"
    assert kv_cpu == kv_gpu
    for flag, n in (("--dtype", 2), ("--block-size", 2), ("--enforce-eager", 1)):
        i = cpu.index(flag)
        del cpu[i : i + n]
    assert cpu[1:4] == ["python", "-m", "nvmetier.vllm.serve"]
    assert gpu[1:3] == ["vllm", "serve"]
    assert cpu[4:] == gpu[3:]
