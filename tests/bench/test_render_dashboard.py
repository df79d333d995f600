"""tools/render_dashboard.py on the scrapes it saved from a real ``vllm
serve`` with nvmetier (docs/grafana/nvmetier-scrapes.json.xz): every panel
query the server could answer has data, the run shows the events the picture
is meant to show, and the picture redraws from them. ~2 CPU s (matplotlib)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from typing import Any

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(REPO, "tools", "render_dashboard.py")


@pytest.fixture(scope="module")
def tool() -> Any:
    spec = importlib.util.spec_from_file_location("render_dashboard", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run(tool) -> dict[str, Any]:
    with open(tool.DASHBOARD, encoding="utf-8") as f:
        dashboard = json.load(f)
    scrapes, interval = tool.load_scrapes(tool.DEFAULT_SCRAPES)
    series = tool.scrape_series(scrapes)
    lines: dict[tuple[str, str], dict[str, list[float]]] = {}
    for p in dashboard["panels"]:
        for target in p.get("targets", []):
            key = (p["title"], target["refId"])
            lines[key] = tool.target_lines(target, series, tool.variables_for(interval))
    return {"dashboard": dashboard, "scrapes": scrapes, "interval": interval, "lines": lines}


def peak(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return max(finite) if finite else math.nan


def test_every_query_the_server_answers_has_data(tool, run) -> None:

    assert len(run["scrapes"]) >= 20
    for p in run["dashboard"]["panels"]:
        for target in p.get("targets", []):
            got = run["lines"][(p["title"], target["refId"])]
            assert any(not math.isnan(peak(v)) for v in got.values()), (p["title"], target)


def test_the_run_shows_disk_hits_evictions_expiries_and_a_sharer(run) -> None:
    lines = run["lines"]
    vllm_hits = lines[("Hit ratio by tier", "A")]
    assert peak(vllm_hits["1:nvme (vLLM chunk hits)"]) > 0.5
    assert peak(lines[("nvmetier: bytes stored and loaded per second", "B")]["1:nvme loaded"]) > 0
    churn = lines[("Evictions, retention expiries, stores removed for the budget", "A")]
    assert peak(churn["1:nvme evictions /s"]) > 0
    expiries = lines[("Evictions, retention expiries, stores removed for the budget", "B")]
    assert peak(expiries["1:nvme retention expiries /s"]) > 0
    (sharers,) = lines[("Sharers", "A")].values()
    assert peak(sharers) == 2


def test_picture_redraws_from_the_saved_scrapes(tool, run, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "dash.png"
    tool.render(run["dashboard"], run["scrapes"], str(out), run["interval"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 50_000
