"""The remote engine: `vllm serve` replicas over HTTP, routed by prefix affinity.

Each request goes to the replica the routing rule (serving/routing.py, the same rule as the Ray Serve router)
chooses: the one that holds the plan's longest leading image prefix — by its own KV events where the replicas
publish them (``kv_events``: replica URL → publisher endpoint; serving/kv_events.py), else as learned from what
this engine sent it — else the plan's rendezvous
home (highest-random-weight hash of its first image), unless that replica has more than ``queue_bound``
requests of this engine in flight, then the least loaded. So every plan that starts with the same figure lands
on the replica whose prefix cache holds that figure's KV, and adding or removing a replica moves only the keys
that ranked it first. A replica that fails a request loses its affinity entries (it may come back empty).

Faults: a replica that cannot be connected to, drops the connection mid-answer (killed, restarted), stalls
past the read timeout, or answers 5xx (its engine died, it is shutting down) is skipped for the next one in
the same order, each replica at most once per request; when every replica has failed, the caller gets
EngineUnavailableError with each one's cause. A 4xx is the request's own fault and is raised at once.
A failure is classified by how far the request had got, never by the exception's type alone: before a
connection was made (refused, no answer to connect) it is a connect failure (``connect_failures``); once the
request was sent, a failover (``failovers``); and once the replica accepted it (its 200 header came), whatever
breaks the stream after that (dropped, stalled, cut short, an error line) is a failover and a broken stream
(``broken_streams``): re-sent, or reported as "broke off mid-answer", never a connect failure.
Cancelling ``generate`` closes the stream's connection, and vLLM aborts a streamed request whose client
disconnects (Starlette's StreamingResponse watches for the disconnect and cancels vLLM's generator).

The prompt is the one the in-process engine renders: the same chat messages (PromptRenderer.messages), the
image tokens sent as precomputed embeddings with the ImageKey as uuid (vLLM's cache key for the image).

Identity: a replica gets our image tokens only once its checkpoint is known to be the configured one, by
fingerprint (mmrag/adapters/checkpoint.checkpoint_fingerprint: config and weights), never by its served name alone —
a fine-tune served under the base model's name would take the base tower's tokens without a word. vLLM exposes
no digest of what it loaded, so the fingerprint is, in this order: the one the replica announces as a second
served name (`mmrag engine serve` computes it from the files it hands to vLLM, on the replica's host; when it is
ours, the replica is ours whatever it is called there); else that of the folder its /v1/models ``root`` names
(the name must then be ours, as before), read on this host (a shared volume, as in docker-compose.yml: the
same path on another host with other files there would pass, which only the announced fingerprint rules out);
else none, and the replica is refused with the flag that announces it. Replicas that answer are checked when
the engine is built (``RemoteEngine.connect``), the others when they first answer.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import io
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import httpx
import torch

from mmrag.core.pages import EncodedImage
from mmrag.adapters.checkpoint import (
    FINGERPRINT_NAME_PREFIX,
    ModelNotFoundError,
    ModelSource,
    checkpoint_fingerprint,
    fingerprint_name,
    local_checkpoint,
)
from mmrag.adapters.families import checkpoint_family
from mmrag.core.engine import Completion, ImageInput, KVCapacity, OnText, PromptPlan, Usage
from serving.engine.features import FeatureProvider
from serving.engine.images import (ImageTokenCountError, count_mismatch, multi_modal_uuid, pixels_part, plan_form,
                                   processor_kwargs, uncached_images)
from serving.engine.prompt import PromptRenderer
from serving.metrics import Samples, parse_samples, sample_total
from serving.kv_events import KvEventSubscriber
from serving.routing import AffinityTable, prefix_path, rank_replicas

log = logging.getLogger(__name__)

_CACHE_CONFIG = "vllm:cache_config_info"
_PREFIX_QUERIES = "vllm:prefix_cache_queries"
_PREFIX_HITS = "vllm:prefix_cache_hits"


class EngineUnavailableError(RuntimeError):
    """No configured replica could serve the request (each refused, dropped, stalled or failed it)."""


class EngineRequestError(RuntimeError):
    """A replica answered with an error (vLLM's own message is kept)."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"vLLM at {url} answered {status}: {message}")
        self.url = url
        self.status = status
        self.message = message


class ReplicaIdentityError(EngineRequestError):
    """A replica serves another checkpoint than the configured one, or one this host cannot compare with it."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(url, 200, message)
        self.args = (f"replica {url} refused: {message}",)


# --- request / response shapes ---------------------------------------------------------------------------


def image_part(key: str, image: EncodedImage) -> dict[str, Any]:
    """One chat content part carrying precomputed image tokens; the uuid is the full ImageKey."""
    buf = io.BytesIO()
    torch.save(image.image_tokens.contiguous(), buf)
    return {
        "type": "image_embeds",
        "image_embeds": {
            "image_embeds": base64.b64encode(buf.getvalue()).decode("ascii"),
            "image_grid_thw": [int(v) for v in image.grid_thw.reshape(-1)],  # flat over HTTP; nested is a 400
        },
        "uuid": key,
    }


def sampling_fields(plan: PromptPlan) -> dict[str, Any]:
    """The plan's sampling spec as chat-completions fields (same meaning as inprocess.sampling_params)."""
    spec = plan.sampling
    fields: dict[str, Any] = {"max_tokens": spec.max_tokens, "temperature": spec.temperature}
    if spec.stop:
        fields["stop"] = list(spec.stop)
    if spec.min_tokens:
        fields["min_tokens"] = spec.min_tokens  # vLLM's extra sampling parameter
    if spec.json_schema:
        fields["structured_outputs"] = {"json": spec.json_schema}  # vLLM's StructuredOutputsParams
    return fields


def capacity_from_metrics(url: str, samples: Samples) -> KVCapacity:
    infos = samples.get(_CACHE_CONFIG)
    if not infos:
        raise EngineRequestError(url, 200, f"/metrics has no {_CACHE_CONFIG}; is this a vLLM server?")
    # One sample per engine (data-parallel ranks); a replica holds the sum of its engines' blocks.
    blocks = sum(int(labels["num_gpu_blocks"]) for labels, _ in infos)
    return KVCapacity(blocks=blocks, block_size=int(infos[0][0]["block_size"]))


def counter_total(samples: Samples, family: str) -> int:
    return int(sample_total(samples, f"{family}_total"))


class _Stream:
    """Accumulates one streamed chat completion, and how far its attempt got (what a failure is counted as)."""

    def __init__(self, started: float, on_first_token: Callable[[], None] | None = None,
                 on_text: OnText | None = None) -> None:
        self.started = started
        self.on_first_token = on_first_token
        self.on_text = on_text
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.ttft = 0.0
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.accepted = False  # the replica answered 200: it took the request, the answer is under way
        self.chunks = 0  # answer chunks read

    def add(self, url: str, chunk: dict[str, Any]) -> None:
        if "error" in chunk:  # an error after the 200 header comes as one data line
            err = chunk["error"]
            raise EngineRequestError(url, int(err.get("code") or 500), str(err.get("message")))
        self.chunks += 1
        for choice in chunk.get("choices") or []:
            content = (choice.get("delta") or {}).get("content") or ""
            ids = choice.get("token_ids") or []
            if (content or ids) and not self.ttft:
                self.ttft = time.perf_counter() - self.started  # the first chunk with generated output
                if self.on_first_token is not None:
                    self.on_first_token()
            self.text.append(content)
            if content and self.on_text is not None:
                self.on_text(content)
            self.token_ids.extend(ids)
            self.finish = choice.get("finish_reason") or self.finish
        if chunk.get("usage"):
            self.usage = chunk["usage"]


# --- the engine ------------------------------------------------------------------------------------------


class RemoteEngine:
    def __init__(
        self,
        urls: list[str],
        model: ModelSource,
        features: FeatureProvider,
        *,
        tokenizer: Any = None,
        timeout_s: float = 120.0,
        connect_timeout_s: float = 3.0,
        queue_bound: int = 8,
        image_input: ImageInput = ImageInput.EMBEDS,
        image_pixels: tuple[int, int] | None = None,
        max_num_seqs: int | None = None,
        kv_events: Mapping[str, str] | None = None,
    ) -> None:
        # The batch each replica is started with (MMRAG_MAX_NUM_SEQS, what `mmrag engine serve` passes): its
        # share of batch_capacity() where the replica does not say its own (GET /server_info is vLLM's dev mode).
        self.max_num_seqs = max_num_seqs
        # The form images are sent in (serving/engine/images.py), and the replicas' own processor bounds (the
        # standard tier's: EngineConfig.image_pixels, which `mmrag engine serve` starts them with).
        self.image_input, self.image_pixels = image_input, image_pixels
        self.urls = [u.strip().rstrip("/") for u in urls if u.strip()]
        if not self.urls:
            raise ValueError("RemoteEngine needs at least one replica URL (MMRAG_ENGINE_URLS)")
        self.model_name = model.name
        self.random_weights = model.random_weights
        self.model = model
        self.features = features
        if tokenizer is None:
            from transformers import AutoTokenizer

            # The same tokenizer and chat template the replicas load: image spans are computed locally.
            tokenizer = AutoTokenizer.from_pretrained(str(model.path), local_files_only=True)
        self.renderer = PromptRenderer(tokenizer, image_pad_token=checkpoint_family(model.path).image_pad_token)
        # Connecting is a LAN round trip: a replica that cannot be reached in seconds is down, so the next is
        # tried soon. ``timeout_s`` bounds each wait for the stream's next bytes (queueing + prefill before the
        # first token, then one decode step). No pool cap: a streamed answer holds its connection throughout,
        # and a cap would queue requests here behind a PoolTimeout; the scheduler bounds what is in flight.
        # Idle connections are dropped well before vLLM's own 5 s keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE)
        # closes them, so a request is not written into a connection the replica is closing (a ReadError).
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=20, keepalive_expiry=2.0),
        )
        # How requests failed, by replica URL (see the module docstring): connections that could not be made;
        # requests that failed there once sent; of those, the streams it had accepted that broke off mid-answer.
        self.connect_failures: Counter[str] = Counter()
        self.failovers: Counter[str] = Counter()
        self.broken_streams: Counter[str] = Counter()
        # The routing rule's inputs: what each replica was sent, and this engine's requests in flight there.
        self.affinity = AffinityTable()
        self.in_flight: Counter[str] = Counter()
        self.bytes_sent: Counter[str] = Counter()  # form -> base64 image bytes sent to replicas
        self.queue_bound = queue_bound
        self.connect_timeout_s = connect_timeout_s
        # Who holds which prefix by the replicas' own word, where they publish KV events; routes decided by them
        # ("events": every live replica's events known) or by the learned table ("table").
        self.kv_events = KvEventSubscriber(
            {u.strip().rstrip("/"): e for u, e in kv_events.items()}) if kv_events else None
        self.routed: Counter[str] = self.kv_events.routed if self.kv_events else Counter()
        self._served_names: dict[str, str] = {}  # replica URL -> our model's name there, once identified

    def with_image_input(self, form: ImageInput) -> RemoteEngine:
        """This engine (the same replicas, client and counters) sending images in ``form``: for comparing the two
        forms on the same replicas (tests, benchmarks). A deployment uses one form (MMRAG_IMAGE_INPUT)."""
        other = copy.copy(self)
        other.image_input = form
        return other

    # -- generation --

    async def generate(self, plan: PromptPlan, *, on_first_token: Callable[[], None] | None = None,
                       on_text: OnText | None = None) -> Completion:
        started = time.perf_counter()
        feats = await self.features.load(plan.images)
        form = plan_form(self.image_input, plan.images, feats)
        part = pixels_part if form is ImageInput.PIXELS else image_part
        # torch.save (or the stored PNG) + base64 of ~100 KB-1 MB per image: blocking work, off the event loop.
        uuids = [multi_modal_uuid(k, form) for k in plan.images]
        parts = await asyncio.to_thread(lambda: [part(u, f) for u, f in zip(uuids, feats)])
        self.bytes_sent[form.value] += sum(_part_bytes(p) for p in parts)
        prompt = self.renderer.render(plan)
        layout = self.renderer.tokens(prompt, [f.num_tokens for f in feats])
        body = {
            "messages": self.renderer.messages(plan, parts),
            **sampling_fields(plan),
            "stream": True,
            "stream_options": {"include_usage": True},  # the last chunk carries usage (and cached tokens)
            "return_token_ids": True,  # generated ids, comparable with the in-process engine's
        }
        if plan.cache_salt:
            body["cache_salt"] = plan.cache_salt  # vLLM folds it into the first block's hash, as in-process
        if form is ImageInput.PIXELS and (kwargs := processor_kwargs(plan.images, self.image_pixels)):
            body["mm_processor_kwargs"] = kwargs  # another tier: resized as its policy says
        url, out = await self._send(plan, body, started, on_first_token, on_text, uuids)
        prompt_tokens, cached = _prompt_usage(url, out.usage, layout.prompt_tokens, form)
        return Completion(
            "".join(out.text),
            out.token_ids,
            Usage(
                prompt_tokens=prompt_tokens,
                image_tokens=layout.image_tokens,
                cached_tokens=cached,
                cached_image_tokens=layout.cached_image_tokens(cached),
                # Embeds: the replica gets stored tokens and runs no encoder. Pixels: an upper bound, as in-process.
                vision_encodes=uncached_images(layout.image_spans, cached) if form is ImageInput.PIXELS else 0,
                completion_tokens=int((out.usage or {}).get("completion_tokens") or len(out.token_ids)),
                ttft_s=out.ttft,
                latency_s=time.perf_counter() - started,
                image_input=form.value,
            ),
            self.model_name,
            out.finish,
            replica=url,
        )

    async def _send(self, plan: PromptPlan, body: dict[str, Any], started: float,
                    on_first_token: Callable[[], None] | None = None,
                    on_text: OnText | None = None, uuids: list[str] | None = None) -> tuple[str, _Stream]:
        # Re-sending to the next replica is safe: the answer is a pure function of the prompt (the same weights
        # on every replica; greedy decoding gives the same tokens, sampling another draw from the same
        # distribution; the prefix cache changes speed, never tokens), nothing of a failed attempt reaches the
        # caller (its partial stream is dropped; of the text already streamed to ``on_text``, the next attempt
        # tells only what goes beyond it), and a replica that may still hold the request has lost our
        # connection and aborts it. Each replica is tried once: attempts <= len(self.urls).
        first_token = once(on_first_token)
        told = Told(on_text)
        failures: list[str] = []
        known = self.kv_events.index.holding(self.urls, plan.cache_salt, uuids or []) if self.kv_events else {}
        if self.kv_events:
            self.kv_events.decided(known, len(self.urls))
        else:
            self.routed["table"] += 1
        for url in rank_replicas(plan, {u: self.in_flight[u] for u in self.urls}, self.affinity, self.queue_bound,
                                 known):
            self.affinity.record(url, prefix_path(plan))
            self.in_flight[url] += 1
            out = _Stream(started, first_token, told.attempt())
            try:
                body["model"] = await self._served_name(url)
                return url, await self._stream(url, body, out)
            except (EngineRequestError, httpx.RequestError) as exc:
                if isinstance(exc, EngineRequestError) and exc.status < 500:
                    raise  # the request's fault: every replica would refuse it the same way
                cause = self._count_failure(url, out, exc)
            finally:
                self.in_flight[url] -= 1
            self._served_names.pop(url, None)  # a replica that comes back may serve under another name
            self.affinity.drop(url)  # and with an empty cache
            failures.append(f"{url} ({cause})")
            log.warning("replica %s %s; re-sending to the next one", url, cause)
        raise EngineUnavailableError(
            f"no vLLM replica could serve the request: {'; '.join(failures)}. Start one with `mmrag engine "
            "serve` (it prints the URL), or fix MMRAG_ENGINE_URLS to list running replicas."
        )

    def _count_failure(self, url: str, out: _Stream, exc: EngineRequestError | httpx.RequestError) -> str:
        """Count a failed attempt by how far it got, never by the error's type alone; its cause, as reported."""
        what = f"answered {exc.status}: {exc.message}" if isinstance(exc, EngineRequestError) else _cause(exc)
        if out.accepted:
            # The replica had taken the request (200): whatever broke the stream since (RemoteProtocolError or
            # ReadError: killed, restarted; ReadTimeout: stalled; an error line; cut short before [DONE]), and
            # whatever httpx calls it, the answer broke off mid-way. Never a connect failure.
            self.failovers[url] += 1
            self.broken_streams[url] += 1
            return f"broke off mid-answer after {out.chunks} chunks ({len(out.token_ids)} tokens): {what}"
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):  # refused, or no answer to connect
            self.connect_failures[url] += 1
            return f"could not connect: {what}"
        # Sent, not taken: a 5xx (its engine died, it is shutting down), or the connection dropped, stalled past
        # the read timeout or failed a write before the answer began.
        self.failovers[url] += 1
        return what if isinstance(exc, EngineRequestError) else f"failed mid-request: {what}"

    async def _stream(self, url: str, body: dict[str, Any], out: _Stream) -> _Stream:
        async with self.client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise EngineRequestError(url, resp.status_code, _error_message(resp))
            out.accepted = True
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    return out
                try:
                    chunk = json.loads(data)
                except ValueError:
                    raise EngineRequestError(url, 502, f"unreadable stream line {data[:200]!r}") from None
                out.add(url, chunk)
        raise EngineRequestError(url, 502, "the stream ended without its [DONE] line: the replica stopped")

    async def _served_name(self, url: str) -> str:
        """The replica's name for our model, once its checkpoint is known to be ours (see the module docstring)."""
        if url not in self._served_names:
            resp = await self.client.get(f"{url}/v1/models")
            # Hashing a checkpoint this process has not hashed yet reads its weights: off the event loop.
            self._served_names[url] = await asyncio.to_thread(identify_replica, url, resp, self.model)
        return self._served_names[url]

    @classmethod
    def connect(cls, urls: list[str], model: ModelSource, features: FeatureProvider, **kwargs: Any) -> RemoteEngine:
        """The engine over ``urls``, each replica that answers now checked against ``model`` first: one serving
        another checkpoint stops the start-up (ReplicaIdentityError). One that does not answer yet is checked
        when it first does."""
        engine = cls(urls, model, features, **kwargs)
        names: dict[str, str] = {}
        with httpx.Client(timeout=httpx.Timeout(30.0, connect=engine.connect_timeout_s)) as client:
            for url in engine.urls:
                try:
                    resp = client.get(f"{url}/v1/models")
                except httpx.TransportError as exc:
                    log.warning("replica %s did not answer /v1/models (%s): its checkpoint is checked when it "
                                "first answers", url, _cause(exc))
                    continue
                names[url] = identify_replica(url, resp, model)
        engine._served_names.update(names)
        return engine

    # -- capacity and counters --

    async def replica_capacities(self) -> dict[str, KVCapacity]:
        """KV capacity of each reachable replica (a refused one is counted and left out; none → error)."""
        return {url: capacity_from_metrics(url, s) for url, s in (await self._metrics()).items()}

    async def kv_capacity(self) -> KVCapacity:
        """The smallest replica's capacity: warm-up fills each replica only with the keys routed to it."""
        return min((await self.replica_capacities()).values(), key=lambda c: c.tokens)

    async def batch_capacity(self) -> int:
        """Every configured replica's batch (a replica down now is back soon, and failover sends its plans to the
        others, which queue them): each one's max_num_seqs from its GET /server_info where it serves that route
        (vLLM's dev mode), else the batch it was started with (``max_num_seqs``)."""

        async def one(url: str) -> int:
            try:
                resp = await self.client.get(f"{url}/server_info", params={"config_format": "json"})
                if resp.status_code == 200:
                    return int(resp.json()["vllm_config"]["scheduler_config"]["max_num_seqs"])
            except (httpx.TransportError, ValueError, KeyError, TypeError) as exc:
                log.info("replica %s did not say its batch size (%s)", url, _cause(exc))
            if self.max_num_seqs is None:
                raise EngineUnavailableError(
                    f"replica {url} does not say its batch size (GET /server_info is served in vLLM's dev mode "
                    "only): set MMRAG_MAX_NUM_SEQS to the --max-num-seqs the replicas run with, or "
                    "MMRAG_MAX_CONCURRENCY to the plans to let in at once")
            return self.max_num_seqs

        return sum(await asyncio.gather(*(one(u) for u in self.urls)))

    async def prefix_counters(self) -> dict[str, tuple[int, int]]:
        """Per replica: (prefix-cache queries, hits), in tokens, since the replica started."""
        return {
            url: (counter_total(s, _PREFIX_QUERIES), counter_total(s, _PREFIX_HITS))
            for url, s in (await self._metrics()).items()
        }

    async def _metrics(self) -> dict[str, Samples]:
        async def one(url: str) -> Samples | None:
            try:
                resp = await self.client.get(f"{url}/metrics")
            except httpx.TransportError as exc:
                if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
                    self.connect_failures[url] += 1
                log.warning("replica %s did not answer /metrics (%s); leaving it out", url, _cause(exc))
                return None
            if resp.status_code != 200:
                raise EngineRequestError(url, resp.status_code, resp.text[:500])
            return parse_samples(resp.text)

        results = dict(zip(self.urls, await asyncio.gather(*(one(u) for u in self.urls))))
        alive = {url: s for url, s in results.items() if s is not None}
        if not alive:
            raise EngineUnavailableError(
                f"no vLLM replica answered /metrics at {', '.join(self.urls)}. Start one with `mmrag engine "
                "serve`, or fix MMRAG_ENGINE_URLS to list running replicas."
            )
        return alive

    async def reset_prefix_cache(self) -> None:
        """Drop every replica's cached prefixes. vLLM serves this route only with VLLM_SERVER_DEV_MODE=1."""
        for url in self.urls:
            try:
                resp = await self.client.post(f"{url}/reset_prefix_cache")
            except httpx.TransportError as exc:
                raise EngineUnavailableError(f"replica {url} did not answer POST /reset_prefix_cache "
                                             f"({_cause(exc)}): start it, or fix MMRAG_ENGINE_URLS") from exc
            if resp.status_code == 404:
                raise EngineRequestError(url, 404, "POST /reset_prefix_cache is off: start the replica with "
                                                   "VLLM_SERVER_DEV_MODE=1 to allow it")
            if resp.status_code != 200:
                raise EngineRequestError(url, resp.status_code, _error_message(resp))
            self.affinity.drop(url)  # it holds nothing now
            if self.kv_events is not None and _reset_succeeded(resp):
                self.kv_events.index.cleared(url)

    async def close(self) -> None:
        await self.client.aclose()
        if self.kv_events is not None:
            await asyncio.to_thread(self.kv_events.close)


