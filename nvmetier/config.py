"""Tier configuration: parsing, defaults and validation.

Owns: ``TierConfig`` and the parsing of sizes such as ``"500GiB"``. Pure
functions, no I/O, no threads. Every bad or unknown key raises one
``ConfigError`` that names the key, the value and what is accepted.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping
from typing import Any

from nvmetier.errors import ConfigError

# 64 ways: on prefix-cache traffic (a lookup stops at the first miss, so one
# block evicted early from its set cuts off the rest of a conversation) 16
# ways served 67% of an exact LRU's hits on the Mooncake trace, 64 ways ~83%
# (docs/bench.md); the table's tag array keeps a 64-way lookup to one line.
DEFAULT_WAYS = 64
SHARING_MODES = ("node", "process")
LOCALITIES = ("LOCAL", "REMOTE")  # vLLM's Locality values
STAGING_MODES = ("auto", "on", "off")

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1000**4,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object, key: str = "size") -> int:
    """Parse a byte count: an int, or a string like ``"500GiB"``, ``"1.5TB"``.

    Binary units (KiB, MiB, GiB, TiB, and the bare K/M/G/T) are powers of 1024;
    KB/MB/GB/TB are powers of 1000.

    Raises:
        ConfigError: naming ``key`` when the value is not a positive size.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} is not a size; use bytes or a string like '500GiB'")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(
                f"{key}={value!r} is not a size; use bytes or a number with a unit "
                "(B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. '500GiB'"
            )
        n = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise ConfigError(
            f"{key}={value!r} ({type(value).__name__}) is not a size; "
            "use bytes or a string like '500GiB'"
        )
    if n <= 0:
        raise ConfigError(f"{key}={value!r} must be greater than zero")
    return n


_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
# The longest duration accepted (~100 years): stored as whole seconds in a
# u32 of the table header for ``nvmetier info``.
MAX_DURATION_S = float(100 * 365 * 86400)


def parse_duration(value: object, key: str = "duration") -> float:
    """Parse a duration in seconds: a number, or a string like ``"24h"``,
    ``"90s"``, ``"15m"``, ``"7d"`` (a bare number string is seconds).

    Raises:
        ConfigError: naming ``key`` when the value is not a positive duration.
    """
    fix = "use seconds or a number with a unit (s, m, h, d), e.g. '24h' or '90s'"
    if isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} is not a duration; {fix}")
    if isinstance(value, (int, float)):
        secs = float(value)
    elif isinstance(value, str):
        m = _DURATION_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or (unit or "s") not in _DURATION_UNITS:
            raise ConfigError(f"{key}={value!r} is not a duration; {fix}")
        secs = float(m.group(1)) * _DURATION_UNITS[unit or "s"]
    else:
        raise ConfigError(f"{key}={value!r} ({type(value).__name__}) is not a duration; {fix}")
    if not secs > 0 or secs > MAX_DURATION_S:
        raise ConfigError(f"{key}={value!r} must be greater than zero and at most 100 years; {fix}")
    return secs


def format_duration(secs: float) -> str:
    """``86400`` -> ``"1d"``, ``90`` -> ``"90s"``, ``5400`` -> ``"1.5h"``."""
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if secs >= size:
            return f"{secs / size:g}{unit}"
    return f"{secs:g}s"


