"""`mmrag vision serve`: the vision tower + projector as a service of its own, on its own device.

POST /v1/encode takes image bytes (multipart, one or more ``images`` parts; PNG for rendered pages, which keeps
them lossless) and answers, per image, its ImageKey, token count and grid; the tokens go to the shared
feature store under that key. With ``Accept: application/octet-stream`` (or ``?tokens=true``) the answer is
the tokens themselves, one safetensors blob (mmrag/adapters/vision_client.py pack_tokens). Images are decoded with
ingestion's defences and hashed as ingestion hashes a page, so a page gets the same key either way.
Built by mmrag/wiring/ ``vision_app``; the batching lives in serving/vision/batcher.py.

Memory is bounded by configuration, not by the client (issue 24): a request is admitted by the pixels its images
declare in their headers before any is decoded (serving/pixels.py: 413 over MMRAG_MAX_REQUEST_PIXELS, 429 over
what MMRAG_MAX_PIXELS_IN_FLIGHT has left); its images are then decoded one at a time for their keys, and again
just before their forward. With MMRAG_VISION_API_KEY every route but /healthz, /readyz and /metrics asks for
`Authorization: Bearer <key>`, checked before the body is read.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, TypeVar

from fastapi import FastAPI, File, Query, Request, Response, UploadFile
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp, Receive, Scope, Send

from mmrag.adapters.store import FeatureStore
from mmrag.adapters.vision import VisionEncoder
from mmrag.adapters.vision_client import TOKENS_MEDIA_TYPE, EncodedEntry, VisionServiceInfo, pack_tokens
from mmrag.core.keys import ImageKey
from mmrag.core.settings import DocumentSettings, VisionServiceSettings
from ingestion.loaders import ImageTooLargeError, IngestError, decode_image, image_content_hash, image_header_size
from serving.http import errors
from serving.http.errors import ApiError
from serving.http.schemas import Check, Health, error_responses
from serving.pixels import TRIM_AFTER_PIXELS, PixelBudget, PixelHold, PixelsRefusedError, admit, return_freed_memory
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
    pixels: PixelBudget | None = None  # None: MMRAG_MAX_PIXELS_IN_FLIGHT's, made by create_vision_app


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
    401: "MMRAG_VISION_API_KEY is set and the request did not send it as `Authorization: Bearer <key>` "
         "(`unauthorized`).",
    413: "An image over MMRAG_MAX_IMAGE_BYTES or MMRAG_MAX_IMAGE_PIXELS (`image_too_large`), more images than "
         "MMRAG_VISION_QUEUE_CAP in one request (`too_many_images`), or images declaring more pixels than "
         "MMRAG_MAX_REQUEST_PIXELS together (`too_many_pixels`).",
    429: "The queue is full (`vision_queue_full`), or the pixels being decoded and encoded leave no room for this "
         "request's (`pixels_in_flight`, MMRAG_MAX_PIXELS_IN_FLIGHT): retry after the Retry-After seconds.",
    503: "The feature store is unreachable (`feature_store_unavailable`).",
})
_GUARDED = error_responses({
    401: "MMRAG_VISION_API_KEY is set and the request did not send it as `Authorization: Bearer <key>` "
         "(`unauthorized`).",
})
# What answers without the key: probes and Prometheus carry none. /metrics holds counts and the encoder's
# labels (what /v1/info says), never an image, a key or a token, as the REST API's /metrics.
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


def create_vision_app(settings: VisionServiceSettings, service: VisionService) -> FastAPI:
    """The vision service's app over ``service``; ``settings``: its section (Settings.vision_service)."""
    documents = settings.documents

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        service.batcher.start()
        yield
        await service.batcher.close()

    app = FastAPI(title="mmrag vision", version="0.1.0", lifespan=lifespan,
                  description="The vision tower + projector: image bytes in, image tokens (by ImageKey) out.")
    errors.install(app, errors.ServerPaths.of(settings.folders))
    if settings.api_key:
        app.add_middleware(RequireKey, key=settings.api_key)
    batcher, metrics = service.batcher, service.metrics
    pixels = service.pixels or PixelBudget(settings.max_pixels_in_flight)
    metrics.queued.set_function(lambda: batcher.queued)
    metrics.pixels_in_flight.set_function(lambda: pixels.held)

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
        if len(images) > settings.queue_cap:
            raise ApiError(413, "too_many_images", f"{len(images)} images in one request, over the queue's "
                           f"{settings.queue_cap}", "send fewer per request, or raise MMRAG_VISION_QUEUE_CAP")
        datas = [await _read(i, upload, documents) for i, upload in enumerate(images)]
        names = [u.filename for u in images]
        sizes = await asyncio.to_thread(_header_sizes, datas, names, documents)
        try:
            hold = admit(pixels, sizes, request_limit=settings.max_request_pixels,
                         retry_after_s=lambda: batcher.retry_after_s(len(datas)))
        except PixelsRefusedError as exc:  # answered 413 or 429 by the error handlers (serving/http/errors.py)
            metrics.refused_pixels(exc.kind)
            raise
        try:
            entries = await _encode(datas, names, sizes, hold)
        finally:
            hold.close()
            if hold.pixels >= TRIM_AFTER_PIXELS:
                await asyncio.to_thread(return_freed_memory)
        if tokens or TOKENS_MEDIA_TYPE in request.headers.get("accept", ""):
            answer: Response = Response(pack_tokens(entries), media_type=TOKENS_MEDIA_TYPE)
        else:
            answer = Response(_describe(entries).model_dump_json(), media_type="application/json")
        metrics.transferred(sum(map(len, datas)), len(answer.body))
        return answer

    async def _encode(datas: list[bytes], names: list[str | None], sizes: list[tuple[int, int]], hold: PixelHold
                      ) -> list[EncodedEntry]:
        """Each image's key (decoded one at a time, off the loop, its pixels let go), then its tokens from the
        batcher, which decodes it again just before its forward; its pixels go back to the budget once answered."""
        keys = await asyncio.to_thread(_keys_of, service.encoder, datas, names, documents,
                                       trim=hold.pixels >= TRIM_AFTER_PIXELS)
        items = [(key, functools.partial(decode_image, data, documents)) for key, data in zip(keys, datas)]
        try:
            results = await batcher.encode(items, on_answered=lambda i: hold.release(sizes[i][0] * sizes[i][1]))
        except QueueFullError as exc:
            metrics.refused(len(items))
            raise ApiError(429, "vision_queue_full", str(exc), "retry after the Retry-After seconds; for more "
                           "throughput run the service on a GPU or raise MMRAG_VISION_MAX_BATCH",
                           headers={"Retry-After": str(exc.retry_after_s)}) from exc
        return [EncodedEntry(key, value, source.value) for key, (value, source) in zip(keys, results, strict=True)]

    @app.get("/v1/tokens", summary="Image tokens an image of this size takes", response_model=TokenCount,
             responses=_GUARDED)
    async def count(width: Annotated[int, Query(ge=1)], height: Annotated[int, Query(ge=1)]) -> TokenCount:
        if width * height > documents.max_image_pixels:
            raise ApiError(413, "image_too_large", f"{width}x{height} px is over MMRAG_MAX_IMAGE_PIXELS "
                           f"({documents.max_image_pixels:,})", "no image of this size can be encoded here")
        return TokenCount(tokens=service.encoder.num_tokens_for(_Size((width, height))))

    @app.get("/v1/info", summary="The encoder whose keys this service makes", response_model=InfoResponse,
             responses=_GUARDED)
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


