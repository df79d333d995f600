"""docs/grafana/nvmetier.json: a well-formed Grafana dashboard whose every
expression our PromQL evaluator reads (so tools/render_dashboard.py draws
every panel), whose nvmetier series are the ones nvmetier/vllm/metrics.py
defines, and whose vLLM series are named in vLLM's own source. That a real
``vllm serve`` exports every name is checked by the serve suite
(tests/serve/test_serve.py); the evaluator itself is tested here on samples.
No disk, no server; well under a second."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections import Counter

import pytest

from nvmetier.bench import promql

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _metrics_table():
    """nvmetier/vllm/metrics.py (data only), loaded by path: importing it as
    ``nvmetier.vllm.metrics`` would import vLLM (the package's __init__)."""
    path = os.path.join(REPO, "nvmetier", "vllm", "metrics.py")
    spec = importlib.util.spec_from_file_location("_nvmetier_metrics_table", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.METRIC_PREFIX, module.METRICS


METRIC_PREFIX, METRICS = _metrics_table()
DASHBOARD = os.path.join(REPO, "docs", "grafana", "nvmetier.json")

# What the dashboard must show (issue 30, item 5), by the series each needs.
REQUIRED = {
    "hit ratio by tier": {
        "vllm:kv_offload_tiering_chunk_hits_total",
        "vllm:kv_offload_tiering_chunk_queries_total",
    },
    "bytes stored and loaded per second": {
        "vllm:nvmetier_bytes_written_total",
        "vllm:nvmetier_bytes_read_total",
    },
    "capacity and budget used": {
        "vllm:nvmetier_bytes_used",
        "vllm:nvmetier_capacity_bytes",
        "vllm:nvmetier_root_used_bytes",
        "vllm:nvmetier_root_budget_bytes",
    },
    "evictions": {"vllm:nvmetier_evictions_total"},
    "retention expiries": {"vllm:nvmetier_retention_expired_total"},
    "checksum failures": {"vllm:nvmetier_checksum_failures_total"},
    "hits not loaded": {"vllm:nvmetier_hits_not_loaded_total"},
    "failed jobs": {
        "vllm:nvmetier_store_jobs_failed_total",
        "vllm:nvmetier_load_jobs_failed_total",
    },
    "sharers": {"vllm:nvmetier_sharers"},
}
PANEL_TYPES = {"row", "timeseries", "stat", "gauge", "bargauge", "table", "text"}
VARIABLES = {"model_name": ".*", "__rate_interval": "1m", "datasource": "prom"}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    with open(DASHBOARD, encoding="utf-8") as f:
        return json.load(f)


def all_panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def dashboard_names(dashboard: dict) -> set[str]:
    names: set[str] = set()
    for _title, _ref, expr in promql.dashboard_expressions(dashboard):
        names |= promql.metric_names(expr)
    return names


def test_dashboard_has_grafana_structure(dashboard) -> None:
    assert dashboard["title"] and dashboard["uid"] == "nvmetier"
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    panels = all_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert all(isinstance(i, int) for i in ids)
    assert [i for i, n in Counter(ids).items() if n > 1] == []
    for p in panels:
        assert p["type"] in PANEL_TYPES, p["title"]
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]


def test_panels_do_not_overlap_on_the_grid(dashboard) -> None:
    cells: dict[tuple[int, int], str] = {}
    for p in all_panels(dashboard):
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]


def test_every_query_uses_the_datasource_variable(dashboard) -> None:
    (ds,) = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert ds["query"] == "prometheus"
    uid = "${" + ds["name"] + "}"
    queried = [p for p in all_panels(dashboard) if p["type"] != "row"]
    assert queried
    for p in queried:
        assert p["datasource"] == {"type": "prometheus", "uid": uid}, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(set(refs)) == len(refs), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == uid and t["expr"].strip(), p["title"]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            assert var["datasource"]["uid"] == uid, var["name"]


def test_every_expression_parses(dashboard) -> None:
    exprs = promql.dashboard_expressions(dashboard)
    assert len(exprs) >= 20
    for title, ref, expr in exprs:
        try:
            promql.parse(promql.substitute(expr, VARIABLES))
        except promql.PromQLError as exc:
            raise AssertionError(f"{title} {ref}: {exc}") from exc


