"""nvmetier's backpressure detectors for vLLM's tiering, and their defaults.

Owns ``StorageBackpressureDetector`` (vLLM's EMA detector with a storage
tier's failure threshold, for a user-written ``backpressure`` section),
``FailureBackpressureDetector`` (the default: failed stores only),
``default_backpressure_detector`` and the warning about a top-level
``backpressure`` section; registers nvmetier's tier type names as storage
with vLLM's detector at import. Re-exported by ``nvmetier.vllm``, under whose
names vLLM's configs refer to them (``"nvmetier.vllm.StorageBackpressureDetector"``).

Threads: built and called by vLLM's orchestrator on its scheduler thread;
nothing blocks.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from vllm.v1.kv_offload.tiering.backpressure import (
    BackpressureDetector,
    EMABackpressureDetector,
)

from nvmetier.vllm import compat

logger = logging.getLogger("nvmetier.vllm")

# The tier type names under which vLLM may build this tier: the plugin's short
# name and the class name used with module_path.
TIER_TYPES = ("nvme", "NvmeTierManager")

# vLLM's EMABackpressureDetector.default_config() adds failure_threshold only
# for the tier types it knows as storage ("fs", "obj"). nvmetier is storage
# too: adding our types there gives a user-written ``backpressure`` section
# the same default failure threshold as vLLM's fs tier, and an explicit
# ``failure_threshold`` still wins (vLLM's factory only fills missing keys).
# The factory imports this module before it builds the detector.
_storage_types = getattr(EMABackpressureDetector, "_STORAGE_TIER_TYPES", None)
if isinstance(_storage_types, frozenset):
    EMABackpressureDetector._STORAGE_TIER_TYPES = _storage_types | frozenset(TIER_TYPES)


compat.refuse_unsupported_failure_threshold()


class StorageBackpressureDetector(compat.FailureCountingMixin, EMABackpressureDetector):
    """vLLM's EMA detector with a storage tier's failure threshold, on every
    supported vLLM.

    For a user-written ``backpressure`` section::

        {"backpressure_cls": "nvmetier.vllm.StorageBackpressureDetector",
         "failure_threshold": 5}

    Judges store latency as vLLM's ``EMABackpressureDetector`` does, and
    ``failure_threshold`` consecutive failed store jobs (default 3) put the
    tier under pressure: on 0.33 by vLLM itself, on 0.32 (whose detector has
    no failure threshold) by ``compat.FailureCountingMixin``.
    """

    @classmethod
    def default_config(cls, tier_type: str, *, locality: str | None = None) -> dict[str, Any]:
        config = dict(EMABackpressureDetector.default_config(tier_type, locality=locality) or {})
        config.setdefault("failure_threshold", compat.DEFAULT_FAILURE_THRESHOLD)
        return config


class FailureBackpressureDetector(compat.FailureCountingMixin, EMABackpressureDetector):
    """vLLM's EMA detector, judging failed stores only.

    ``failure_threshold`` consecutive failed store jobs (write errors, or keys
    dropped for a full queue or busy sets) put the tier under pressure, and
    the pressure decays exactly as vLLM's does. Completed stores count as
    healthy whatever their latency: the tier asks for no tier-poll thread, so
    vLLM observes a store's completion only at its next scheduler step, and
    the latency it would judge (submit to that step, per MiB) is mostly the
    step's length. A small job (one 2 MiB chunk in a 30 ms decode step: 15
    ms/MiB, over the 10 ms/MiB local high watermark) would read as overload
    and drop healthy stores. A user-written ``backpressure`` section gets
    vLLM's latency-judging detector as written.

    On vLLM 0.32, whose orchestrator reports successful stores only, the
    failure streak is kept by ``compat.FailureCountingMixin`` and fed by the
    tier (``get_finished_jobs``); on 0.33 it is vLLM's own.
    """

    def on_store_completed(self, elapsed_s: float, num_bytes: int) -> None:
        super().on_store_completed(0.0, num_bytes)


def default_backpressure_detector(tier_type: str, locality: str | None) -> BackpressureDetector:
    """The detector a tier gets when its config has no ``backpressure`` section.

    vLLM builds a detector only from a ``backpressure`` section, so without
    one, failed and dropped stores would never hold cascades back. This one
    has vLLM's watermarks for the locality (LOCAL, or REMOTE when the tier
    says so) and its storage ``failure_threshold`` (3 consecutive failed
    store jobs put the tier under pressure); see
    ``FailureBackpressureDetector`` for why latency alone does not.
    """
    config = EMABackpressureDetector.default_config(tier_type, locality=locality)
    config.setdefault("failure_threshold", compat.DEFAULT_FAILURE_THRESHOLD)
    return FailureBackpressureDetector(**config)


# Offloading specs whose top-level backpressure section was warned about.
_warned_top_level_backpressure: weakref.WeakSet[Any] = weakref.WeakSet()


def warn_top_level_backpressure(offloading_spec: Any, tier_label: str) -> None:
    """Warn, once per engine, that a top-level ``backpressure`` section of
    ``kv_connector_extra_config`` reaches this tier.

    vLLM merges that section into every secondary tier's config, so this tier
    gets vLLM's latency-judging detector instead of nvmetier's failure-only
    default (``FailureBackpressureDetector``), which the step-bound latency
    vLLM measures for this tier would put under pressure with healthy stores.
    """
    extra = getattr(offloading_spec, "extra_config", None)
    if not isinstance(extra, dict) or extra.get("backpressure") is None:
        return
    try:
        if offloading_spec in _warned_top_level_backpressure:
            return
        _warned_top_level_backpressure.add(offloading_spec)
    except TypeError:  # not weak-referenceable: warn every time
        pass
    logger.warning(
        "nvmetier: kv_connector_extra_config has a top-level 'backpressure' section, which "
        "vLLM merges into every secondary tier: tier %s judges store latency with it instead "
        "of nvmetier's failure-only default, and the latency vLLM sees for this tier is mostly "
        "the scheduler step, so healthy stores can be dropped. Move the section into the "
        "tiers that need it (secondary_tiers[i].backpressure); for the nvmetier tier, leave "
        "it out to keep the default, or write one on the tier itself to judge latency",
        tier_label,
    )
