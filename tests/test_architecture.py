"""The house runs one way: the import contracts in pyproject.toml ([tool.importlinter]) hold for the tree."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The installed top-level packages (issue 43: nothing else, under names of the layout's own).
PACKAGES = ("mmrag", "ingestion", "retrieval", "rag", "serving")
# Below mmrag: the contracts, adapters, benchmark harness and development kit; the rest of mmrag/ is the
# composition root (CLI and wiring).
SUBPACKAGES = ("core", "adapters", "bench", "devkit")
# The service's rooms, by folder.
PRODUCT = ("mmrag/core", "mmrag/adapters", "ingestion", "retrieval", "rag", "serving")


def test_the_import_contracts_are_kept():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe, "import-linter is not installed: it is in the dev extra (make setup installs it)"
    out = subprocess.run([exe, "--no-cache"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_every_top_level_package_is_under_a_contract():
    """A new package must be placed in the layers on purpose, or the contracts would silently not see it."""
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    found = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests", "scripts"}
    assert found == set(config["root_packages"]) == set(PACKAGES)
    assert {p.parent.name for p in (REPO / "mmrag").glob("*/__init__.py")} == {*SUBPACKAGES, "wiring"}


def test_every_module_of_the_composition_root_is_forbidden_below_it():
    """A new command module in mmrag/ must be kept out of reach of the rooms below, or the one-way house leaks."""
    import tomllib

    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (top,) = [c for c in contracts if c["name"].startswith("Composition at the top")]
    modules = ({f"mmrag.{p.stem}" for p in (REPO / "mmrag").glob("*.py")} - {"mmrag.__init__"}
               | {f"mmrag.{p.parent.name}" for p in (REPO / "mmrag").glob("*/__init__.py")
                  if p.parent.name not in SUBPACKAGES})
    assert set(top["forbidden_modules"]) == modules


# The figure rules (issue 43): how a figure is named and numbered, which figures a text or a hit names, whether a
# hit is shown as its figure's crop or as its page, which crops warm-up prefills. Each is written once, in
# mmrag/core/figures.py; ingestion/figures.py detects and crops, the search, the plans and warm-up apply the rules.
FIGURE_RULES = ("ref_kind", "region_name", "figure_label", "figure_reference", "Caption", "captions", "caption_label",
                "starts_with_reference", "figure_refs", "figure_text", "slide_title", "named_figures", "hit_figure",
                "CAPTION_MATCH_SHARE", "FIGURE_NAMING_MIN_SIMILARITY", "needs_page", "shown_as_crop", "shows_crop",
                "leading_crops")
FIGURES_HOME = REPO / "mmrag" / "core" / "figures.py"


def _top_level_names(tree: ast.Module) -> set[str]:
    """What a module defines at its top: functions, classes and assigned names."""
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return out


def test_every_figure_rule_is_written_once_in_its_home_and_imported_from_there():
    """A figure rule defined again elsewhere is a second copy that can drift (warm-up prefilling crops no hit can
    name); one imported from another room than its home is a re-export that hides where it lives."""
    assert set(FIGURE_RULES) <= _top_level_names(ast.parse(FIGURES_HOME.read_text(encoding="utf-8")))
    offenders = []
    for path in sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")):
        if path == FIGURES_HOME:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        where = str(path.relative_to(REPO))
        offenders += [f"{where} defines {name}" for name in sorted(_top_level_names(tree) & set(FIGURE_RULES))]
        offenders += [f"{where} imports {alias.name} from {node.module or '.'}" for node in ast.walk(tree)
                      if isinstance(node, ast.ImportFrom) and (node.level or node.module != "mmrag.core.figures")
                      for alias in node.names if alias.name in FIGURE_RULES]
    assert not offenders, offenders


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


@pytest.mark.parametrize("path", sorted((REPO / "rag").glob("*.py")), ids=lambda p: p.name)
def test_the_rag_pipeline_never_imports_serving(path):
    # Also covered by the layers contract; spelled out because it is the rule most likely to be broken
    # (the pipeline needs an engine and a scheduler, and gets both injected).
    assert not {m for m in _imports(path) if m == "serving" or m.startswith("serving.")}


def test_settings_become_objects_only_in_the_wiring_module():
    """Only mmrag/ (the composition root: CLI + wiring) and bench's entry build from a whole Settings (and the
    settings module, whose replace() builds the copy it returns)."""
    offenders = []
    for pkg in PRODUCT:
        for path in (p for p in (REPO / pkg).rglob("*.py") if p != REPO / "mmrag" / "core" / "settings.py"):
            calls = [n for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(n, ast.Call)]
            if any(isinstance(c.func, ast.Name) and c.func.id == "Settings" for c in calls):
                offenders.append(str(path.relative_to(REPO)))
    assert not offenders, f"Settings() built below the composition root in {offenders}"


COMPONENTS = ("ingestion", "retrieval", "rag", "mmrag/adapters", "serving")


@pytest.mark.parametrize("pkg", COMPONENTS)
def test_components_below_the_service_receive_their_own_section_never_the_whole_settings(pkg):
    """Configuration by component (issue 43): the loaders, the ingestor, the re-encoder and the tiers take
    Settings.documents and the values they use; the REST service takes Settings.api, the vision service
    Settings.vision_service; nothing below the composition root imports Settings, so nothing there can read, or
    patch a copy of, a setting that is not its own."""
    offenders = []
    for path in sorted((REPO / pkg).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "mmrag.core.settings":
                offenders += [f"{path.relative_to(REPO)} imports Settings" for a in node.names if a.name == "Settings"]
    assert not offenders, offenders


def test_the_wiring_builds_from_the_settings_it_was_given_and_patches_no_copy():
    """Each deployment's builder passes what differs (an in-process tower or engine, a job's tiers) as arguments;
    a patched copy of the settings would hide from `mmrag config show` what a part really runs with. The one
    exception is named: Ray's vision service URL, known only once Serve has deployed it."""
    copies = []
    for path in sorted((REPO / "mmrag" / "wiring").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            copies += [f"{path.name}:{fn.name}" for n in ast.walk(fn)
                       if isinstance(n, ast.Call) and getattr(n.func, "attr", "") in ("model_copy", "replace")
                       and ast.unparse(n.func) != "dataclasses.replace"]
    assert copies == ["ray_serve.py:ray_app"], copies


@pytest.mark.slow  # a Python process that imports the whole service: torch, vLLM, Ray (10-20 s)
def test_the_service_as_composed_in_production_imports_neither_the_bench_nor_the_development_kit():
    """The import contracts keep the service's rooms off mmrag.bench and mmrag.devkit; the composition root reaches
    the tiny-model kit only for the development profile's model (wiring.resolve_model). Every module of the
    service and of the wiring, imported as `mmrag serve` would, loads neither."""
    service = [str(p.relative_to(REPO).with_suffix("")).replace("/", ".")
               for pkg in ("serving", "rag", "retrieval", "ingestion", "mmrag/wiring")
               for p in sorted((REPO / pkg).rglob("*.py")) if p.name != "__main__.py"]
    code = ("import importlib, sys\n"
            f"for name in {service!r}:\n"
            "    importlib.import_module(name.removesuffix('.__init__'))\n"
            "print(sorted(m for m in sys.modules if m.startswith(('mmrag.bench', 'mmrag.devkit'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
