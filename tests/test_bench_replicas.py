"""`mmrag bench --replicas N` refuses what it cannot compare. Its measurement runs in tests/test_ray_serve.py on
that module's cluster (Ray starts once per test session); the command itself, which starts a cluster of its
own, is run by hand (docs/benchmarks.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="ray[serve] is not installed: .venv/bin/pip install 'ray[serve]==2.60.0' "
                    "-c constraints.txt (scripts/setup.sh does it)")

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_replicas_bench_needs_two_replicas(tmp_path):
    env = {**os.environ, "MMRAG_DATA_DIR": str(tmp_path / "data"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "mmrag", "bench", "--replicas", "1", "--tiny"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--replicas" in proc.stderr