async def _read(index: int, upload: UploadFile, documents: DocumentSettings) -> bytes:
    """The part's bytes; one declared over the limit is refused before it is read."""
    if upload.size is not None and upload.size > documents.max_image_bytes:
        raise ApiError(413, "image_too_large", f"image {index} ({upload.filename}) is {upload.size:,} bytes, over "
                       f"MMRAG_MAX_IMAGE_BYTES ({documents.max_image_bytes:,})",
                       "downscale or recompress it, or raise MMRAG_MAX_IMAGE_BYTES")
    return await upload.read()


def _header_sizes(datas: list[bytes], names: list[str | None], documents: DocumentSettings) -> list[tuple[int, int]]:
    """In a worker thread: each image's declared size, its format and limits checked, nothing decoded."""
    return [_checked(index, name, lambda: image_header_size(data, documents))
            for index, (data, name) in enumerate(zip(datas, names, strict=True))]


def _keys_of(encoder: VisionEncoder, datas: list[bytes], names: list[str | None], documents: DocumentSettings, *,
             trim: bool) -> list[ImageKey]:
    """In a worker thread, one image at a time: decoding a page takes milliseconds of CPU the event loop must not
    spend, and only one image's pixels are alive at once (each is dropped once hashed). With ``trim`` the freed
    heap goes back to the OS after: this thread's malloc arena would otherwise keep it while the forward, in
    another thread and arena, decodes the images again (one 7000x7000 image: a peak of +660 MiB with, +660 or
    +1,028 MiB without, as the two threads happen to share an arena or not)."""
    keys = [encoder.key_for(image_content_hash(_checked(index, name, lambda: decode_image(data, documents))))
            for index, (data, name) in enumerate(zip(datas, names, strict=True))]
    if trim:
        return_freed_memory()
    return keys


T = TypeVar("T")


def _checked(index: int, name: str | None, read: Callable[[], T]) -> T:
    """``read()`` of image ``index``, its refusal in the service's error shape."""
    try:
        return read()
    except ImageTooLargeError as exc:
        raise ApiError(413, "image_too_large", f"image {index} ({name}): {exc}",
                       "send a smaller image, or raise the limit the message names") from exc
    except IngestError as exc:
        raise ApiError(400, "invalid_image", f"image {index} ({name}): {exc}",
                       "send the image file's own bytes: PNG, JPEG, WebP or TIFF") from exc


class RequireKey:
    """MMRAG_VISION_API_KEY on every path but :data:`PUBLIC_PATHS`, checked from the headers alone: a request
    without the key is answered 401 before its body (megabytes of images) is read. Constant-time compare."""

    def __init__(self, app: ASGIApp, *, key: str) -> None:
        self.app = app
        self._expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _route_path(scope) in PUBLIC_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = errors.error_body("unauthorized", "missing or wrong key: this vision service is guarded by "
                                 "MMRAG_VISION_API_KEY", "send `Authorization: Bearer <key>`; clients of "
                                 "MMRAG_VISION_URL (mmrag serve, mmrag ingest) send MMRAG_VISION_API_KEY: set it to "
                                 "the service's key")
        await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, credentials = given.partition(b" ")
        # The scheme is case-insensitive (RFC 9110 §11.1); the key is compared in constant time.
        return hmac.compare_digest(b"Bearer " + credentials.strip(), self._expected) and scheme.lower() == b"bearer"


def _route_path(scope: Scope) -> str:
    """The path below the app's mount (Ray Serve serves the app under /vision)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


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

