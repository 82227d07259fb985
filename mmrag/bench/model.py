"""The benchmark model: a random-weight Qwen2-VL built offline by mmrag/devkit/tiny_model, larger than the test model.

Sized so that prefill, not fixed per-request overhead, dominates a cold prompt on a 2-core CPU (the share is
measured at every run and written to the JSON). The vision tower keeps Qwen2-VL-2B's proportion to the LLM:
its forward over a page's 1024 patches costs about twice the LLM's prefill of that page's 256 tokens, so the
cost the vision cache removes is in proportion too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from mmrag.adapters.checkpoint import ModelSource


@dataclass(slots=True, frozen=True)
class BenchModelSpec:
    hidden: int = 1024
    layers: int = 8
    vision_depth: int = 8
    vision_embed_dim: int = 768
    seed: int = 0
    min_pixels: int = 56 * 56
    max_pixels: int = 448 * 448  # a 448x448 page -> 1024 patches -> 256 image tokens

    @property
    def folder_name(self) -> str:
        return f"bench-h{self.hidden}-l{self.layers}-v{self.vision_depth}x{self.vision_embed_dim}-s{self.seed}"

    def params(self) -> dict[str, int]:
        """Parameter counts from the shapes tiny_model builds (vocab ~2.1 k, MLP 4x, kv heads = heads / 2)."""
        h, e = self.hidden, self.vision_embed_dim
        llm = self.layers * (3 * h * h + 3 * h * 4 * h)  # q, o (h x h) + k, v (h x h/2) ; gate, up, down
        vit = self.vision_depth * (4 * e * e + 2 * e * 4 * e) + 3 * 14 * 14 * 2 * e  # blocks + patch embed
        merger = 4 * e * 4 * e + 4 * e * h
        return {"llm_blocks": llm, "vision_tower": vit, "merger": merger}


# The smoke test's model: the test-suite's tiny defaults (the bench only checks that everything runs).
TINY_SPEC = BenchModelSpec(hidden=256, layers=2, vision_depth=2, vision_embed_dim=128)

# Where the engine runs fp32 (a CPU without native bf16: AVX2-only EPYC, AVX-512 without BF16), its matmuls run
# ~9x slower than bf16 on AMX (a 256x1024 by 1024x4096 linear on 2 idle cores: 1.1 ms bf16 AMX, 7.0 ms fp32
# AVX-512, 10.2 ms fp32 capped to AVX2). Under AVX2 emulation (`mmrag bench --emulate-avx2`, 2 cores) --quick
# took 13 min 14 s with 8 layers and 4 min 15 s with 2, and the full run 21 min 28 s with 2: one layer, in the
# LLM and the vision tower alike, keeps both within their 5 and 20 minutes with room for a slower core. Widths,
# image tokens per page and the vision tower's cost relative to the LLM's prefill (both scale with depth) are
# unchanged: the cold prefill's vision share measured 0.849 (8 layers) and 0.834 (2) in fp32, and the workload,
# so every hit rate, is the same.
FP32_DEPTH = 1


def bench_spec(dtype: str, depth: int | None = None) -> BenchModelSpec:
    """The bench model for an engine running ``dtype``: full depth in bf16, FP32_DEPTH in fp32; ``depth`` (the
    `--depth` option) sets the LLM's and the vision tower's layers instead."""
    if depth is None:
        depth = BenchModelSpec().layers if dtype == "bfloat16" else FP32_DEPTH
    if depth < 1:
        raise ValueError(f"--depth {depth}: the bench model needs at least 1 layer")
    return BenchModelSpec(layers=depth, vision_depth=depth)


def ensure_bench_model(data_dir: Path, spec: BenchModelSpec) -> ModelSource:
    """Build the model under ``data_dir/models/`` once (seconds); later runs reuse it."""
    from mmrag.devkit.tiny_model import ensure_tiny_model

    path = ensure_tiny_model(
        Path(data_dir) / "models" / spec.folder_name,
        seed=spec.seed, hidden=spec.hidden, layers=spec.layers, vision_depth=spec.vision_depth,
        vision_embed_dim=spec.vision_embed_dim, min_pixels=spec.min_pixels, max_pixels=spec.max_pixels,
    )
    return ModelSource(path, spec.folder_name, random_weights=True)


def describe(spec: BenchModelSpec) -> dict:
    counts = spec.params()
    return {**asdict(spec), "name": spec.folder_name, "params": counts,
            "params_total_m": round(sum(counts.values()) / 1e6, 1)}
