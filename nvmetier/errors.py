"""The exception hierarchy of nvmetier.

Owns: nothing but types. Every error a user can cause carries a message that
names the problem, the value and the fix; the CLI prints it on one line.
"""

from __future__ import annotations


class NvmeTierError(Exception):
    """Base class of every error nvmetier raises on purpose."""


class ConfigError(NvmeTierError, ValueError):
    """A configuration key or value is wrong (raised at construction)."""


class FormatError(NvmeTierError):
    """An on-disk structure is not what this version of nvmetier expects."""


class StoreLockedError(NvmeTierError):
    """Another process holds the store's exclusive lock."""


class StoreSpaceError(NvmeTierError):
    """The filesystem has too little free space to preallocate the store."""


class EngineUnavailableError(NvmeTierError):
    """The requested I/O engine cannot run on this machine."""


class EngineClosedError(NvmeTierError):
    """An op was submitted to an engine after ``close()``."""