def _reset_succeeded(resp: httpx.Response) -> bool:
    """vLLM's POST /reset_prefix_cache answers {"success": false} when blocks were still in use."""
    try:
        return bool(resp.json().get("success", False))
    except (ValueError, AttributeError):
        return False


def _part_bytes(part: dict[str, Any]) -> int:
    """The base64 payload an image content part carries (what crosses the network for it)."""
    if part["type"] == "image_url":
        return len(part["image_url"]["url"])
    return len(part["image_embeds"]["image_embeds"])


def _prompt_usage(
    url: str, usage: dict[str, Any] | None, local_prompt_tokens: int, form: ImageInput
) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) from the replica's usage, checked against the local render."""
    details = (usage or {}).get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is None:
        raise EngineRequestError(
            url, 200, "the response has no usage.prompt_tokens_details.cached_tokens; start the replica "
            "with --enable-prompt-tokens-details (`mmrag engine serve` does)"
        )
    prompt_tokens = int(usage["prompt_tokens"])
    mismatch = count_mismatch(form, local_prompt_tokens, prompt_tokens)
    if mismatch:
        # The image spans (hence cached image tokens) come from the local render: they must be the same prompt.
        raise ImageTokenCountError(f"replica {url}: {mismatch}")
    return prompt_tokens, int(details["cached_tokens"])


