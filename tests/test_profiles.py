"""Profiles (issue 43): production is the default, and there a start without MMRAG_MODEL is refused with the fix
instead of serving a random-weight model's noise; the development profile (what `make demo` and the tests set,
tests/conftest.py) builds the tiny model offline."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmrag.core.settings import Settings
from mmrag.errors import is_user_error
from mmrag.wiring import ModelNotConfiguredError, resolve_model

REPO = Path(__file__).resolve().parent.parent


def test_production_is_the_default_profile(monkeypatch):
    monkeypatch.delenv("MMRAG_PROFILE", raising=False)
    assert Settings().profile == "production"
    monkeypatch.setenv("MMRAG_PROFILE", "development")
    assert Settings().profile == "development"


def test_production_without_a_model_is_refused_naming_the_fix_and_builds_nothing(tmp_path):
    settings = Settings(model="", profile="production", data_dir=tmp_path)
    with pytest.raises(ModelNotConfiguredError) as refused:
        resolve_model(settings)
    message = str(refused.value)
    assert "MMRAG_MODEL is not set" in message and "MMRAG_PROFILE=development" in message
    assert is_user_error(refused.value)  # the CLI shows it as one line, exit code 2
    assert not settings.tiny_model_dir.exists()


@pytest.mark.slow  # a Python subprocess that imports the wiring
def test_mmrag_ingest_in_production_without_a_model_exits_with_the_fix_and_no_traceback(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MMRAG_MODEL", "MMRAG_PROFILE")}
    env |= {"MMRAG_DATA_DIR": str(tmp_path / "data"), "HF_HUB_OFFLINE": "1"}
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "one.png").write_bytes(b"")  # never read: the model is resolved first
    done = subprocess.run([sys.executable, "-m", "mmrag", "ingest", str(tmp_path / "docs")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "MMRAG_MODEL is not set" in done.stderr and "MMRAG_PROFILE=development" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "data" / "models" / "tiny").exists()
