"""The in-process engine: vLLM's AsyncLLM in this process (its engine core runs in a child process)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

from mmrag.adapters.checkpoint import ModelSource
from mmrag.adapters.families import checkpoint_family
from mmrag.core.engine import Completion, ImageInput, KVCapacity, OnText, PromptPlan, Usage
from mmrag.core.pages import EncodedImage
from serving.engine.config import EngineConfig
from serving.engine.features import FeatureProvider
from serving.engine.images import (ImageTokenCountError, count_mismatch, decode_pixels, multi_modal_uuid,
                                   plan_form, processor_kwargs, uncached_images)
from serving.engine.lifeline import keep_engine_sockets_private, spin_env, tie_engine_cores_to_this_process
from serving.engine.prompt import PromptRenderer

log = logging.getLogger(__name__)


def sampling_params(plan: PromptPlan) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    spec = plan.sampling
    return SamplingParams(
        max_tokens=spec.max_tokens,
        min_tokens=spec.min_tokens,
        temperature=spec.temperature,
        stop=list(spec.stop) or None,
        structured_outputs=StructuredOutputsParams(json=spec.json_schema) if spec.json_schema else None,
        output_kind=RequestOutputKind.DELTA,  # stream deltas: the first one timestamps TTFT
    )


class InProcessEngine:
    def __init__(self, llm: Any, model: ModelSource, features: FeatureProvider, config: EngineConfig) -> None:
        self.llm = llm
        self.model_name = model.name
        self.random_weights = model.random_weights
        self.features = features
        self.config = config
        self.family = checkpoint_family(model.path)  # how its image tokens go to vLLM (Qwen3-VL: deepstack too)
        self.renderer = PromptRenderer(llm.get_tokenizer(), image_pad_token=self.family.image_pad_token)

    @classmethod
    def start(cls, model: ModelSource, features: FeatureProvider, config: EngineConfig, *,
              metrics: bool = True) -> InProcessEngine:
        """Start vLLM (tens of seconds on CPU). Call once per process and share the engine.

        ``metrics``: vLLM's `vllm:*` metrics in the process-wide registry. There is one set per process —
        a second engine's stat logger unregisters the first's — so only the serving engine should have them.
        """
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        # vLLM's CPU backend sizes its KV cache from this variable, not from device memory.
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(config.kv_cache_gib)
        spin_env(config.spin_s)  # how long its processes poll for the next step (serving/engine/lifeline.py)
        tie_engine_cores_to_this_process()  # a `kill -9` of this process must not leave the engine core behind
        keep_engine_sockets_private()  # nor its socket files in /tmp
        # Served under its name, not its folder: vLLM labels its metrics with it.
        args = AsyncEngineArgs(model=str(model.path), served_model_name=[model.name], disable_log_stats=not metrics,
                               **config.vllm_kwargs())
        t0 = time.perf_counter()
        engine = cls(AsyncLLM.from_engine_args(args), model, features, config)
        vllm_config = engine.llm.vllm_config
        cache = vllm_config.cache_config
        log.info("engine ready in %.1f s: model %s, dtype %s, block size %s, %s KV blocks",
                 time.perf_counter() - t0, model.name, str(vllm_config.model_config.dtype).removeprefix("torch."),
                 cache.block_size, cache.num_gpu_blocks)
        return engine

    def with_image_input(self, form: ImageInput) -> InProcessEngine:
        """This engine (the same vLLM, caches and all) sending images in ``form``: for comparing the two forms on
        one engine (tests, benchmarks). A deployment uses one form (MMRAG_IMAGE_INPUT)."""
        other = copy.copy(self)
        other.config = dataclasses.replace(self.config, image_input=form)
        return other

    async def generate(self, plan: PromptPlan, *, on_first_token: Callable[[], None] | None = None,
                       on_text: OnText | None = None) -> Completion:
        started = time.perf_counter()
        feats = await self.features.load(plan.images)
        form = plan_form(self.config.image_input, plan.images, feats)
        if form is ImageInput.PIXELS:  # PNG decoding: blocking work, kept off the event loop
            request = self.build_request(plan, feats, form, await asyncio.to_thread(decode_pixels, feats))
        else:
            request = self.build_request(plan, feats, form)
        return await self.run_request(plan, request, [f.num_tokens for f in feats], started=started,
                                      vision_encodes=0, on_first_token=on_first_token, on_text=on_text, form=form)

    async def run_request(
        self,
        plan: PromptPlan,
        request: dict[str, Any],
        image_tokens: list[int],
        *,
        started: float,
        vision_encodes: int,
        on_first_token: Callable[[], None] | None = None,
        on_text: OnText | None = None,
        form: ImageInput | None = None,
    ) -> Completion:
        """Stream one vLLM request to its end and account for it: the one request loop over this AsyncLLM.

        ``request`` is vLLM's prompt dict (``prompt`` rendered from ``plan``, plus its images in any form vLLM
        takes: precomputed image tokens from :meth:`build_request`, or pixels); ``image_tokens`` the tokens each
        image expands to, for the cached-image count; ``started`` the ``perf_counter`` time TTFT and latency
        count from; ``vision_encodes`` the vision forwards the request cost, reported in its usage;
        ``on_text`` is told each delta's text as vLLM detokenizes it. ``form``: the mmrag form that sent the
        images (reported in the usage; pixels: the images not served from the prefix cache count as the vision
        forwards, and a prompt whose images vLLM expanded to other token counts than ``image_tokens`` is
        stopped); None for requests built elsewhere (the benchmark's peers), which are not checked.
        """
        layout = self.renderer.tokens(request["prompt"], image_tokens)
        token_ids: list[int] = []
        text, ttft, cached, finish, prompt_len = [], 0.0, 0, None, layout.prompt_tokens
        async for out in self.llm.generate(request, sampling_params(plan), request_id=uuid.uuid4().hex):
            if not ttft:
                if form is not None and out.prompt_token_ids is not None:
                    mismatch = count_mismatch(form, layout.prompt_tokens, len(out.prompt_token_ids))
                    if mismatch:  # leaving the loop aborts the request in vLLM
                        raise ImageTokenCountError(mismatch)
                ttft = time.perf_counter() - started
                if on_first_token is not None:
                    on_first_token()  # prefill is done: the prompt's blocks are now in the prefix cache
            cached = out.num_cached_tokens or 0
            prompt_len = len(out.prompt_token_ids) if out.prompt_token_ids is not None else prompt_len
            piece = out.outputs[0]
            token_ids.extend(piece.token_ids)
            text.append(piece.text)
            if on_text is not None and piece.text:
                on_text(piece.text)
            finish = piece.finish_reason or finish
        usage = Usage(
            prompt_tokens=prompt_len,
            image_tokens=layout.image_tokens,
            cached_tokens=cached,
            cached_image_tokens=layout.cached_image_tokens(cached),
            vision_encodes=(uncached_images(layout.image_spans, cached) if form is ImageInput.PIXELS
                            else vision_encodes),
            completion_tokens=len(token_ids),
            ttft_s=ttft,
            latency_s=time.perf_counter() - started,
            image_input=form.value if form is not None else "",
        )
        return Completion("".join(text), token_ids, usage, self.model_name, finish)

    def build_request(self, plan: PromptPlan, feats: list[EncodedImage], form: ImageInput = ImageInput.EMBEDS,
                      pixels: list[Any] | None = None) -> dict[str, Any]:
        """vLLM's prompt dict: the images as stored tokens (embeds), or as ``pixels`` (their decoded stored
        pixels, resized by vLLM under the keys' policy)."""
        request: dict[str, Any] = {"prompt": self.renderer.render(plan)}
        if plan.cache_salt:
            request["cache_salt"] = plan.cache_salt
        if feats:
            if form is ImageInput.PIXELS:
                request["multi_modal_data"] = {"image": pixels}
                if kwargs := processor_kwargs(plan.images, self.config.image_pixels):
                    request["mm_processor_kwargs"] = kwargs
            else:
                request["multi_modal_data"] = {"image": self.family.vllm_image_item(feats)}
            # The uuid replaces vLLM's content hash as the cache key of each image: it must be the full key.
            request["multi_modal_uuids"] = {"image": [multi_modal_uuid(k, form) for k in plan.images]}
        return request

    async def kv_capacity(self) -> KVCapacity:
        cache = self.llm.vllm_config.cache_config
        return KVCapacity(blocks=int(cache.num_gpu_blocks or 0), block_size=int(cache.block_size))

    async def batch_capacity(self) -> int:
        return int(self.llm.vllm_config.scheduler_config.max_num_seqs)

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached block (benchmarks and cold-path tests start from here). False: vLLM did not, as
        blocks were in use by requests still running."""
        return bool(await self.llm.reset_prefix_cache())

    async def close(self) -> None:
        # Stopped at once, as `vllm serve` stops its own (VllmConfig.shutdown_timeout 0: requests still in flight
        # are aborted). vLLM's default here waits 5 s for the engine core, which waits for its worker, which spends
        # longer than that in its interpreter's final garbage collection: it is killed after the wait anyway.
        self.llm.shutdown(timeout=0)
        # Drop the last reference now: AsyncLLM.__del__ shuts down again, which fails noisily if it only runs
        # at interpreter exit, after the modules it needs are gone.
        self.llm = None
