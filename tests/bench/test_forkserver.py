"""Replica processes import the installed nvmetier, whatever the current
directory holds (issue 15, item 12): ``nvmetier bench --level trace`` run
from a directory holding the source tree (no compiled extensions there)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

DRIVER = textwrap.dedent(
    """
    import runpy, sys
    import nvmetier
    from nvmetier.bench.common import forkserver_context

    if __name__ == "__main__":
        ctx = forkserver_context(["nvmetier.files"])
        p = ctx.Process(target=runpy.run_path, args=(sys.argv[1],))
        p.start()
        p.join(60)
        print(nvmetier.__file__)
        sys.exit(p.exitcode)
    """
)
PROBE = textwrap.dedent(
    """
    import sys
    import nvmetier
    with open(sys.argv[0] + ".out", "w") as f:
        f.write(nvmetier.__file__)
    """
)


def test_forkserver_children_import_the_package_the_parent_imports(tmp_path) -> None:
    tree = tmp_path / "checkout"  # a source tree in the current directory
    (tree / "nvmetier").mkdir(parents=True)
    (tree / "nvmetier" / "__init__.py").write_text("# a source tree, not built\n")
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "driver.py").write_text(DRIVER)
    probe = tools / "probe.py"
    probe.write_text(PROBE.replace("sys.argv[0]", repr(str(probe))))
    run = subprocess.run(
        [sys.executable, str(tools / "driver.py"), str(probe)],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    parent = run.stdout.strip().splitlines()[-1]
    child = (tools / "probe.py.out").read_text()
    assert child == parent
    assert not child.startswith(str(tree))
