"""The shared table's rules (``native/nvt_core.c``, no Python) driven from C:
``tests/native/c/test_core.c`` is built with the system compiler and run. A
missing compiler is a skip. ``NVMETIER_SANITIZE`` (``address,undefined``,
``thread``) builds it with that sanitizer (scripts/sanitize.sh)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NATIVE = os.path.join(ROOT, "native")
SOURCES = ["nvt_core.c", "nvt_hash.c", "nvt_hash_avx2.c", "nvt_hash_avx512.c"]


def test_the_core_runs_from_c_alone(tmp_path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    exe = str(tmp_path / "test_core")
    sanitize = os.environ.get("NVMETIER_SANITIZE", "")
    flags = (
        [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all", "-g"]
        if sanitize
        else []
    )
    build = subprocess.run(
        [
            cc,
            *flags,
            "-O2",
            "-Wall",
            "-Werror",
            "-std=gnu11",
            f"-I{NATIVE}",
            os.path.join(ROOT, "tests", "native", "c", "test_core.c"),
            *(os.path.join(NATIVE, s) for s in SOURCES),
            "-o",
            exe,
            "-lpthread",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert build.returncode == 0, build.stderr
    run = subprocess.run([exe], capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ok bounded set lock" in run.stdout
    assert "ok set lock awaited" in run.stdout
