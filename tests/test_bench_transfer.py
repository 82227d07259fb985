"""`mmrag bench --transfer`: the three paths image tokens can take from the vision service to the engine, each
checked to deliver the stored tokens exactly (inside mmrag/bench/transfer.py), with bytes that mean what they say.
Smoke size with the tiny model, in a subprocess (it starts its own vision service); its timings mean nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_transfer_reports_every_path_with_its_bytes(tmp_path, redis_url):
    out = tmp_path / "transfer.json"
    env = {**os.environ, "MMRAG_DATA_DIR": str(tmp_path / "data"), "MMRAG_REDIS_URL": redis_url, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "mmrag", "bench", "--transfer", "--tiny", "--pages", "4",
                           "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    t = json.loads(out.read_text())["transfer"]
    assert t["pages"] == 4 and set(t) >= {"store_disk", "store_redis", "binary_http", "base64_json"}
    raw = t["tokens_per_page"] * t["token_width"] * 4  # float32 tokens
    # The store and the binary answer carry the tokens with a small header; base64 in JSON a third more.
    for path in ("store_disk", "store_redis", "binary_http"):
        assert raw <= t[path]["bytes_per_page"] < raw * 1.05, path
    assert t["base64_json"]["bytes_per_page"] > raw * 4 / 3
    assert all(t[p]["ms_per_page"] > 0 for p in ("store_disk", "store_redis", "binary_http", "base64_json"))
    assert "| base64_json |" in proc.stdout
