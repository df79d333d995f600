"""nvmetier: a persistent, bounded local-disk / NVMe secondary tier for vLLM's
KV-cache offloading.

Only ``nvmetier.vllm`` imports vLLM; everything else runs without it.
"""

from __future__ import annotations

__version__ = "0.1.0"
