"""Shared fixtures. The suite runs once per engine: ``.ci/run`` sets
``NVMETIER_ENGINE=threads`` and then ``NVMETIER_ENGINE=uring``."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator

import pytest


def pytest_report_header(config: pytest.Config) -> str:
    return f"nvmetier engine: {os.environ.get('NVMETIER_ENGINE', 'auto')}"


@pytest.fixture
def buffer() -> Iterator[memoryview]:
    """A page-aligned 'primary region' of 64 rows of 64 KiB."""
    mm = mmap.mmap(-1, 64 * 65536)
    view = memoryview(mm)
    yield view
    view.release()
    mm.close()


@pytest.fixture
def buf(buffer: memoryview) -> memoryview:
    """The same region under the short name the fault and CLI suites use."""
    return buffer
