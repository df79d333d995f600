"""``nvmetier bench --plot``: a plot that cannot be made is an error, never a silent skip.

matplotlib is the optional ``bench`` extra. Each test runs the real console
entry point in a subprocess; "matplotlib missing" is made real there by a
``sys.modules["matplotlib"] = None`` entry, which makes every import of it fail.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.clikit import REPO

pytestmark = pytest.mark.timeout(120)

EXIT_OPERATIONAL = 8  # the CLI's "operational error" (docs/operations.md)
HINT = "pip install 'nvmetier[bench]'"
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
needs_matplotlib = pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib not installed")

_MAIN = "import sys; from nvmetier.cli import main; sys.exit(main(sys.argv[1:]))"


def _bench(*args: str, hide_matplotlib: bool = False) -> subprocess.CompletedProcess[str]:
    code = ("import sys; sys.modules['matplotlib'] = None; " if hide_matplotlib else "") + _MAIN
    return subprocess.run(
        [sys.executable, "-c", code, "bench", *args],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=REPO,
    )


def _tiny_run(tmp: Path, plot: Path | str) -> list[str]:
    """A sub-second engine-level run writing into ``tmp/run``."""
    return [
        "--level",
        "engine",
        "--bs",
        "64k",
        "--size",
        "1m",
        "--iodepth",
        "4",
        "--dir",
        str(tmp / "run"),
        "--no-drop-caches",
        "--output-format",
        "json",
        "--plot",
        str(plot),
    ]


def _report(path: Path) -> str:
    row = {"level": "tier", "bs": 65536, "runtime_s": 1.0, "ops": 16}
    results = [
        {**row, "target": "nvmetier-threads", "phase": phase, "bytes": 1 << 20}
        for phase in ("write", "read")
    ]
    path.write_text(json.dumps({"results": results}))
    return str(path)


def _assert_plot_error(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    assert proc.returncode == EXIT_OPERATIONAL, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("nvmetier bench: --plot ")]
    assert len(errors) == 1, proc.stderr
    for w in words:
        assert w in errors[0], errors[0]


def test_run_without_matplotlib_fails_before_running(tmp_path: Path) -> None:
    png = tmp_path / "gbps.png"
    proc = _bench(*_tiny_run(tmp_path, png), hide_matplotlib=True)
    _assert_plot_error(proc, "matplotlib is not installed", HINT, str(png))
    assert proc.stdout == ""  # no report: nothing ran
    assert not (tmp_path / "run").exists()
    assert not png.exists()


def test_summarize_without_matplotlib_fails(tmp_path: Path) -> None:
    png = tmp_path / "medians.png"
    proc = _bench(
        "--summarize", _report(tmp_path / "r.json"), "--plot", str(png), hide_matplotlib=True
    )
    _assert_plot_error(proc, "matplotlib is not installed", HINT)
    assert not png.exists()


def test_summarize_without_plot_needs_no_matplotlib(tmp_path: Path) -> None:
    proc = _bench("--summarize", _report(tmp_path / "r.json"), hide_matplotlib=True)
    assert proc.returncode == 0, proc.stderr
    assert "| write | 64KiB |" in proc.stdout


@needs_matplotlib
def test_plot_into_a_missing_directory_fails_before_running(tmp_path: Path) -> None:
    png = tmp_path / "no" / "such" / "gbps.png"
    proc = _bench(*_tiny_run(tmp_path, png))
    _assert_plot_error(proc, "does not exist", str(png.parent))
    assert not (tmp_path / "run").exists()


@needs_matplotlib
def test_run_writes_the_plot(tmp_path: Path) -> None:
    png = tmp_path / "gbps.png"
    proc = _bench(*_tiny_run(tmp_path, png))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["results"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_matplotlib
def test_summarize_writes_the_plot(tmp_path: Path) -> None:
    png = tmp_path / "medians.png"
    proc = _bench("--summarize", _report(tmp_path / "r.json"), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_matplotlib
def test_a_plot_that_cannot_be_written_after_the_run_fails_but_keeps_the_report(
    tmp_path: Path,
) -> None:
    # PATH is a directory: the checks before the run pass, savefig fails after it.
    target = tmp_path / "a-directory.png"
    target.mkdir()
    proc = _bench(*_tiny_run(tmp_path, target))
    _assert_plot_error(proc, "cannot write the plot", str(target))
    report = json.loads(proc.stdout)
    assert report["results"]  # the measurements are not lost
    assert any("cannot write the plot" in n for n in report["notes"])
