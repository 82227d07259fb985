"""The package (issue 43): the service's runtime dependencies hold no benchmark-only library; those come with the
`bench` extra (make setup installs it), and `mmrag bench --e2e` without it says which extra to install."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest
import typer
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
BENCH_ONLY = ("llama-index-llms-openai-like", "llama-index-vector-stores-qdrant")


def _name(requirement: str) -> str:
    return Requirement(requirement).name


def test_benchmark_only_libraries_are_an_extra_that_make_setup_installs():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    runtime = {_name(r) for r in project["dependencies"]}
    assert not runtime & set(BENCH_ONLY), sorted(runtime & set(BENCH_ONLY))
    assert {_name(r) for r in project["optional-dependencies"]["bench"]} == set(BENCH_ONLY)
    assert "llama-index-core" in runtime  # rag/llama.py's question generator is the service's own
    assert ".[dev,dashboards,ray,bench]" in (REPO / "scripts" / "setup.sh").read_text()


def test_bench_e2e_without_the_extra_names_it_and_exits_2(monkeypatch, tmp_path, capsys):
    from core.settings import Settings
    from mmrag import bench_cmd

    monkeypatch.delitem(sys.modules, "bench.e2e", raising=False)
    monkeypatch.setitem(sys.modules, "llama_index.llms.openai_like", None)  # as if the extra were not installed
    monkeypatch.setattr(bench_cmd.err, "file", sys.stderr)
    with pytest.raises(typer.Exit) as stopped:
        bench_cmd._bench_e2e(Settings(data_dir=tmp_path), tiny=True, depth=None, quick=True, pages=4, questions=2,
                             concurrency=1, max_tokens=4, zipf=1.0, seed=0, json_out=None)
    assert stopped.value.exit_code == 2
    said = capsys.readouterr().err
    assert "`bench` extra" in said and "llama_index.llms.openai_like is missing" in said
    assert "pip install -e '.[bench]'" in " ".join(said.split())
    assert not (tmp_path / "bench").exists()  # refused before any work
