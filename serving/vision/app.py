"""`mmrag vision serve`: the vision tower + projector as a service of its own, on its own device.

POST /v1/encode takes image bytes (multipart, one or more ``images`` parts; PNG for rendered pages, which keeps
them lossless) and answers, per image, its ImageKey, token count and grid; the tokens go to the shared
feature store under that key. With ``Accept: application/octet-stream`` (or ``?tokens=true``) the answer is
the tokens themselves, one safetensors blob (adapters/vision_client.py pack_tokens). Images are decoded with
ingestion's defences and hashed as ingestion hashes a page, so a page gets the same key either way.
Built by mmrag/wiring.py ``vision_app``; the batching lives in serving/vision/batcher.py.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated

from fastapi import FastAPI, File, Query, Request, Response, UploadFile
from PIL import Image
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from adapters.store import FeatureStore
from adapters.vision import VisionEncoder
from adapters.vision_client import TOKENS_MEDIA_TYPE, EncodedEntry, VisionServiceInfo, pack_tokens
from core.settings import Settings
from ingestion.loaders import ImageTooLargeError, IngestError, decode_image, image_content_hash
from serving.api import errors
from serving.api.errors import ApiError
from serving.api.schemas import Check, Health, error_responses
from serving.vision.batcher import QueueFullError, VisionBatcher
from serving.vision.metrics import VisionMetrics


@dataclass(slots=True)
class VisionService:
    """What the app serves with: the in-process encoder, the store its tokens go to, the batcher in front."""

    encoder: VisionEncoder
    store: FeatureStore
    batcher: VisionBatcher
    metrics: VisionMetrics
    info: VisionServiceInfo


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EncodedImageInfo(_Body):
    key: str = Field(description="The ImageKey its tokens are stored under "
                     "(img1-<sha256>-<encoder>-px<min>-<max>[-pool<n>]).")
    tokens: int = Field(description="Image tokens (rows of the tensor).")
    grid_thw: list[int] = Field(description="Temporal, height, width patches before merging.")
    source: str = Field(description="forward (encoded now), store (already stored) or shared (another "
                        "request's forward of the same image).")


class EncodeResponse(_Body):
    images: list[EncodedImageInfo] = Field(description="One per uploaded image, in upload order.")


class TokenCount(_Body):
    tokens: int = Field(description="Image tokens an image of this size takes under the service's policy.")


class InfoPolicy(_Body):
    min_pixels: int
    max_pixels: int
    pool: int = Field(description="The side of the square of merged tokens averaged into one (1: none, 2: 2x2); "
                      "part of every key, as -pool2.")


class InfoResponse(_Body):
    encoder_version: str = Field(description="The encoder version in every key this service makes.")
    policy: InfoPolicy = Field(description="The resolution policy in every key this service makes.")
    family: str = Field(description="The checkpoint's model_type (qwen2_vl, ...).")
    device: str = Field(description="Where the tower runs (cpu, cuda, cuda:N).")
    dtype: str = Field(description="The tower's compute dtype.")


class VisionReadiness(_Body):
    ready: bool = Field(description="True when every check is ok; the status is then 200, else 503.")
    checks: dict[str, Check] = Field(description="The batcher running, and the feature store answering.")


@dataclass(frozen=True, slots=True)
class _Size:
    """An image's size alone: all num_tokens_for reads (a W x H image need not be allocated to count it)."""

    size: tuple[int, int]


_ENCODE_ERRORS = error_responses({
    400: "An image cannot be decoded (`invalid_image`): the message says which and why.",
    413: "An image over MMRAG_MAX_IMAGE_BYTES or MMRAG_MAX_IMAGE_PIXELS (`image_too_large`), or more images "
         "than MMRAG_VISION_QUEUE_CAP in one request (`too_many_images`).",
    429: "The queue is full (`vision_queue_full`): retry after the Retry-After seconds.",
    503: "The feature store is unreachable (`feature_store_unavailable`).",
})


