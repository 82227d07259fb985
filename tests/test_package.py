"""The package (issue 43): the service's runtime dependencies hold no benchmark-only library; those come with the
`bench` extra (make setup installs it), and `mmrag bench --e2e` without it says which extra to install."""

from __future__ import annotations

import os
import shutil
import sys
import tomllib
from pathlib import Path

import pytest
import typer
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
BENCH_ONLY = ("llama-index-llms-openai-like", "llama-index-vector-stores-qdrant", "matplotlib")


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
    from mmrag.core.settings import Settings
    from mmrag import bench_cmd

    monkeypatch.delitem(sys.modules, "mmrag.bench.e2e", raising=False)
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


def test_the_sample_corpus_without_the_extra_names_it_and_exits_2(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from mmrag import cli

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the extra were not installed
    result = CliRunner().invoke(cli.app, ["corpus", "sample", "--out", str(tmp_path / "corpus")])
    assert result.exit_code == 2
    said = " ".join(result.output.split())
    assert "`bench` extra" in said and "pip install -e '.[bench]'" in said
    assert not (tmp_path / "corpus").exists()


def test_reading_a_manifest_needs_no_drawing_library(monkeypatch):
    monkeypatch.delitem(sys.modules, "mmrag.devkit.manifest", raising=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    from mmrag.devkit.manifest import CorpusManifest  # imports without matplotlib

    assert CorpusManifest.__module__ == "mmrag.devkit.manifest"


# The installed top-level names: the layout's rooms, and mmrag for the rest (issue 43).
TOP_LEVEL = {"mmrag", "ingestion", "retrieval", "rag", "serving"}


@pytest.mark.slow
def test_pip_install_in_a_clean_venv_gives_the_layouts_packages_and_a_working_cli(tmp_path):
    """`pip install .` as a user runs it, into a venv of its own, then `mmrag --help` and `import rag, serving` run
    from there, outside the checkout. No network here: the package comes from a wheel built from the tree (no
    dependencies), and the new venv reads its dependencies from the suite's .venv through a path file, not its
    packages (the editable install's finder there is not loaded: a path file's folder is not a site folder)."""
    import subprocess
    import sysconfig
    import zipfile

    # From a copy of the tree: setuptools builds in the source folder, and a build/ left there by an earlier build
    # (of an older layout) would be packed too.
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "tests",
                                                              "demo-data", "models"))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(src)], check=True, capture_output=True, text=True)
    (wheel,) = wheels.glob("mmrag-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names} - {n.split("/")[0] for n in names if ".dist-info/" in n}
    assert tops == TOP_LEVEL, sorted(tops)
    assert "serving/api/ui/index.html" in names  # the page's static files travel with the package
    assert not [n for n in names if n.startswith(("tests/", "scripts/"))]

    away = tmp_path / "elsewhere"  # not the checkout, whose folders (and mmrag.egg-info) must not be what imports
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def run(*argv: str | Path) -> subprocess.CompletedProcess:
        done = subprocess.run([str(a) for a in argv], cwd=away, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{argv}: {done.stderr[-2000:]}"
        return done

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    py = venv / "bin" / "python"
    site = run(py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip()
    run(py, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel)
    # After the install: pip would otherwise take the suite's editable mmrag for this one, and install nothing.
    Path(site, "suite-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    shown = run(venv / "bin" / "mmrag", "--help")
    assert "ingest" in shown.stdout and "serve" in shown.stdout
    where = run(py, "-c", "import rag, serving, mmrag.core.keys as k; print(rag.__file__); print(serving.__file__); "
                "print(k.__file__)")
    assert all(Path(line).is_relative_to(site) for line in where.stdout.split()), where.stdout
