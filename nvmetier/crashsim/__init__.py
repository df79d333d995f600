"""Crash-state exploration of a store's own writes and syncs (issue 31).

``hook`` is the only part the store's modules import: a module-level
``recorder`` (None in production) and the test-only planted bugs. The rest
(``recorder``, ``model``, ``explorer``, ``checks``, ``workloads`` and the
``python -m nvmetier.crashsim`` command) is loaded only by tests and by a
person replaying a state. Importing this package loads nothing else.
"""
