"""The lanes (tests/lanes.py): markers derived from the fixtures a test uses, --lane's selection, and the guard
that fails a fast-lane test which starts a heavy process, even one that catches the error. Run on a throwaway
suite by a pytest subprocess (the guard patches the process it runs in); no heavy process is started: the guard
refuses each before it starts."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from xml.etree import ElementTree

REPO = Path(__file__).resolve().parents[1]

CONFTEST = """
import pytest
from tests.lanes import (  # noqa: F401
    pytest_addoption, pytest_collection_modifyitems, pytest_configure, pytest_runtest_makereport,
    pytest_sessionfinish)


@pytest.fixture(scope="session")
def redis_url():  # a heavy fixture's name (HEAVY_FIXTURES: server); starts nothing here
    return "redis://nowhere"


@pytest.fixture
def uses_redis(redis_url):  # heavy through another fixture
    return redis_url
"""

TESTS = '''
import subprocess
import sys

import pytest


def test_pure():
    assert sum([1, 2]) == 3


def test_through_a_heavy_fixture(uses_redis):
    assert uses_redis


@pytest.mark.ray
def test_marked_by_hand():
    pass


def test_starts_a_server_and_catches_the_error():
    try:
        subprocess.Popen(["redis-server", "--port", "0"])
    except RuntimeError:
        pass


def test_runs_a_child_that_imports_torch():
    subprocess.run([sys.executable, "-c", "import torch"], capture_output=True)


def test_asks_a_command_for_its_help():
    subprocess.run(["redis-server", "--help"], capture_output=True)  # nothing heavy: the guard lets it by
'''


def run_lane(tmp_path: Path, lane: str) -> dict[str, str]:
    """Each test's outcome (passed, failed, or deselected when absent) in a pytest run of the throwaway suite."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (tmp_path / "test_throwaway.py").write_text(textwrap.dedent(TESTS))
    report = tmp_path / "report.xml"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           f"--lane={lane}", f"--junitxml={report}", "--rootdir", str(tmp_path), str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        outcomes[case.get("name")] = ("failed" if case.find("failure") is not None or case.find("error") is not None
                                      else "skipped" if case.find("skipped") is not None else "passed")
    return {"outcomes": outcomes, "output": proc.stdout}


def test_the_fast_lane_runs_the_light_tests_and_fails_each_that_starts_a_heavy_process(tmp_path):
    run = run_lane(tmp_path, "fast")
    assert run["outcomes"] == {
        "test_pure": "passed",
        "test_starts_a_server_and_catches_the_error": "failed",  # caught, and still failed
        "test_runs_a_child_that_imports_torch": "failed",  # refused in the child, recorded for the parent
        "test_asks_a_command_for_its_help": "passed",
    }, run["output"][-3000:]
    assert "add @pytest.mark.server to the test" in run["output"]
    assert "add @pytest.mark.slow to the test" in run["output"]


def test_the_heavy_lane_runs_what_the_fast_lane_leaves_out_unguarded(tmp_path):
    run = run_lane(tmp_path, "heavy")
    assert run["outcomes"] == {"test_through_a_heavy_fixture": "passed", "test_marked_by_hand": "passed"}, \
        run["output"][-3000:]


def test_every_heavy_fixture_named_is_a_fixture_of_its_file():
    """A renamed fixture would leave its tests unmarked, in the fast lane: each name is still defined where it says."""
    from tests.lanes import HEAVY_FIXTURES, LANE_MARKERS

    assert {"inprocess_engine", "vllm_server", "redis_url", "sample_corpus"} <= HEAVY_FIXTURES.keys()
    for key, marker in HEAVY_FIXTURES.items():
        path, _, name = key.rpartition("::")
        tree = ast.parse((REPO / (path or "tests/conftest.py")).read_text())
        fixtures = {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and any("fixture" in ast.unparse(d) for d in node.decorator_list)}
        assert name in fixtures, f"{key}: no such fixture (renamed? update tests/lanes.py's HEAVY_FIXTURES)"
        assert marker in LANE_MARKERS
