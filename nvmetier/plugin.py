"""vLLM plugin entry point: registers the short tier type ``"nvme"``.

Declared in pyproject.toml under ``vllm.general_plugins``; vLLM calls
``register()`` in every process at start-up (and may call it more than once).
Imports only vLLM's factory; the tier itself loads lazily on first use.
"""

from __future__ import annotations

SHORT_NAME = "nvme"


def register() -> None:
    """Register ``{"type": "nvme", ...}`` with ``SecondaryTierFactory``. Idempotent."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    if SHORT_NAME in SecondaryTierFactory._registry:
        return
    SecondaryTierFactory.register_tier(SHORT_NAME, "nvmetier.vllm", "NvmeTierManager")
