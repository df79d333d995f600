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


class FormatVersionError(FormatError):
    """A store written in another on-disk format version (not damaged:
    another nvmetier made it). ``version`` is the store's."""

    def __init__(self, message: str, version: int) -> None:
        super().__init__(message)
        self.version = version


class StoreLockedError(NvmeTierError):
    """Another process holds the store's exclusive lock."""


class StoreSpaceError(NvmeTierError):
    """The filesystem has too little free space to preallocate the store."""


class StoreIOError(NvmeTierError, OSError):
    """The store's files could not be opened or created: the filesystem
    answered with an error (``errno`` and ``filename`` are the OSError's).
    The message names the store, the file, the error and what to do."""

    def __init__(self, message: str, cause: OSError) -> None:
        OSError.__init__(self, cause.errno, cause.strerror, cause.filename)
        self.message = message

    def __str__(self) -> str:
        return self.message


class EngineUnavailableError(NvmeTierError):
    """The requested I/O engine cannot run on this machine."""


class EngineClosedError(NvmeTierError):
    """An op was submitted to an engine after ``close()``."""