def identify_replica(url: str, resp: httpx.Response, model: ModelSource) -> str:
    """The name under which the replica that answered ``resp`` (its GET /v1/models) serves ``model``, once
    the fingerprint of the checkpoint behind that name is ``model``'s (see the module docstring)."""
    if resp.status_code != 200:
        raise EngineRequestError(url, resp.status_code, _error_message(resp))
    listed = resp.json()["data"]
    cards = [c for c in listed if not c["id"].startswith(FINGERPRINT_NAME_PREFIX)]
    announced = {c["id"].removeprefix(FINGERPRINT_NAME_PREFIX) for c in listed
                 if c["id"].startswith(FINGERPRINT_NAME_PREFIX)}
    expected = checkpoint_fingerprint(model.path)
    fix = (f"Start the replica on the checkpoint MMRAG_MODEL names ({model.path}; `mmrag engine serve` does), "
           f"or point MMRAG_MODEL at the checkpoint the replica serves")
    if announced:
        if expected not in announced or not cards:
            raise ReplicaIdentityError(
                url, f"it serves {', '.join(c['id'] for c in cards)} from checkpoint {', '.join(sorted(announced))} "
                f"(the fingerprint it announces), but MMRAG_MODEL's checkpoint {model.path} is {expected}: another "
                f"checkpoint (a fine-tune?) served under our model's name would be fed the configured tower's image "
                f"tokens. {fix}.")
        return cards[0]["id"]  # our checkpoint, whatever it is called there
    wanted = {model.name, str(model.path)}
    names = [c["id"] for c in cards if c["id"] in wanted or c.get("root") in wanted]
    if not names:
        raise EngineRequestError(
            url, 200, f"the replica serves {', '.join(c['id'] for c in cards)}, not {model.name} ({model.path}). "
            f"Point MMRAG_MODEL at the same checkpoint, or start the replica with `--served-model-name {model.name}`"
        )
    name = names[0]
    root = next(c.get("root") for c in cards if c["id"] == name)
    try:
        served = local_checkpoint(root)
    except ModelNotFoundError:
        raise ReplicaIdentityError(
            url, f"it serves {name} from {root}, which this host cannot read to compare with {model.path}, and "
            f"it announces no checkpoint fingerprint. Start it with `mmrag engine serve` (which announces the "
            f"fingerprint of what it loads), or mount the checkpoint at {root} on this host too; or, once you "
            f"have made sure it loads the same files, add `--served-model-name {name} "
            f"{fingerprint_name(expected)}` to its `vllm serve` command.") from None
    found = checkpoint_fingerprint(served)
    if found != expected:
        raise ReplicaIdentityError(
            url, f"it serves {name} from {root}, whose checkpoint ({served}) is {found}, but MMRAG_MODEL's "
            f"({model.path}) is {expected}: another checkpoint (a fine-tune?) served under our model's name would "
            f"be fed the configured tower's image tokens. {fix}.")
    return name


def _error_message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:500] or resp.reason_phrase


def _cause(exc: Exception) -> str:
    """An httpx error as text: several (ReadTimeout, PoolTimeout) carry an empty message."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def once(fn: Callable[[], None] | None) -> Callable[[], None] | None:
    """``fn``, called at most once: a re-sent request must not report its prefill twice (Engine.generate)."""
    if fn is None:
        return None
    called = False

    def call() -> None:
        nonlocal called
        if not called:
            called = True
            fn()

    return call


class Told:
    """The text told to ``on_text`` over the attempts of one request. A re-sent request streams again the
    text a failed attempt already told (greedy decoding: the same tokens), so only what goes beyond it is
    told; with sampling the re-sent text may differ, and the completion's text is the answer."""

    def __init__(self, on_text: OnText | None) -> None:
        self.on_text = on_text
        self.chars = 0

    def attempt(self) -> OnText | None:
        if self.on_text is None:
            return None
        on_text, seen = self.on_text, 0

        def tell(delta: str) -> None:
            nonlocal seen
            start, seen = seen, seen + len(delta)
            if seen > self.chars:
                on_text(delta[max(0, self.chars - start):])
                self.chars = seen

        return tell
