"""The `mmrag` CLI starts light: `--help` imports no ML library, every sub-command's help works, logs go to stderr.

Each check runs in a fresh interpreter: this test process may have imported torch and vLLM already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "vllm", "transformers", "matplotlib", "llama_index", "qdrant_client", "sentence_transformers",
         "open_clip")
SUBCOMMANDS = (
    "ingest", "ask", "warm", "serve", "bench", "corpus sample", "model tiny", "index stats", "index reset",
    "engine serve", "retrieval eval", "retrieval latency", "retrieval cost", "reencode", "index check", "store gc",
    "vision serve", "eval answers", "config show", "config reference",
)

_HELP_PROBE = f"""
import json, sys
sys.argv = ["mmrag", "--help"]
from mmrag import cli
try:
    cli.main()
except SystemExit as exc:
    code = exc.code
heavy = {HEAVY!r}
after_help = sorted(m for m in heavy if m in sys.modules)

from typer.testing import CliRunner
runner = CliRunner()
subs = {{}}
for sub in {SUBCOMMANDS!r}:
    result = runner.invoke(cli.app, [*sub.split(), "--help"])
    subs[sub] = [result.exit_code, result.output[:500]]
after_subs = sorted(m for m in heavy if m in sys.modules)
print(json.dumps({{"code": code, "after_help": after_help, "subs": subs, "after_subs": after_subs}}))
"""


def _python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", **(env or {}))
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def test_help_imports_no_heavy_library_and_every_subcommand_help_works():
    proc = _python(_HELP_PROBE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["code"] in (0, None)
    assert out["after_help"] == [], f"`mmrag --help` imported {out['after_help']}"
    failed = {sub: res for sub, res in out["subs"].items() if res[0] != 0}
    assert not failed, failed
    for sub, (_, text) in out["subs"].items():
        assert "Usage" in text, (sub, text)
    assert out["after_subs"] == [], f"a sub-command's --help imported {out['after_subs']}"


def test_user_errors_are_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "-m", "mmrag", "ask", "q", "--pages", "report.pdf"], cwd=REPO,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "DOC:PAGE" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_every_named_user_error_exists_and_others_are_not_user_errors():
    from mmrag.errors import USER_ERROR_NAMES, is_user_error, loaded_user_errors, user_errors

    classes = user_errors()  # imports each module: a renamed class or moved module fails here
    assert len(classes) == len(USER_ERROR_NAMES)
    assert all(isinstance(c, type) and issubclass(c, BaseException) for c in classes)
    assert loaded_user_errors() == classes  # once their modules are loaded, the CLI catches every one
    from mmrag.ask_cmd import ArgumentError

    assert is_user_error(ArgumentError("--pages takes DOC:PAGE")) and is_user_error(FileNotFoundError("x"))
    assert not is_user_error(RuntimeError("a bug"))
    assert not is_user_error(KeyError("x"))


def test_logs_go_to_stderr_info_for_our_packages_warning_for_others():
    proc = _python(
        "import logging\n"
        "from mmrag.cli import configure_logging\n"
        "configure_logging()\n"
        "logging.getLogger('ingestion.pipeline').info('ours-info')\n"
        "logging.getLogger('serving.engine.remote').warning('ours-warning')\n"
        "logging.getLogger('httpx').info('theirs-info')\n"
        "logging.getLogger('httpx').warning('theirs-warning')\n"
        "print('result')\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "result\n"
    assert "ours-info" in proc.stderr and "ours-warning" in proc.stderr and "theirs-warning" in proc.stderr
    assert "theirs-info" not in proc.stderr
    assert "INFO ingestion.pipeline: ours-info" in proc.stderr


def test_mmrag_log_level_debug_shows_our_debug_lines():
    proc = _python(
        "import logging\n"
        "from mmrag.cli import configure_logging\n"
        "configure_logging()\n"
        "logging.getLogger('ingestion.pipeline').debug('ours-debug')\n",
        env={"MMRAG_LOG_LEVEL": "debug"},
    )
    assert proc.returncode == 0 and "DEBUG ingestion.pipeline: ours-debug" in proc.stderr, proc.stderr


@pytest.mark.parametrize("host, settings, warned", [
    ("0.0.0.0", {}, True), ("192.168.1.5", {}, True), ("myhost.example", {}, True),
    ("127.0.0.1", {}, False), ("::1", {}, False), ("localhost", {}, False),
    ("0.0.0.0", {"api_key": "k"}, False), ("0.0.0.0", {"tenants_file": "tenants.toml"}, False),
])
def test_serve_warns_when_anyone_can_reach_it_without_a_key(host, settings, warned):
    from mmrag.core.settings import ApiSection, Settings, TenantsSection

    from mmrag.cli import open_to_all

    given = {"api_key": "", "tenants_file": None, **settings}  # sections built without reading the environment
    warning = open_to_all(Settings.model_construct(api=ApiSection.model_construct(key=given["api_key"]),
                                                   tenants=TenantsSection.model_construct(file=given["tenants_file"])),
                          host)
    assert (warning is not None) == warned
    assert warning is None or ("MMRAG_API_KEY" in warning and host in warning)
