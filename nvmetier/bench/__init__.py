"""fio-style benchmark of nvmetier at five levels, with fio and vLLM's ``fs`` tier beside it.

Owns: the ``nvmetier bench`` / ``tools/bench`` command. Everything here runs on
the calling thread (plus the threads of the engines and stores it builds, and
the replica processes of the trace level) and blocks for the length of the
run; it is a tool, never imported by the tier.

Modules, lowest first (no level imports another, and the import graph has no
cycle: tests/bench/test_bench_imports.py): ``machine`` and ``common``
(shared helpers), ``clock`` (the CPU a tier costs, for the ``vllm`` and
``trace`` levels), ``report`` (results, tables, plots, ``--summarize``), one
module per level (``engine``, ``tier``, ``vllm``, ``reopen``, ``trace``) plus
``fio``, and ``main`` (the command line). This package re-exports what the
command line and the tests use.

Levels (``--level``):

- ``engine``: a raw ``IoEngine`` over one preallocated file per job; ops of
  ``--bs`` bytes with ``--iodepth`` in flight. The engine computes its XXH3 per
  op as it always does; nothing else is verified.
- ``tier``: the full ``BlockStore`` API (store/load jobs, completions collected by ``poll``,
  index records, checksums verified on load) with a plain anonymous mmap as
  the "primary".
- ``vllm``: vLLM's real ``TieringOffloadingManager`` with a simulated GPU
  worker (``nvmetier.vllm.harness``), once with our ``NvmeTierManager`` and once
  with vLLM's own ``fs`` tier, in the same invocation. Store phase = the
  cascade of N chunks (first store to every cascade job finished); load phase =
  reset the primary, then promote every chunk in batches of the primary's
  capacity (one request per batch, so one big promotion job per batch).
- ``reopen``: time ``BlockStore`` open of a store whose index holds ``--slots``
  valid records (written directly with ``format.pack_record``).
- ``trace``: replay a request trace (Mooncake format) through vLLM's
  orchestrator on ``--replicas`` engine processes and report the hit ratio
  next to the exact LRU of the same capacity, and the capacity curve.

``--rw``: ``write``/``randwrite`` time a write pass; ``read``/``randread`` time a
read pass after an untimed write pass (reading unwritten fallocated extents
would return zeros without touching the disk); ``rw`` times a write pass, then
a read pass. Note this differs from fio, where ``rw`` is a mixed workload.

Latency is completion latency as the submitter sees it (submit to reap), per
op at the engine level and per job at the tier level. CPU is ``os.times()`` of
the whole process (all threads), per 10^9 bytes moved. GB/s is 10^9 bytes/s.
"""

from nvmetier.bench.clock import _TierClock
from nvmetier.bench.common import GB, LEVELS, PCTS, RW_MODES
from nvmetier.bench.machine import drop_caches, machine_info
from nvmetier.bench.main import build_parser, main
from nvmetier.bench.report import (
    LookupStats,
    PhaseResult,
    cpu_table,
    plot,
    summarize,
    summary_table,
)

__all__ = [
    "GB",
    "LEVELS",
    "PCTS",
    "RW_MODES",
    "LookupStats",
    "PhaseResult",
    "_TierClock",
    "build_parser",
    "cpu_table",
    "drop_caches",
    "machine_info",
    "main",
    "plot",
    "summarize",
    "summary_table",
]
