"""The vision encoder's CUDA path, checked on a GPU host: `python scripts/check_vision_gpu.py` (a minute).

For each model family's tiny random-weight checkpoint (built offline): the encoder placed by
MMRAG_VISION_DEVICE=auto lands on the GPU, fp32 tokens on the GPU match the CPU's within fp32 kernel noise,
the GPU's encoder version differs from the CPU's (device kind) and not between GPU indexes, and ``auto``
picks bfloat16 there. Exit code 0 when all hold. CI machines have no GPU; tests/test_vision_device.py covers
what a CPU host can.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from mmrag.adapters.families import FAMILIES
from mmrag.adapters.hardware import vision_placement
from mmrag.adapters.vision import VisionEncoder, encoder_version_of
from mmrag.core.keys import ResolutionPolicy
from mmrag.devkit.tiny_model import build_tiny_model

POLICY = ResolutionPolicy(56 * 56, 448 * 448)


def main() -> int:
    if not torch.cuda.is_available():
        print("no GPU visible to torch: run this on a GPU host", file=sys.stderr)
        return 2
    placement = vision_placement("auto", "auto")
    assert placement.device == "cuda" and placement.dtype in ("bfloat16", "float16"), placement
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in ((448, 448), (500, 300))]
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            model = build_tiny_model(Path(tmp) / family, family=family)
            cpu = VisionEncoder(model, POLICY)
            gpu = VisionEncoder(model, POLICY, device=placement.device)
            assert {p.device.type for p in gpu.tower.parameters()} == {"cuda"}
            worst = 0.0
            for a, b in zip(cpu.encode(images), gpu.encode(images), strict=True):
                assert torch.equal(a.grid_thw, b.grid_thw) and b.image_tokens.device.type == "cpu"
                worst = max(worst, (a.image_tokens - b.image_tokens).abs().max().item())
            assert worst < 1e-3, f"{family}: GPU fp32 tokens differ from the CPU's by {worst}"
            assert gpu.version != cpu.version
            assert gpu.version == encoder_version_of(model, salt="", dtype=torch.float32, device_kind="cuda")
            auto = VisionEncoder(model, POLICY, device=placement.device, dtype=getattr(torch, placement.dtype))
            auto.encode(images)
            print(f"{family}: GPU ok (fp32 max |cpu-gpu| {worst:.2e}; versions cpu {cpu.version}, cuda fp32 "
                  f"{gpu.version}, cuda {placement.dtype} {auto.version}; {torch.cuda.get_device_name()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