def create_vision_app(settings: Settings, service: VisionService) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        service.batcher.start()
        yield
        await service.batcher.close()

    app = FastAPI(title="mmrag vision", version="0.1.0", lifespan=lifespan,
                  description="The vision tower + projector: image bytes in, image tokens (by ImageKey) out.")
    errors.install(app, errors.ServerPaths.of(settings))
    batcher, metrics = service.batcher, service.metrics
    metrics.queued.set_function(lambda: batcher.queued)

    @app.post("/v1/encode", summary="Encode images to image tokens, stored under their ImageKeys",
              response_model=EncodeResponse, responses={
                  **_ENCODE_ERRORS, 200: {"content": {TOKENS_MEDIA_TYPE: {}}, "description": "JSON, or with "
                                          "Accept: application/octet-stream the tokens as safetensors."}})
    async def encode(
        request: Request,
        images: Annotated[list[UploadFile], File(description="Image files (PNG, JPEG, WebP, TIFF).")],
        tokens: Annotated[bool, Query(description="Answer the tokens as safetensors (as Accept: "
                                                  "application/octet-stream does).")] = False,
    ) -> Response:
        if len(images) > settings.vision_queue_cap:
            raise ApiError(413, "too_many_images", f"{len(images)} images in one request, over the queue's "
                           f"{settings.vision_queue_cap}", "send fewer per request, or raise MMRAG_VISION_QUEUE_CAP")
        datas = [await _read(i, upload, settings) for i, upload in enumerate(images)]
        decoded = await asyncio.to_thread(_decode_all, datas, [u.filename for u in images], settings)
        items = [(service.encoder.key_for(image_content_hash(im)), im) for im in decoded]
        try:
            results = await batcher.encode(items)
        except QueueFullError as exc:
            metrics.refused(len(items))
            raise ApiError(429, "vision_queue_full", str(exc), "retry after the Retry-After seconds; for more "
                           "throughput run the service on a GPU or raise MMRAG_VISION_MAX_BATCH",
                           headers={"Retry-After": str(exc.retry_after_s)}) from exc
        entries = [EncodedEntry(key, value, source.value) for (key, _), (value, source) in zip(items, results)]
        if tokens or TOKENS_MEDIA_TYPE in request.headers.get("accept", ""):
            answer: Response = Response(pack_tokens(entries), media_type=TOKENS_MEDIA_TYPE)
        else:
            answer = Response(_describe(entries).model_dump_json(), media_type="application/json")
        metrics.transferred(sum(map(len, datas)), len(answer.body))
        return answer

    @app.get("/v1/tokens", summary="Image tokens an image of this size takes", response_model=TokenCount)
    async def count(width: Annotated[int, Query(ge=1)], height: Annotated[int, Query(ge=1)]) -> TokenCount:
        if width * height > settings.max_image_pixels:
            raise ApiError(413, "image_too_large", f"{width}x{height} px is over MMRAG_MAX_IMAGE_PIXELS "
                           f"({settings.max_image_pixels:,})", "no image of this size can be encoded here")
        return TokenCount(tokens=service.encoder.num_tokens_for(_Size((width, height))))

    @app.get("/v1/info", summary="The encoder whose keys this service makes", response_model=InfoResponse)
    async def info() -> dict:
        return service.info.to_json()

    @app.get("/healthz", summary="Liveness: the process answers", response_model=Health)
    async def healthz() -> Health:
        return Health(status="ok")

    @app.get("/readyz", summary="Readiness: the batcher runs and the feature store answers",
             response_model=VisionReadiness, response_model_exclude_unset=True)
    async def readyz(response: Response) -> VisionReadiness:
        checks = {"batcher": Check(ok=True, detail=f"{batcher.queued} images queued") if batcher.running
                  else Check(ok=False, error="the batcher is not running (the service is starting or stopping)"),
                  "store": await _store_check(service.store)}
        ready = all(c.ok for c in checks.values())
        response.status_code = 200 if ready else 503
        return VisionReadiness(ready=ready, checks=checks)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _read(index: int, upload: UploadFile, settings: Settings) -> bytes:
    """The part's bytes; one declared over the limit is refused before it is read."""
    if upload.size is not None and upload.size > settings.max_image_bytes:
        raise ApiError(413, "image_too_large", f"image {index} ({upload.filename}) is {upload.size:,} bytes, over "
                       f"MMRAG_MAX_IMAGE_BYTES ({settings.max_image_bytes:,})",
                       "downscale or recompress it, or raise MMRAG_MAX_IMAGE_BYTES")
    return await upload.read()


def _decode_all(datas: list[bytes], names: list[str | None], settings: Settings) -> list[Image.Image]:
    """In a worker thread: decoding a page takes milliseconds of CPU the event loop must not spend."""
    images = []
    for index, (data, name) in enumerate(zip(datas, names, strict=True)):
        try:
            images.append(decode_image(data, settings))
        except ImageTooLargeError as exc:
            raise ApiError(413, "image_too_large", f"image {index} ({name}): {exc}",
                           "send a smaller image, or raise the limit the message names") from exc
        except IngestError as exc:
            raise ApiError(400, "invalid_image", f"image {index} ({name}): {exc}",
                           "send the image file's own bytes: PNG, JPEG, WebP or TIFF") from exc
    return images


def _describe(entries: list[EncodedEntry]) -> EncodeResponse:
    return EncodeResponse(images=[
        EncodedImageInfo(key=str(e.key), tokens=e.value.num_tokens, grid_thw=e.value.grid_thw.reshape(3).tolist(),
                         source=e.source) for e in entries])


async def _store_check(store: FeatureStore) -> Check:
    if store.backend != "redis":
        return Check(ok=True, detail=f"{store.backend} feature store")
    try:
        await asyncio.wait_for(asyncio.to_thread(store.client.ping), timeout=5)
    except Exception as exc:  # readiness reports any failure as not ready, with its cause
        return Check(ok=False, error=f"{type(exc).__name__}: {exc}")
    return Check(ok=True, detail="redis answers PING")


def encoder_info(encoder: VisionEncoder) -> VisionServiceInfo:
    """GET /v1/info's answer for ``encoder``."""
    return VisionServiceInfo(encoder.version, encoder.policy, encoder.family.model_type, str(encoder.device),
                             str(encoder.dtype).removeprefix("torch."))