def test_nvmetier_series_are_the_ones_metrics_py_defines(dashboard) -> None:
    ours = {
        METRIC_PREFIX + name + ("_total" if kind == "counter" else "")
        for name, (kind, _doc) in METRICS.items()
    }
    named = {n for n in dashboard_names(dashboard) if n.startswith(METRIC_PREFIX)}
    assert named - ours == set()


def test_vllm_series_are_named_in_vllms_source(dashboard) -> None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    base = next(iter(spec.submodule_search_locations))
    source = []
    for sub in ("distributed/kv_transfer", "v1/kv_offload", "v1/metrics", "v1/core"):
        for d, _dirs, files in os.walk(os.path.join(base, sub)):
            for f in files:
                if f.endswith(".py"):
                    with open(os.path.join(d, f), encoding="utf-8") as fh:
                        source.append(fh.read())
    text = "\n".join(source)
    theirs = {n for n in dashboard_names(dashboard) if not n.startswith(METRIC_PREFIX)}
    assert theirs
    missing = {n for n in theirs if f'"{promql.family(n)}"' not in text}
    # vLLM's own prefix-cache series are built from a prefix in code.
    missing -= {n for n in missing if "prefix_cache" in n and "prefix_cache" in text}
    assert missing == set()


def test_dashboard_shows_what_the_issue_asks(dashboard) -> None:
    names = dashboard_names(dashboard)
    for what, needs in REQUIRED.items():
        assert needs <= names, f"{what}: {sorted(needs - names)}"


# --- the evaluator ------------------------------------------------------------
def test_metric_names_skips_functions_labels_strings_and_variables() -> None:
    expr = (
        'sum by (tier, model_name) (rate(vllm:a_total{model_name=~"$model_name", x="vllm:no"}'
        "[$__rate_interval])) / max without (engine) (vllm:b) + on (tier) c_gauge * 2"
    )
    assert promql.metric_names(expr) == {"vllm:a_total", "vllm:b", "c_gauge"}
    assert promql.metric_names("label_values(vllm:c, model_name)") == {"vllm:c"}


def scrape(t: float, **series: dict) -> tuple[float, dict]:
    return t, {
        name: [(dict(labels), v) for labels, v in vals.items()] for name, vals in series.items()
    }


def test_rate_sum_by_and_ratio_evaluate_over_samples() -> None:
    n, p = (("tier", "1:nvme"),), (("tier", "0:primary"),)
    scrapes = [
        scrape(0, h={n: 0.0, p: 0.0}, q={n: 0.0, p: 0.0}),
        scrape(10, h={n: 5.0, p: 10.0}, q={n: 10.0, p: 10.0}),
        scrape(20, h={n: 3.0, p: 20.0}, q={n: 20.0, p: 20.0}),  # h{nvme} was reset
    ]
    expr = "sum by (tier) (rate(h[30s])) / sum by (tier) (rate(q[30s]))"
    got = promql.evaluate(promql.parse(expr), scrapes, 20)
    # nvme: 5 then 3 after a reset = 8 over 20 s, queries 20 over 20 s.
    assert got == {frozenset(n): pytest.approx(0.4), frozenset(p): pytest.approx(1.0)}
    inc = promql.evaluate(promql.parse("sum(increase(q[20s]))"), scrapes, 20)
    assert inc == {frozenset(): pytest.approx(40.0)}


def test_division_by_zero_is_nan_or_inf_as_in_promql() -> None:
    scrapes = [scrape(0, a={(): 0.0}, b={(): 0.0}, c={(): 2.0})]
    nan = promql.evaluate(promql.parse("a / b"), scrapes, 0)
    inf = promql.evaluate(promql.parse("c / b"), scrapes, 0)
    assert isinstance(nan, dict) and math.isnan(nan[frozenset()])
    assert inf == {frozenset(): math.inf}


def test_unsupported_promql_is_refused_not_guessed() -> None:
    for expr in ("histogram_quantile(0.9, x)", "a > 1", "rate(x)", "sum(x) by"):
        with pytest.raises(promql.PromQLError):
            promql.parse(expr)
