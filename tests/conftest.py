"""Session fixtures: real services on 127.0.0.1 and models built offline, once per test session."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # any accidental hub lookup must fail fast
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server process for the session (Debian package; `make test` installs it as root)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed: apt-get install redis-server (make test does it as root)")
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    import redis

    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("redis-server did not start within 10 s")
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight Qwen2-VL, built offline once per session."""
    from ingestion.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def sample_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ingestion.corpus import build_sample_corpus

    out = tmp_path_factory.mktemp("corpus")
    build_sample_corpus(out)
    return out
