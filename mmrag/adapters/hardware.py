"""What this host runs natively: the CPU's bfloat16 support, and where (and in which dtype) the vision tower
runs. The engine's ``auto`` dtype (serving/engine/config.py) and the vision service's ``auto`` device and
dtype are decided here, so both read the host the same way."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from mmrag.adapters.fences import Fence, Target

# CPU flags with which bfloat16 matmuls run natively; elsewhere (e.g. AVX2-only AMD EPYC) bf16 is emulated
# and a linear layer runs ~5x slower than in fp32.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")



# MMRAG_EMULATE_ISA=avx2: run as an AVX2-only host would, on a host with more (to measure, on an AVX-512 machine,
# what an AMD EPYC user gets). The flags read here lose AVX-512 and AMX, so `auto` picks fp32; emulation_env()
# caps the kernels: torch's ATen dispatch, oneDNN, MKL, and (via isa_caps/sitecustomize.py) vLLM's choice of its
# AVX2 kernel library. It caps the instruction set only: clock, caches and memory stay this host's.
EMULATE_ISA_ENV = "MMRAG_EMULATE_ISA"
EMULATED_ISAS = ("avx2",)
_BEYOND_AVX2 = ("avx512", "amx")


def emulated_isa() -> str | None:
    """The ISA this process emulates (MMRAG_EMULATE_ISA), None when it runs on the host's own."""
    isa = os.environ.get(EMULATE_ISA_ENV, "").strip().lower()
    if not isa:
        return None
    if isa not in EMULATED_ISAS:
        raise ValueError(f"{EMULATE_ISA_ENV}={isa!r} is not an ISA mmrag can emulate; use one of {EMULATED_ISAS} "
                         f"or unset it to run on this CPU's own")
    return isa


# isa_caps/sitecustomize.py answers False for torch's own CPU probes under AVX2 emulation (the only patch of torch's
# internals; a tool for tests and benchmarks, off unless MMRAG_EMULATE_ISA is set), as tested: the pins keep torch in
# this range (constraints.txt, pyproject.toml), exec_emulating says when the installed torch is outside it, and the
# hook itself refuses a torch whose probes are gone, where it imports torch.cpu (the parent imports no torch).
TORCH_FENCE = Fence(("torch",), ">=2.6,<2.14", "mmrag/adapters/isa_caps/sitecustomize.py", (
    Target("torch.cpu", "_is_avx512_supported"),
    Target("torch.cpu", "_is_avx512_bf16_supported"),
    Target("torch.cpu", "_is_amx_tile_supported"),
))


def emulation_env(environ: dict[str, str], isa: str) -> dict[str, str]:
    """``environ`` with the caps that make every process started from it (vLLM's engine core and `vllm serve`
    included) run ``isa``'s kernels only. They take effect at interpreter start: re-exec under them."""
    if isa not in EMULATED_ISAS:
        raise ValueError(f"cannot emulate {isa!r}; one of {EMULATED_ISAS}")
    caps = Path(__file__).with_name("isa_caps")
    path = [str(caps), *filter(None, environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**environ, EMULATE_ISA_ENV: isa, "PYTHONPATH": os.pathsep.join(dict.fromkeys(path)),
            "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def exec_emulating(isa: str, argv: list[str]) -> None:
    """Replace this process with ``argv`` run under ``isa``'s kernel caps (`make test-avx2`, and the CLI's
    re-execution under MMRAG_EMULATE_ISA)."""
    import sys

    if untested := TORCH_FENCE.version_problem():  # the release only: the probes are checked where they are capped
        print(f"mmrag: {untested}", file=sys.stderr)
    print(f"mmrag: re-executing under {isa.upper()} kernel caps (torch, oneDNN, MKL, vLLM)", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, emulation_env(dict(os.environ), isa))


# MKL's conditional numerical reproducibility, strict: fp32 matmuls give the same bits whatever the thread count.
# With AVX2 kernels they did not (a page's vision tokens at 1 and 2 threads differed, and a busy host varies the
# count MKL uses), so `mmrag ingest` and `mmrag serve` wrote different bytes for one key and an interrupted
# ingest did not end as an uninterrupted one. AUTO keeps the host's best code path: the AVX-512 bits here are
# unchanged by it. Read by MKL at its first call, so set before any (the CLI's entry, the tests' conftest).
MKL_REPRODUCIBLE = {"MKL_CBWR": "AUTO,STRICT"}


def reproducible_numerics() -> None:
    """Set MKL_REPRODUCIBLE in this process (and so its children) unless the operator chose otherwise."""
    for name, value in MKL_REPRODUCIBLE.items():
        os.environ.setdefault(name, value)


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's flags (the first processor's), less those beyond the emulated ISA when one is set."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            break
    if emulated_isa() == "avx2":
        flags = {f for f in flags if not f.startswith(_BEYOND_AVX2)}
    return flags


def native_cpu_dtype(flags: set[str] | None = None) -> str:
    """bfloat16 where the CPU runs it natively (AVX512-BF16 or AMX), float32 otherwise."""
    flags = cpu_flags() if flags is None else flags
    return "bfloat16" if any(f in flags for f in NATIVE_BF16_FLAGS) else "float32"


@dataclass(frozen=True, slots=True)
class VisionPlacement:
    """Where the vision tower runs and in which dtype, resolved for this host.

    ``kind`` ("cpu" or "cuda") and ``dtype`` enter the encoder version: a CPU and a GPU kernel, or fp32 and
    bf16, give different tokens for the same image. The GPU index does not (cuda:0 and cuda:1 of one host
    run the same kernels), so moving the encoder between a host's GPUs keeps every cached token valid.
    """

    device: str  # a torch device string: "cpu", "cuda", "cuda:1"
    dtype: str  # a torch dtype name: "float32", "bfloat16", "float16"

    @property
    def kind(self) -> str:
        return self.device.partition(":")[0]


def vision_placement(device: str, dtype: str, *, require_device: bool = True) -> VisionPlacement:
    """Resolve MMRAG_VISION_DEVICE and MMRAG_VISION_DTYPE (validated by Settings) for this host.

    ``auto`` device: the first GPU when torch sees one, else the CPU. ``auto`` dtype: bfloat16 on a GPU that
    runs it (float16 on older ones); float32 on a CPU, on every CPU kind, so an index encoded on an
    AVX-512 host stays servable from an AVX2-only one (and the fp32 tokens are the ones the cache-correctness
    proofs compare). ``require_device=False`` resolves an explicit ``cuda`` on a host without a GPU, for
    computing the encoder version only (an API host whose vision service runs elsewhere).
    """
    import torch

    cuda = torch.cuda.is_available()
    if device == "auto":
        device = "cuda" if cuda else "cpu"
    if device.startswith("cuda") and require_device:
        if not cuda:
            raise ValueError(
                f"MMRAG_VISION_DEVICE={device} but torch sees no GPU (torch.cuda.is_available() is False: a "
                f"CPU-only torch build, or no NVIDIA driver in this container); set MMRAG_VISION_DEVICE=cpu, "
                f"or auto to use a GPU only when there is one"
            )
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"MMRAG_VISION_DEVICE={device} but torch sees {torch.cuda.device_count()} GPU(s) "
                f"(cuda:0..cuda:{torch.cuda.device_count() - 1}); pick one of them (CUDA_VISIBLE_DEVICES renumbers them)"
            )
    if dtype == "auto":
        if device == "cpu":
            dtype = "float32"
        else:
            dtype = "bfloat16" if not cuda or torch.cuda.is_bf16_supported() else "float16"
    return VisionPlacement(device, dtype)
