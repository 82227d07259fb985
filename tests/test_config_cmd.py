"""`mmrag config show|reference` (issue 43): every setting documented in the model with a known component, the
effective values with their sources (env, default, derived, profile), secrets never printed, a bad value as a user
error naming the variable (exit code 2), and docs/configuration.md a fresh render of the settings' descriptions.

In process (typer's CliRunner over the app): nothing here starts an engine, a server or a subprocess.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mmrag.core.settings import COMPONENTS, SECTIONS, Settings, declared, flat_names
from mmrag import cli, config_cmd
from mmrag.config_cmd import MASK, render_reference

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No MMRAG_* variable but the development profile tests/conftest.py sets: every other setting at its
    default, whatever the environment this suite runs in sets."""
    import os

    for name in [n for n in os.environ if n.upper().startswith("MMRAG_") and n != "MMRAG_PROFILE"]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("MMRAG_PROFILE", "development")
    return monkeypatch


def show(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(cli.app, ["config", "show", *args])
    return result.exit_code, result.stdout, result.stderr


def show_json() -> dict[str, dict]:
    code, out, err = show("--json")
    assert code == 0, err
    rows = json.loads(out)
    assert all(set(row) == {"component", "name", "env", "setting", "value", "source"} for row in rows)
    return {row["name"]: row for row in rows}


# --- the settings document themselves -----------------------------------------------------------------------------


EVERY = {d.flat: d for d in declared()}  # the settings and the benchmark knobs, by flat name


def test_every_setting_has_a_description_and_a_known_component():
    undocumented = [n for n, d in EVERY.items() if not (d.info.description or "").strip()]
    assert not undocumented, f"Settings fields without a description: {undocumented}"
    unknown = {n: d.component for n, d in EVERY.items() if d.component not in COMPONENTS}
    assert not unknown, f"Settings fields without a component of {list(COMPONENTS)}: {unknown}"
    assert list(SECTIONS) == [c for c in COMPONENTS if c != "testing"]  # a section per component, in its order


def test_each_section_holds_its_own_settings_and_every_variable_keeps_its_flat_name(monkeypatch):
    """The alias table: every setting keeps the MMRAG_* variable it had when Settings was flat, now held by its
    component's section (MMRAG_ENGINE_URLS is settings.engine.urls); the flat names build and replace too."""
    assert len(flat_names()) == len(EVERY) - 2  # all but the two testing knobs, each name once
    assert flat_names()["engine_urls"] == ("engine", "urls") and flat_names()["model"] == ("model", "name")
    assert {d.variable for d in EVERY.values()} == {f"MMRAG_{n.upper()}" for n in EVERY}
    monkeypatch.setenv("MMRAG_ENGINE_URLS", "http://a:1/, http://b:2")
    monkeypatch.setenv("MMRAG_ANSWER_MAX_TOKENS", "17")
    monkeypatch.setenv("MMRAG_RAY_REPLICAS", "3")
    settings = Settings(max_num_seqs=5)
    assert settings.engine.urls == ["http://a:1", "http://b:2"] and settings.engine.max_num_seqs == 5
    assert settings.answer.max_tokens == 17 and settings.ray.replicas == 3
    assert Settings().engine.max_num_seqs == 64  # the environment's, not the first one's override
    other = settings.replace(answer_max_tokens=9, vision={"url": "http://v:3"})
    assert (other.answer.max_tokens, other.vision.url, other.engine.max_num_seqs) == (9, "http://v:3", 5)
    assert settings.answer.max_tokens == 17  # a copy; the original stays
    with pytest.raises(ValueError, match="unknown setting 'max_num_seq'"):
        Settings(max_num_seq=5)


def test_the_committed_reference_is_a_fresh_render_of_the_settings():
    assert (REPO / config_cmd.REFERENCE_PATH).read_text() == render_reference(), (
        f"{config_cmd.REFERENCE_PATH} is stale: run `{config_cmd.RENDER_COMMAND}` (from the repository root) and "
        "commit it")


def test_reference_write_writes_the_rendered_page(tmp_path):
    result = runner.invoke(cli.app, ["config", "reference", "--write", str(tmp_path / "configuration.md")])
    assert result.exit_code == 0, result.output
    text = (tmp_path / "configuration.md").read_text()
    assert text == render_reference()
    for d in EVERY.values():
        assert f"| `{d.variable}` | `{d.path}` |" in text


# --- show: values and their sources -------------------------------------------------------------------------------


def test_a_set_variable_is_reported_from_env_and_an_unset_one_as_its_default(environ):
    environ.setenv("MMRAG_PORT", "9001")
    rows = show_json()
    assert rows["port"] == {"component": "api", "name": "port", "env": "MMRAG_PORT", "setting": "api.port",
                            "value": 9001, "source": "env"}
    assert rows["host"]["value"] == "127.0.0.1" and rows["host"]["source"] == "default"
    assert rows["profile"]["source"] == "env"
    assert [r["source"] for r in rows.values()].count("env") == 2  # MMRAG_PORT and MMRAG_PROFILE, nothing else
    assert rows["tiers"]["value"]["low"] == {"min_pixels": 3136, "max_pixels": 200704, "pool": 2}  # JSON-able

    code, out, _ = show()
    assert code == 0
    port = next(line for line in out.splitlines() if "MMRAG_PORT " in line)
    assert port.split() == ["MMRAG_PORT", "api.port", "env", "9001"]
    assert next(line for line in out.splitlines() if "MMRAG_HOST " in line).split() == [
        "MMRAG_HOST", "api.host", "default", "127.0.0.1"]
    assert "api:" in out.splitlines()


def test_a_benchmark_knob_is_shown_under_testing_from_its_variable(environ):
    environ.setenv("MMRAG_DECOMPOSE_FIXED_TOKENS", "7")
    rows = show_json()
    assert rows["decompose_fixed_tokens"] == {"component": "testing", "name": "decompose_fixed_tokens",
                                              "env": "MMRAG_DECOMPOSE_FIXED_TOKENS",
                                              "setting": "decompose_fixed_tokens", "value": 7, "source": "env"}
    assert rows["answer_fixed_length"]["source"] == "default"


def test_the_development_profile_fills_an_empty_model_and_a_set_model_is_env(environ, tmp_path):
    environ.setenv("MMRAG_DATA_DIR", str(tmp_path))
    assert show_json()["model"] | {"component": "model"} == {
        "component": "model", "name": "model", "env": "MMRAG_MODEL", "setting": "model.name",
        "value": str(tmp_path / "models" / "tiny"), "source": "profile"}
    assert not (tmp_path / "models").exists()  # reported, not built

    environ.setenv("MMRAG_MODEL", "Qwen/Qwen2-VL-2B-Instruct")
    assert show_json()["model"]["source"] == "env"


def test_production_without_a_model_shows_the_empty_default_and_says_it_will_be_refused(environ):
    environ.setenv("MMRAG_PROFILE", "production")
    code, out, err = show()
    assert code == 0
    assert next(line for line in out.splitlines() if "MMRAG_MODEL " in line).split() == [
        "MMRAG_MODEL", "model.name", "default", '""']
    assert "MMRAG_MODEL is empty in the production profile" in err


@pytest.mark.parametrize(("variable", "value", "mode"), [
    ("MMRAG_ANSWER_MODE", "one_prompt", "joint"),  # a deprecated name, mapped by the model validator
    ("MMRAG_LAYOUT", "per_page", "split"),  # deprecated MMRAG_LAYOUT=per_page sets split
])
def test_a_value_the_code_fills_in_is_derived(environ, variable, value, mode):
    environ.setenv(variable, value)
    rows = show_json()
    assert rows["answer_mode"]["value"] == mode and rows["answer_mode"]["source"] == "derived"


# --- secrets ------------------------------------------------------------------------------------------------------


def test_secrets_are_masked_in_text_and_json_and_never_printed(environ):
    secrets = {"MMRAG_API_KEY": "k3y-Of-The-API-0451", "MMRAG_VISION_API_KEY": "v1sion-K3y-7781"}
    passwords = {"MMRAG_REDIS_URL": ("redis://:r3dis-Pa55@cache:6379/0", "redis://:***@cache:6379/0"),
                 "MMRAG_QDRANT_URL": ("https://admin:qdr4nt-Pa55@qdrant:6333", "https://admin:***@qdrant:6333"),
                 "MMRAG_ENGINE_URLS": ("http://a:1,http://u:vllm-Pa55@b:2", "http://a:1,http://u:***@b:2")}
    for name, value in secrets.items():
        environ.setenv(name, value)
    for name, (url, _) in passwords.items():
        environ.setenv(name, url)
    hidden = [*secrets.values(), "r3dis-Pa55", "qdr4nt-Pa55", "vllm-Pa55"]

    code, out, err = show()
    assert code == 0
    assert not [s for s in hidden if s in out + err]
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  ")}
    assert lines["MMRAG_API_KEY"] == ["MMRAG_API_KEY", "api.key", "env", MASK]
    assert lines["MMRAG_REDIS_URL"][3] == "redis://:***@cache:6379/0"

    code, out, err = show("--json")
    assert code == 0
    assert not [s for s in hidden if s in out + err]
    rows = {row["env"]: row for row in json.loads(out)}
    assert rows["MMRAG_API_KEY"]["value"] == rows["MMRAG_VISION_API_KEY"]["value"] == MASK
    for name, (_, shown) in passwords.items():  # a list setting is a JSON list there
        value = rows[name]["value"]
        assert (",".join(value) if isinstance(value, list) else value) == shown and rows[name]["source"] == "env"
    assert rows["MMRAG_ENGINE_URLS"]["value"] == ["http://a:1", "http://u:***@b:2"]


def test_an_unset_secret_shows_that_it_is_unset(environ):
    rows = show_json()
    assert rows["api_key"]["value"] == "" and rows["api_key"]["source"] == "default"


@pytest.mark.parametrize(("name", "secret"), [
    ("api_key", True), ("vision_api_key", True), ("client_secret", True), ("db_password", True), ("hf_token", True),
    ("answer_max_tokens", False), ("ingest_image_tokens", False), ("encoder_salt", False), ("keyword", False)])
def test_secret_names(name, secret):
    assert config_cmd.is_secret(name) is secret


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:pw@host:6379/0", "redis://:***@host:6379/0"),
    ("redis://user:pw@host", "redis://user:***@host"),
    ("http://host:8100", "http://host:8100"),  # a port is not a password
    ("http://user@host", "http://user@host"),  # a user alone is not a secret
    ("http://a:p@x:1,http://b:q@y:2", "http://a:***@x:1,http://b:***@y:2"),
    ("redis://:p@s/s@host:6379/0", "redis://:***@host:6379/0"),  # unencoded `@` and `/`: masked whole
])
def test_url_passwords_are_masked(url, shown):
    assert config_cmd.mask_url_passwords(url) == shown


# --- help and user errors -----------------------------------------------------------------------------------------


def test_show_help_explains_the_columns_sources_and_masking():
    result = runner.invoke(cli.app, ["config", "show", "--help"])
    assert result.exit_code == 0, result.output
    for words in ("Usage", "--json", "Sources", "env", "default", "derived", "profile", "masked"):
        assert words in result.output, words


@pytest.mark.parametrize(("variable", "value", "named"), [
    ("MMRAG_PORT", "abc", "MMRAG_PORT='abc'"),  # pydantic's type error, named as the variable
    ("MMRAG_TIERS", "{not json", "MMRAG_TIERS is not valid JSON"),  # pydantic-settings' parse error
    ("MMRAG_TOP_K", "50", "MMRAG_TOP_K=50 is over MMRAG_CANDIDATE_K"),  # the model validator's message
])
def test_a_bad_value_exits_2_naming_the_variable_without_a_traceback(environ, variable, value, named):
    environ.setenv(variable, value)
    result = runner.invoke(cli.app, ["config", "show"])
    assert result.exit_code == 2, (result.output, result.exception)
    assert named in " ".join(result.stderr.split())
    assert "Traceback" not in result.output and result.stdout == ""
