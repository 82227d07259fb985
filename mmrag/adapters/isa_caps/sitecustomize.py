"""Loaded at interpreter start in every process of an ISA-emulating run (mmrag/adapters/hardware.emulation_env puts
this folder first on PYTHONPATH). vLLM picks its CPU kernel library (``_C``, ``_C_AVX512`` or ``_C_AVX2``) by
``torch.cpu._is_avx512_supported()`` and ``_is_avx512_bf16_supported()``, which read the CPU itself and ignore
ATEN_CPU_CAPABILITY; under MMRAG_EMULATE_ISA=avx2 both answer False as soon as ``torch.cpu`` is imported.
Standard library only, and nothing happens without MMRAG_EMULATE_ISA."""

import importlib.abc
import importlib.machinery
import os
import sys

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
                module._is_avx512_supported = lambda: False
                module._is_avx512_bf16_supported = lambda: False
                module._is_amx_tile_supported = lambda: False

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _CapTorchCpu())
