"""Engine configuration, shared by the in-process engine and `mmrag engine serve` (built from Settings by
mmrag/wiring/), and the automatic dtype choice."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from mmrag.adapters.hardware import native_cpu_dtype
from mmrag.core.engine import ImageInput
from serving.kv_events import publisher_config


STRUCTURED_OUTPUTS = {"backend": "xgrammar", "disable_any_whitespace": True}


@dataclass(slots=True, frozen=True)
class EngineConfig:
    block_size: int | None  # None: vLLM's default for the platform (128 on CPU, 16 on GPU)
    kv_cache_gib: int
    max_model_len: int
    max_images_per_prompt: int
    enforce_eager: bool
    dtype: str
    max_num_seqs: int
    # False: vLLM's prefix caching and its multimodal processor cache both off — the benchmark's baselines
    # that must recompute every prompt (mmrag/bench/). Every serving path keeps the default.
    caching: bool = True
    # How images are sent (MMRAG_IMAGE_INPUT, serving/engine/images.py): vLLM takes both, so it is no vLLM flag.
    image_input: ImageInput = ImageInput.EMBEDS
    # The standard tier's (min_pixels, max_pixels): vLLM's processor resizes pixels under them unless a request
    # names another tier's (serving/engine/images.py processor_kwargs). None: the checkpoint's processor config.
    image_pixels: tuple[int, int] | None = None
    # Prompt tokens one engine step takes, prefill chunks and decodes together (MMRAG_MAX_BATCHED_TOKENS). None:
    # vLLM's platform default (2048 for `vllm serve` on CPU, 4096 in-process). Smaller steps let a new prompt's
    # first token in sooner beside long prefills (chunked prefill); larger ones prefill more per step
    # (issue 40, measured end to end: 512 on 2 cores).
    max_num_batched_tokens: int | None = None
    # Where the engine publishes its KV events (serving/kv_events.py: routing by what each replica holds), e.g.
    # ``tcp://*:5557`` (replay on the next port); None: it publishes none.
    kv_events: str | None = None
    # The KV cache in blocks instead of what kv_cache_gib holds (vLLM's num_gpu_blocks_override): a replica under
    # KV pressure for the benchmark's eviction scenario and the tests of routing by events. None: by memory.
    kv_blocks: int | None = None
    # Seconds the engine core and its workers poll their shared-memory queues after a message before they sleep
    # until woken (MMRAG_ENGINE_SPIN_MS, resolve_spin_s; serving/engine/lifeline.py applies it in the engine
    # core). None: vLLM's own (1 s). Left out, the host's default, as MMRAG_ENGINE_SPIN_MS=-1 gives it: a config
    # built by hand (the benchmark's, a test's) runs its engine as the server's does.
    spin_s: float | None = field(default_factory=lambda: resolve_spin_s(-1))

    def vllm_kwargs(self) -> dict:
        """Arguments for vLLM's EngineArgs: prefix caching on (unless ``caching`` is off), precomputed image
        embeddings accepted."""
        from vllm.config import StructuredOutputsConfig

        kwargs = dict(
            # Guided JSON without free whitespace: otherwise a weak model pads between tokens until
            # max_tokens and the sub-question JSON comes back truncated. Must be set engine-wide.
            structured_outputs_config=StructuredOutputsConfig(**STRUCTURED_OUTPUTS),
            enable_prefix_caching=self.caching,
            enable_mm_embeds=True,
            limit_mm_per_prompt={"image": self.max_images_per_prompt},
            max_model_len=self.max_model_len,
            enforce_eager=self.enforce_eager,
            dtype=self.dtype,
            max_num_seqs=self.max_num_seqs,
        )
        if self.block_size:
            kwargs["block_size"] = self.block_size
        if self.max_num_batched_tokens:
            kwargs["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.image_pixels:
            kwargs["mm_processor_kwargs"] = self.processor_size()
        if not self.caching:
            kwargs["mm_processor_cache_gb"] = 0
        if self.kv_blocks:
            kwargs["num_gpu_blocks_override"] = self.kv_blocks
        if self.kv_events:
            from vllm.config import KVEventsConfig

            kwargs["kv_events_config"] = KVEventsConfig(**publisher_config(self.kv_events))
        return kwargs

    def serve_flags(self) -> list[str]:
        """The same configuration as `vllm serve` flags."""
        caching = ["--enable-prefix-caching"] if self.caching else ["--no-enable-prefix-caching",
                                                                     "--mm-processor-cache-gb", "0"]
        flags = [
            *caching, "--enable-mm-embeds", "--enable-prompt-tokens-details",
            "--limit-mm-per-prompt", json.dumps({"image": self.max_images_per_prompt}),
            "--max-model-len", str(self.max_model_len), "--dtype", self.dtype,
            "--max-num-seqs", str(self.max_num_seqs),
            "--structured-outputs-config", json.dumps(STRUCTURED_OUTPUTS),
        ]
        if self.enforce_eager:
            flags.append("--enforce-eager")
        if self.image_pixels:
            flags += ["--mm-processor-kwargs", json.dumps(self.processor_size())]
        if self.image_input is ImageInput.PIXELS:
            # Another tier's pixels name their policy per request (mmrag is this replica's client).
            flags.append("--trust-request-mm-kwargs")
        if self.block_size:
            flags += ["--block-size", str(self.block_size)]
        if self.max_num_batched_tokens:
            flags += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.kv_blocks:
            flags += ["--num-gpu-blocks-override", str(self.kv_blocks)]
        if self.kv_events:
            flags += ["--kv-events-config", json.dumps(publisher_config(self.kv_events))]
        return flags


    def processor_size(self) -> dict:
        """vLLM's processor setting for the standard tier's bounds (Qwen-VL's ``size`` edges, in pixels)."""
        low, high = self.image_pixels or (0, 0)
        return {"size": {"shortest_edge": low, "longest_edge": high}}


CPU_SPIN_S = 0.01  # a CPU host's poll after each message (MMRAG_ENGINE_SPIN_MS=-1): see resolve_spin_s


def resolve_spin_s(spin_ms: float) -> float | None:
    """MMRAG_ENGINE_SPIN_MS in seconds; -1 is CPU_SPIN_S on a CPU host and vLLM's own (None) on a GPU host.

    vLLM's readers of its shared-memory queues (the worker waiting for the next step, the engine core for the
    worker's output) poll with ``sched_yield`` for a second after every message before they sleep on a socket
    (``SpinCondition``, ``busy_loop_s=1``): on a GPU host a spare core buys a faster next step. On a CPU host the
    poll takes a core from the model's own threads, the server and the vision encoder after every answer and
    between requests; a tiny-model engine's worker, asked 10 requests 0.2 s apart, used 6.6 s of CPU in 4.3 s
    with vLLM's second and 4.8 s with 10 ms, and the whole test suite on 2 cores ran some 6 % faster (issue 42).
    10 ms still covers the gap between steps of one answer, which the engine core fills at once."""
    if spin_ms != -1:
        return spin_ms / 1000
    import torch

    return None if torch.cuda.is_available() else CPU_SPIN_S


def resolve_dtype(dtype: str) -> str:
    """``auto`` on a CPU host becomes what the CPU runs natively; on a GPU host vLLM's own ``auto`` stays."""
    if dtype != "auto":
        return dtype
    import torch

    return "auto" if torch.cuda.is_available() else native_cpu_dtype()
