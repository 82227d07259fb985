"""Loaded at interpreter start in every process of an ISA-emulating run (mmrag/adapters/hardware.emulation_env puts
this folder first on PYTHONPATH). vLLM picks its CPU kernel library (``_C``, ``_C_AVX512`` or ``_C_AVX2``) by
``torch.cpu._is_avx512_supported()`` and ``_is_avx512_bf16_supported()``, which read the CPU itself and ignore
ATEN_CPU_CAPABILITY; under MMRAG_EMULATE_ISA=avx2 both answer False as soon as ``torch.cpu`` is imported, and a
torch without one of them is refused there, naming the releases this was tested with (mmrag/adapters/hardware.py
TORCH_FENCE; tests/test_fences.py keeps both lists equal). Standard library only, and nothing happens without
MMRAG_EMULATE_ISA."""

import importlib.abc
import importlib.machinery
import os
import sys

PROBES = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's, capped
TESTED = ">=2.6,<2.14"  # the torch releases, as TORCH_FENCE says

if os.environ.get("MMRAG_EMULATE_ISA", "").strip().lower() == "avx2":

    class _CapTorchCpu(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "torch.cpu":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                if missing := [p for p in PROBES if not hasattr(module, p)]:
                    raise ImportError(f"MMRAG_EMULATE_ISA=avx2 caps torch.cpu's CPU probes, and this torch has no "
                                      f"{', '.join(missing)}: install torch{TESTED} (the releases the emulation was "
                                      "tested with), or unset MMRAG_EMULATE_ISA")
                for probe in PROBES:
                    setattr(module, probe, lambda: False)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _CapTorchCpu())