def format_size(n: int) -> str:
    """``1073741824`` -> ``"1.00 GiB"``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} B" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


@dataclasses.dataclass(frozen=True)
class TierConfig:
    """Validated configuration of one tier (one store per layout identity).

    Attributes:
        root_dir: one directory per drive; slots are striped across them.
        capacity_bytes: the hard bound on disk usage (data files + index),
            summed over all root_dir entries, fixed when the store is created.
            Given as a list (one per root_dir), each drive gets its own bound.
        capacity_per_path: the per-drive bounds when capacity_bytes was a list.
        io_engine: ``auto`` (io_uring if usable, else threads), ``threads``
            or ``uring``.
        io_threads: worker threads of the thread engine.
        io_workers: io_uring workers (each one ring and one native I/O
            thread): an int from 1 to 64, or ``"auto"`` (the default): one
            per drive (the distinct block devices under ``root_dir``, a
            RAID/dm device counted as its member drives), at most the CPUs
            this process may run on. A drive faster than one worker
            (~8 GB/s of XXH3-checked I/O per core) wants an explicit value.
            The thread engine ignores it (``io_threads`` sizes it).
        queue_depth: ops in flight per drive in the io_uring engine.
        staging: ``auto`` (the default), ``on`` or ``off``: move each load
            and store through a small staging arena of transparent huge
            pages (copied to or from the primary) instead of straight
            between the primary and the drive. vLLM's CPU primary is a
            ``/dev/shm`` mapping of scattered 4 KiB pages, each one a block
            segment: a 2 MiB chunk becomes several block requests and fills
            a virtio ring or an NVMe drive's PRP/SGL budget. ``auto`` stages
            when the primary is not huge-page backed and the host allows
            transparent huge pages for private memory (see
            ``nvmetier.memory``). Costs one memcpy per chunk (~0.15 CPU s/GB)
            and up to ``max_inflight_bytes`` of RAM.
        ways: slots per hash set (associativity of the slot index). None
            (the default): ``DEFAULT_WAYS``, or fewer when the capacity holds
            fewer slots; an explicit value that does not fit is an error.
        verify_checksums: verify the XXH3 checksum of every chunk loaded.
        o_direct: ``auto`` (probe, fall back to buffered with one warning),
            ``True`` (fail if refused) or ``False`` (buffered I/O).
        enable_kv_events: emit stored/removed KV events.
        max_inflight_bytes: the cap on bytes in flight at the drives; the
            engine sizes them per drive from the drive count and chunk size
            (see ``nvmetier.engine.inflight_bytes``) and never above this.
        max_queued_bytes: stores beyond this many queued bytes are dropped
            (counted) instead of stalling the engine.
        admit_after_lookups: store a chunk only once it was looked up this
            many times (0: store everything).
        persist: keep the store at shutdown (False removes it).
        locality: ``LOCAL`` (the default; null means the default) or
            ``REMOTE``, any case. vLLM reads it for per-request tier filters
            (a request that asks for REMOTE tiers skips a LOCAL one; a tier
            with no locality would match every filter) and for its
            backpressure watermarks.
        default_backpressure: with no ``backpressure`` section in the tier
            config, give the tier vLLM's ``EMABackpressureDetector`` anyway
            (the watermarks of its locality, 3 consecutive failed stores put
            it under pressure). False: no detector unless a section asks.
        promotion_guard: plan each request's disk hits against vLLM's CPU
            tier (every KV group, the step's other requests, pinned and
            in-flight chunks) and answer HIT exactly for the chunks vLLM will
            promote and load, pinning what the plan keeps until vLLM
            schedules the request (``nvmetier.vllm.promotion``). False: every
            chunk on disk is a HIT, as vLLM's own tiers answer (a prompt
            longer than the CPU tier then re-reads it step after step and
            loads nothing).
        promotion_fraction: the share of the CPU tier's chunks one request
            may promote over its life, in (0, 1].
        encryption: ``{"key_file": PATH}``: seal every chunk with AES-256-GCM
            under a key derived from the 32-byte file at PATH (readable by its
            owner only; checked when the store opens) and name chunks in the
            index by a keyed MAC of their offload key. None: plaintext.
        recency_refresh_chunks: vLLM's tier: at most this many chunks of each
            finished request refresh their recency on disk (those the disk
            holds; the prompt's head first), whichever tier or the GPU prefix
            cache served them, so prefixes hot in the CPU tier or on the GPU
            are not the first the disk evicts (``nvmetier.vllm.recency``).
            ~50 ns of vLLM's scheduler thread per chunk. 0: off (the disk
            sees only its own stores and loads).
        retention: seconds (given as a number or a string such as ``"24h"``):
            a chunk stored longer ago than this (wall clock) is never served
            (a miss, counted in ``retention_expired``) and its slot is reused
            first. None (the default): chunks live until evicted.
        root_budget_bytes: one bound on the disk that every store under
            each ``root_dir`` entry occupies together (allocated blocks of
            every file, index and metadata included), whatever models start
            there. Recorded with the root (its ``budget`` file) at the first
            open that states it; a process stating another value gets a
            ``ConfigError`` (change the record with ``nvmetier budget ROOT
            --set SIZE``); a process stating none follows the record. None
            (the default) and no record: unbounded. When a new store does
            not fit, stores with no process attached give way, least
            recently used first (``nvmetier.budget``).
        min_capacity_bytes: the smallest store this process accepts when
            the root budget or the filesystem reserve leaves less room than
            ``capacity_bytes`` (the store is then made smaller, down to
            this, and reopened at that size later). None (the default): a
            quarter of ``capacity_bytes``; equal to ``capacity_bytes``:
            never smaller (refused instead).
        fs_reserve_bytes, fs_reserve_fraction: the free space a store's
            creation leaves on the filesystem (statvfs): the larger of the
            two, so a cache never fills the node's disk. Defaults: 5% of the
            filesystem, at least 1 GiB (None: 1 GiB, or half a filesystem
            smaller than 2 GiB, so a small dedicated volume stays usable).
            0 and 0 turn the reserve off.
    """

    root_dir: tuple[str, ...]
    capacity_bytes: int
    io_engine: str = "auto"
    io_threads: int = 16
    io_workers: int | str = "auto"
    queue_depth: int = 64
    staging: str = "auto"
    ways: int | None = None
    verify_checksums: bool = True
    o_direct: str | bool = "auto"
    enable_kv_events: bool = False
    max_inflight_bytes: int = 256 << 20
    max_queued_bytes: int = 1 << 30
    admit_after_lookups: int = 0
    persist: bool = True
    locality: str = "LOCAL"
    default_backpressure: bool = True
    sharing: str = "node"
    promotion_guard: bool = True
    promotion_fraction: float = 1.0
    capacity_per_path: tuple[int, ...] | None = None
    retention: float | None = None
    encryption: dict[str, str] | None = None
    recency_refresh_chunks: int = 4096
    root_budget_bytes: int | None = None
    min_capacity_bytes: int | None = None
    fs_reserve_bytes: int | None = None
    fs_reserve_fraction: float = 0.05

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "capacity_per_path")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> TierConfig:
        """Build and validate a config from user-facing keys.

        Raises:
            ConfigError: an unknown key (with the closest known one), a missing
                required key, or a bad value.
        """
        known = cls.keys()
        for key in raw:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(
                    f"unknown nvmetier config key {key!r}{hint}; accepted keys: {', '.join(known)}"
                )
        for key in ("root_dir", "capacity_bytes"):
            if key not in raw or raw[key] is None:
                raise ConfigError(
                    f"nvmetier config key {key!r} is required, e.g. "
                    '{"root_dir": "/mnt/nvme/kv", "capacity_bytes": "500GiB"}'
                )
        values = dict(raw)
        values["root_dir"] = _parse_roots(raw["root_dir"])
        if isinstance(raw.get("staging"), bool):
            # YAML 1.1 reads a bare on/off as true/false.
            values["staging"] = "on" if raw["staging"] else "off"
        cap = raw["capacity_bytes"]
        if isinstance(cap, (list, tuple)):
            if len(cap) != len(values["root_dir"]):
                raise ConfigError(
                    f"capacity_bytes={cap!r} has {len(cap)} entries but root_dir has "
                    f"{len(values['root_dir'])}; give one capacity per root_dir, or one total"
                )
            per_path = tuple(parse_size(c, f"capacity_bytes[{i}]") for i, c in enumerate(cap))
            values["capacity_per_path"] = per_path
            values["capacity_bytes"] = sum(per_path)
        else:
            values["capacity_bytes"] = parse_size(cap, "capacity_bytes")
        for key in ("max_inflight_bytes", "max_queued_bytes"):
            if key in raw:
                values[key] = parse_size(raw[key], key)
        for key in ("root_budget_bytes", "min_capacity_bytes"):
            if raw.get(key) is not None:
                values[key] = parse_size(raw[key], key)
        if raw.get("fs_reserve_bytes") is not None:
            reserve = raw["fs_reserve_bytes"]
            values["fs_reserve_bytes"] = (
                0 if reserve == 0 or reserve == "0" else parse_size(reserve, "fs_reserve_bytes")
            )
        if "fs_reserve_fraction" in raw and raw["fs_reserve_fraction"] is None:
            del values["fs_reserve_fraction"]
        if raw.get("encryption") is not None and isinstance(raw["encryption"], Mapping):
            values["encryption"] = dict(raw["encryption"])
        if "locality" in raw and raw["locality"] is None:
            del values["locality"]  # null: the default (LOCAL)
        if raw.get("retention") is not None:
            values["retention"] = parse_duration(raw["retention"], "retention")
        cfg = cls(**values)
        cfg._validate()
        return cfg

    def _validate(self) -> None:
        if self.io_engine not in ("auto", "threads", "uring"):
            raise ConfigError(
                f"io_engine={self.io_engine!r} is not an engine; use 'auto', 'threads' or 'uring'"
            )
        for key, lo, hi in (
            ("io_threads", 1, 256),
            ("queue_depth", 1, 4096),
            ("admit_after_lookups", 0, 1 << 20),
            ("recency_refresh_chunks", 0, 1 << 20),
        ):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ConfigError(f"{key}={value!r} must be an integer from {lo} to {hi}")
        workers = self.io_workers
        if workers != "auto" and (
            isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= 64
        ):
            raise ConfigError(
                f"io_workers={workers!r} must be 'auto' or an integer from 1 to 64 "
                "(io_uring workers, each one ring and one I/O thread)"
            )
        ways = self.ways
        if ways is not None and (
            isinstance(ways, bool) or not isinstance(ways, int) or not 1 <= ways <= 1024
        ):
            raise ConfigError(f"ways={self.ways!r} must be an integer from 1 to 1024")
        for key in (
            "verify_checksums",
            "enable_kv_events",
            "persist",
            "default_backpressure",
            "promotion_guard",
        ):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key}={getattr(self, key)!r} must be true or false")
        fraction = self.promotion_fraction
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, (int, float))
            or not 0 < fraction <= 1
        ):
            raise ConfigError(
                f"promotion_fraction={fraction!r} must be a number in (0, 1]: the share of "
                "vLLM's CPU tier one request may fill with disk hits (1: all of it)"
            )
        if self.retention is not None:
            parse_duration(self.retention, "retention")
        enc = self.encryption
        if enc is not None and (
            not isinstance(enc, Mapping)
            or set(enc) != {"key_file"}
            or not isinstance(enc["key_file"], str)
            or not enc["key_file"].strip()
        ):
            raise ConfigError(
                f"encryption={enc!r} must be {{'key_file': PATH}} naming a file of 32 random "
                "bytes readable only by its owner (head -c 32 /dev/urandom > PATH && "
                "chmod 600 PATH); leave encryption out (or null) for plaintext"
            )
        frac = self.fs_reserve_fraction
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 <= frac < 1:
            raise ConfigError(
                f"fs_reserve_fraction={frac!r} must be a number in [0, 1): the share of the "
                "filesystem a store's creation leaves free (0.05: 5%)"
            )
        if self.min_capacity_bytes is not None and self.min_capacity_bytes > self.capacity_bytes:
            raise ConfigError(
                f"min_capacity_bytes={self.min_capacity_bytes} is more than capacity_bytes="
                f"{self.capacity_bytes}; set it at most capacity_bytes (equal: a store is "
                "refused rather than made smaller)"
            )
        if self.staging not in STAGING_MODES:
            raise ConfigError(
                f"staging={self.staging!r} is not a staging mode; use 'auto', 'on' or 'off'"
            )
        if self.o_direct not in ("auto", True, False):
            raise ConfigError(f"o_direct={self.o_direct!r} must be 'auto', true or false")
        if self.sharing not in SHARING_MODES:
            raise ConfigError(
                f"sharing={self.sharing!r} is not a sharing mode; use 'node' (one store shared by "
                "every process on this machine) or 'process' (an exclusive store per process)"
            )
        if not isinstance(self.locality, str) or self.locality.upper() not in LOCALITIES:
            # A ValueError (ConfigError is one), as vLLM's Locality() raises.
            raise ConfigError(
                f"locality={self.locality!r} is not a valid Locality; accepted values: "
                + ", ".join(repr(v) for v in LOCALITIES)
                + " (any case, e.g. 'local')"
            )


def _parse_roots(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        roots: list[object] = [value]
    elif isinstance(value, (list, tuple)):
        roots = list(value)
    else:
        raise ConfigError(f"root_dir={value!r} must be a path or a list of paths (one per drive)")
    if not roots:
        raise ConfigError("root_dir=[] must name at least one directory")
    out: list[str] = []
    for r in roots:
        if not isinstance(r, str) or not r.strip():
            raise ConfigError(f"root_dir entry {r!r} must be a non-empty path string")
        out.append(r)
    if len(set(out)) != len(out):
        raise ConfigError(f"root_dir={out!r} names the same directory twice")
    return tuple(out)
