"""`mmrag vision serve` as a child process, ready when its /readyz answers (the transfer benchmark and the tests
start one this way)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from serving.readiness import ServerStartError, answers_200, wait_until_ready


def start_vision_service(model_path: Path, data_dir: Path, port: int, log_path: Path, *, timeout_s: float = 300,
                         **env: str) -> subprocess.Popen:
    """The service of ``model_path`` on 127.0.0.1:``port``, its disk feature store under ``data_dir``, on the CPU
    (``env`` adds or overrides MMRAG_* variables). A service that exits or is not ready in ``timeout_s`` is
    killed and raised with its log's tail."""
    child_env = {**os.environ, "MMRAG_MODEL": str(model_path), "MMRAG_DATA_DIR": str(data_dir),
                 "MMRAG_VISION_DEVICE": "cpu", **env}
    for name in ("MMRAG_VISION_URL", "MMRAG_REDIS_URL"):  # it encodes here, into its own store
        child_env.pop(name, None)
    with log_path.open("ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mmrag", "vision", "serve", "--port", str(port)],
                                env=child_env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_until_ready(answers_200(f"http://127.0.0.1:{port}/readyz"), timeout_s=timeout_s, what="the vision service",
                         proc=proc, log=lambda: f"log {log_path}:\n{log_path.read_text()[-3000:]}", interval_s=0.1)
    except ServerStartError:
        proc.kill()
        raise
    return proc
