"""Build hooks for the native extensions.

- ``nvmetier._table`` (the process-shared slot table and the data path) needs
  only a C compiler and is required: a store cannot open without it.
- ``nvmetier._crypto`` (AES-256-GCM through OpenSSL libcrypto) is optional
  the same way (libssl-dev).
- ``nvmetier._uring`` (the io_uring engine) is optional: when liburing is
  missing, the build prints one warning and the package installs without it
  (the thread engine is then used). liburing is linked statically where ``liburing.a`` exists, so an
installed wheel needs nothing at run time.
"""

from __future__ import annotations

import glob
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _uring_link_args() -> tuple[list[str], list[str]]:
    for pattern in ("/usr/lib/*/liburing.a", "/usr/lib/liburing.a", "/usr/local/lib/liburing.a"):
        found = sorted(glob.glob(pattern))
        if found:
            return [found[0]], []
    return [], ["uring"]


class OptionalBuildExt(build_ext):
    """build_ext that tolerates a failed optional extension."""

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # liburing missing, compile error
            if ext.name in REQUIRED or os.environ.get("NVMETIER_REQUIRE_NATIVE") == "1":
                raise
            self._warn(exc)

    @staticmethod
    def _warn(exc: BaseException) -> None:
        sys.stderr.write(
            f"WARNING: nvmetier's optional extension was not built ({exc}): without "
            "nvmetier._uring the thread engine is used (install liburing-dev), without "
            "nvmetier._crypto encryption at rest is unavailable (install libssl-dev).\n"
        )


REQUIRED = ("nvmetier._table",)
COMPILE_ARGS = ["-O2", "-Wall", "-Werror", "-std=gnu11", "-fvisibility=hidden"]
# NVMETIER_SANITIZE=address,undefined (or thread): a sanitized build for
# scripts/sanitize.sh, never for a wheel. The sanitizer runtime must then be
# preloaded into Python (LD_PRELOAD), which that script does.
SANITIZE = os.environ.get("NVMETIER_SANITIZE", "")
SANITIZE_ARGS = (
    [f"-fsanitize={SANITIZE}", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all", "-g"]
    if SANITIZE
    else []
)
COMPILE_ARGS += SANITIZE_ARGS
# The shared table's rules (nvt_core, no Python), its job path (nvt_jobs,
# nvt_job_submit, nvt_job_load, nvt_job_complete, nvt_job_worker, nvt_leases)
# and its CPython type (nvt_table,
# nvt_table_admin, nvt_table_module); the uring module is every other source,
# so a new table source must be listed here.
TABLE_SOURCES = [
    "native/nvt_table.c",
    "native/nvt_table_admin.c",
    "native/nvt_table_module.c",
    "native/nvt_hot_request.c",
    "native/nvt_guard_calls.c",
    "native/nvt_tier_calls.c",
    "native/nvt_jobs.c",
    "native/nvt_job_submit.c",
    "native/nvt_job_load.c",
    "native/nvt_job_complete.c",
    "native/nvt_job_worker.c",
    "native/nvt_refresh.c",
    "native/nvt_leases.c",
    "native/nvt_core.c",
    "native/nvt_hash.c",
    "native/nvt_hash_avx2.c",
    "native/nvt_hash_avx512.c",
    "native/nvt_hash_py.c",
]

# AES-256-GCM through OpenSSL libcrypto (libssl-dev), optional like the
# io_uring engine: nvmetier._crypto is what encryption at rest needs.
CRYPTO_SOURCES = ["native/nvt_crypto.c", "native/nvt_crypto_module.c", "native/nvt_seal.c"]

extra_objects, libraries = _uring_link_args()
# The io_uring engine seals and opens chunks in its own threads (nvt_crypto.c,
# libcrypto): it links libcrypto too.
native_sources = sorted(
    set(glob.glob("native/*.c")) - set(TABLE_SOURCES) - set(CRYPTO_SOURCES)
    | {
        "native/nvt_hash.c",
        "native/nvt_hash_avx2.c",
        "native/nvt_hash_avx512.c",
        "native/nvt_hash_py.c",
        "native/nvt_crypto.c",
        "native/nvt_seal.c",
    }
)
ext_modules = [
    Extension(
        "nvmetier._table",
        sources=TABLE_SOURCES,
        depends=sorted(glob.glob("native/*.h")),
        include_dirs=["native"],
        extra_compile_args=COMPILE_ARGS,
        extra_link_args=SANITIZE_ARGS,
        libraries=["pthread"],
    )
]
if native_sources:
    ext_modules.append(
        Extension(
            "nvmetier._uring",
            sources=native_sources,
            depends=sorted(glob.glob("native/*.h")),
            include_dirs=["native"],
            # Hidden visibility (and, for the static liburing, --exclude-libs) so
            # only PyInit__uring is exported: another liburing.so loaded in the
            # process cannot interpose on the one this module was built with.
            extra_compile_args=COMPILE_ARGS,
            extra_link_args=(["-Wl,--exclude-libs,ALL"] if extra_objects else []) + SANITIZE_ARGS,
            extra_objects=extra_objects,
            libraries=[*libraries, "crypto"],
            optional=True,
        )
    )

ext_modules.append(
    Extension(
        "nvmetier._crypto",
        sources=CRYPTO_SOURCES,
        depends=["native/nvt_crypto.h", "native/nvt_seal.h"],
        include_dirs=["native"],
        extra_compile_args=COMPILE_ARGS,
        extra_link_args=SANITIZE_ARGS,  # a sanitized build links its runtime (UBSan's handlers)
        libraries=["crypto"],
        optional=True,
    )
)

setup(ext_modules=ext_modules, cmdclass={"build_ext": OptionalBuildExt})
