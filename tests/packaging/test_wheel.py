"""The release wheel: ``scripts/build-wheel.sh`` makes a manylinux wheel that installs elsewhere.

Builds the sdist and the wheel for real (an isolated build, then ``auditwheel
repair``), checks the tag and auditwheel's verdict, and installs the wheel into
a fresh venv outside the source tree, where both native extensions must import.
About 30 s. The build does not depend on the I/O engine, so it runs in the
threads pass of ``scripts/test.sh`` only.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.cli.clikit import REPO

pytest.importorskip("build", reason="build is in the [dev] extra (scripts/setup.sh)")
pytest.importorskip("auditwheel", reason="auditwheel is in the [dev] extra (scripts/setup.sh)")

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        os.environ.get("NVMETIER_ENGINE") == "uring",
        reason="engine-independent: runs in the threads pass",
    ),
]

PY_TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"


def _run(*cmd: str, cwd: str | Path = REPO, timeout: float = 400) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=_env())
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _env() -> dict[str, str]:
    # The fresh venv must not see this tree or the dev venv's packages.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHON"] = sys.executable
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    printed = _run("bash", "scripts/build-wheel.sh", str(out)).splitlines()
    path = Path(printed[-1])
    assert path.parent == out and path.is_file(), printed
    assert sorted(p.name for p in out.iterdir()) == sorted([path.name, "nvmetier-0.1.0.tar.gz"]), (
        list(out.iterdir())
    )
    return path


def test_the_wheel_is_tagged_manylinux(wheel: Path) -> None:
    machine = platform.machine()
    assert re.fullmatch(
        rf"nvmetier-0\.1\.0-{PY_TAG}-{PY_TAG}-manylinux_2_\d+_{machine}\.whl", wheel.name
    ), wheel.name


def test_auditwheel_finds_the_wheel_manylinux_compliant(wheel: Path) -> None:
    shown = " ".join(_run(sys.executable, "-m", "auditwheel", "show", str(wheel)).split())
    tag = wheel.name.rsplit("-", 1)[1].removesuffix(".whl")
    assert f'is consistent with the following platform tag: "{tag}"' in shown, shown
    # liburing is linked in statically (or copied in by repair): nothing to install beside it.
    assert "external shared libraries are required" not in shown, shown


def test_the_wheel_carries_both_extensions_the_license_and_the_dependencies(
    wheel: Path,
) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = zf.read("nvmetier-0.1.0.dist-info/METADATA").decode()
    for ext in ("_table", "_uring"):
        assert any(re.fullmatch(rf"nvmetier/{ext}\.cpython-.*\.so", n) for n in names), names
    assert "nvmetier-0.1.0.dist-info/licenses/LICENSE" in names
    assert "License-Expression: Apache-2.0" in meta.splitlines()
    assert any(line.startswith("Requires-Dist: typing_extensions") for line in meta.splitlines())
    assert 'Requires-Dist: matplotlib>=3.8; extra == "bench"' in meta.splitlines()


def test_the_wheel_installs_into_a_fresh_venv_and_its_extensions_import(
    wheel: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", str(venv))
    py = str(venv / "bin" / "python")
    _run(py, "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel))
    # From tmp_path, so the source tree is not what gets imported.
    where = _run(
        py,
        "-c",
        "import nvmetier, nvmetier._table, nvmetier._uring; print(nvmetier._table.__file__)",
        cwd=tmp_path,
    ).strip()
    assert where.startswith(str(venv)), where
    assert "usage: nvmetier" in _run(str(venv / "bin" / "nvmetier"), "--help", cwd=tmp_path)
