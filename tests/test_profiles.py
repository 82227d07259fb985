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
    assert Settings().model.profile == "production"
    monkeypatch.setenv("MMRAG_PROFILE", "development")
    assert Settings().model.profile == "development"


def test_production_without_a_model_is_refused_naming_the_fix_and_builds_nothing(tmp_path):
    settings = Settings(model="", profile="production", data_dir=tmp_path)
    with pytest.raises(ModelNotConfiguredError) as refused:
        resolve_model(settings)
    message = str(refused.value)
    assert "MMRAG_MODEL is not set" in message and "MMRAG_PROFILE=development" in message
    assert is_user_error(refused.value)  # the CLI shows it as one line, exit code 2
    assert not settings.storage.tiny_model_dir.exists()


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


def test_benchmark_knobs_are_out_of_settings_read_in_development_and_refused_in_production(monkeypatch, tmp_path):
    """The testing knobs live in DevelopmentKnobs, not in the production Settings: the wiring reads them from
    their variables in the development profile and refuses a production start with one set, naming it."""
    from mmrag import wiring
    from mmrag.core.settings import DevelopmentKnobs, flat_names

    assert not set(DevelopmentKnobs.model_fields) & set(flat_names())
    monkeypatch.setenv("MMRAG_ANSWER_FIXED_LENGTH", "true")
    monkeypatch.setenv("MMRAG_DECOMPOSE_FIXED_TOKENS", "12")
    development = Settings(model="", profile="development", data_dir=tmp_path)
    assert wiring.development_knobs(development) == DevelopmentKnobs(answer_fixed_length=True,
                                                                    decompose_fixed_tokens=12)
    assert wiring.pipeline_config(development).fixed_length
    production = Settings(model="", profile="production", data_dir=tmp_path)
    with pytest.raises(wiring.DevelopmentKnobError) as refused:
        wiring.pipeline_config(production)
    message = str(refused.value)
    assert "MMRAG_ANSWER_FIXED_LENGTH" in message and "MMRAG_DECOMPOSE_FIXED_TOKENS" in message
    assert "MMRAG_PROFILE=development" in message and is_user_error(refused.value)
    monkeypatch.delenv("MMRAG_ANSWER_FIXED_LENGTH")
    monkeypatch.delenv("MMRAG_DECOMPOSE_FIXED_TOKENS")
    assert wiring.development_knobs(production) == DevelopmentKnobs()  # unset: production runs as it always did


def test_a_random_weight_clip_is_the_development_profiles_and_the_old_knob_is_its_deprecated_alias(tmp_path, caplog):
    development = Settings(model="", profile="development", data_dir=tmp_path, page_retriever="clip")
    assert development.image_channel and development.retrieval.clip_weights is None
    with pytest.raises(ValueError, match="MMRAG_PROFILE=development"):
        Settings(model="", profile="production", data_dir=tmp_path, page_retriever="clip")
    with caplog.at_level("WARNING"):
        old = Settings(model="", profile="development", data_dir=tmp_path, clip_random_init=True)
    assert old.retrieval.page_retriever == "clip" and old.image_channel
    assert "MMRAG_CLIP_RANDOM_INIT is deprecated" in caplog.text and "MMRAG_PAGE_RETRIEVER=clip" in caplog.text
