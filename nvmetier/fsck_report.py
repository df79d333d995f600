"""What ``nvmetier fsck`` prints: a store's result in a few lines a person
can read, and where progress goes.

Owns: ``format_result`` (a ``StoreResult`` as text: layout, slots, live
sharers, the deep scan, the first ``MAX_ERRORS_SHOWN`` errors, the verdict and
a hint that names the fix) and ``progress_stream``. Pure formatting, no I/O;
called by the CLI's thread. ``nvmetier.fsck`` checks and repairs, and
re-exports these names.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TextIO

from nvmetier import format as fmt

if TYPE_CHECKING:
    from nvmetier.fsck import StoreResult

MAX_ERRORS_SHOWN = 20


_SUMMARY_KEYS = ("dtype", "chunk_bytes", "tp_size", "pp_size")


def _identity_line(identity: dict[str, Any] | None) -> str:
    """The model and the most telling identity fields (``info`` shows all)."""
    if not identity:
        return "unknown"
    model = identity.get("model_name") or identity.get("model") or "?"
    shown = [f"{k}={identity[k]}" for k in _SUMMARY_KEYS if k in identity]
    hidden = len(identity) - len(shown) - 1
    if hidden > 0:
        shown.append(f"+{hidden} more fields")
    return f"{model} ({', '.join(shown)})"


def format_result(res: StoreResult) -> str:
    """A few lines a person can read."""
    # The checker's names, at call time: nvmetier.fsck re-exports this module.
    from nvmetier.fsck import (
        EXIT_CLEAN,
        EXIT_CORRECTED,
        EXIT_OPERATIONAL,
        EXIT_UNCORRECTED,
        RECORD_KINDS,
        STORE_KINDS,
    )

    lines = [f"{res.path}:"]
    if res.operational_error is not None:
        lines.append(f"  not checked: {res.operational_error}")
        return "\n".join(lines)
    if res.identity is not None:
        lines.append(f"  layout:  {_identity_line(res.identity)}")
        clean = "yes" if res.clean_shutdown else "no (crashed, killed, or still open)"
        lines.append(
            f"  slots:   {res.live} live of {res.slots} "
            f"({res.ways} ways, {res.slot_bytes}-byte slots, {res.n_paths} path(s)); "
            f"clean shutdown: {clean}"
        )
    if res.sharers:
        pids = ", ".join(str(p) for p in res.sharers)
        lines.append(
            f"  live:    checked read-only while {len(res.sharers)} process(es) are attached "
            f"(pid {pids}); findings were re-read to rule out slots being rewritten"
        )
    if res.deep:
        mode = "O_DIRECT" if res.o_direct else "buffered"
        extra = (
            f"; {res.deep_unchecked} on other root_dir entries not checked"
            if res.deep_unchecked
            else ""
        )
        if res.deep_no_key:
            lines.append(
                f"  deep:    encrypted store: {res.deep_unchecked} payloads NOT verified, no key "
                "given; run again with --key-file PATH (the tier's encryption key_file)"
            )
        else:
            other = (
                f"; {res.deep_other_key} sealed under another key (a rotated key's: misses)"
                if res.deep_other_key
                else ""
            )
            what = "tags verified" if res.encrypted else "payloads read"
            n = res.deep_checked - res.deep_other_key
            lines.append(f"  deep:    {n} {what} ({mode}){extra}{other}")
    elif res.n_paths > 1:
        lines.append(
            f"  note:    data files of the other {res.n_paths - 1} root_dir entries are not "
            "checked (only the main one is known from ROOT)"
        )
    for e in res.errors[:MAX_ERRORS_SHOWN]:
        tag = " [repaired]" if e.repaired else ""
        lines.append(f"  {e.kind}: {e.detail}{tag}")
    if len(res.errors) > MAX_ERRORS_SHOWN:
        lines.append(f"  ... and {len(res.errors) - MAX_ERRORS_SHOWN} more (use --json)")
    verdict = {
        EXIT_CLEAN: "clean",
        EXIT_CORRECTED: f"{len(res.errors)} error(s), all repaired",
        EXIT_UNCORRECTED: f"{len(res.errors)} error(s), {len(res.errors) - res.repaired} "
        "left uncorrected",
    }[res.exit_code & ~EXIT_OPERATIONAL if res.deep_no_key else res.exit_code]
    if res.deep_no_key:
        verdict += "; payloads not verified (no key)"
    lines.append(f"  result:  {verdict} ({res.elapsed_s:.2f}s)")
    if res.exit_code == EXIT_UNCORRECTED:
        if any(e.kind in RECORD_KINDS for e in res.errors if not e.repaired):
            lines.append("  hint:    run again with --repair to drop the bad records")
        if res.format_version is not None and res.format_version != fmt.FORMAT_VERSION:
            lines.append(
                f"  hint:    another nvmetier made this store (format version "
                f"{res.format_version}; this one reads {fmt.FORMAT_VERSION}): use that "
                "version's fsck, or, it being a cache, remove this directory and let the "
                "server create a new store"
            )
        elif any(e.kind in STORE_KINDS or e.kind == "read_error" for e in res.errors):
            lines.append(
                "  hint:    the store's files are damaged; it is a cache: stop the server, "
                "remove this directory and let the server create a new store"
            )
    return "\n".join(lines)


def progress_stream() -> TextIO | None:
    """stderr when it is a terminal, else None (plain output when piped)."""
    return sys.stderr if sys.stderr.isatty() else None
