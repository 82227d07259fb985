"""The vision service's wire format, and :class:`RemoteVisionEncoder`: the in-process encoder's interface over HTTP.

`mmrag vision serve` (serving/vision/) holds the tower on its own device; ingestion and the REST app call it
through this client when MMRAG_VISION_URL is set. Pages travel as PNG (lossless, so the service hashes the same
pixels into the same ImageKey) and tokens come back as one safetensors blob, one tensor per image, never base64
inside JSON. Both sides use :func:`pack_tokens` / :func:`unpack_tokens`, so the format is defined once. A service
guarded by MMRAG_VISION_API_KEY is sent that key (``api_key``) as `Authorization: Bearer <key>` on every call.
"""

from __future__ import annotations

import io
import json
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import safetensors.torch
import torch
from PIL import Image

from mmrag.adapters.store import FeatureStoreError
from mmrag.core.keys import ContentHash, EncoderVersion, ImageKey, ResolutionPolicy, content_hash_of
from mmrag.core.pages import EncodedImage

log = logging.getLogger(__name__)

TOKENS_MEDIA_TYPE = "application/octet-stream"
_IMAGES_META = "mmrag_images"


class VisionServiceError(FeatureStoreError):
    """The vision service cannot make image tokens: unreachable, or it refused the request. A FeatureStoreError
    (the service produces the store's entries), so ingestion fails the file it was encoding and the REST app
    answers 503; the message names MMRAG_VISION_URL and the fix."""


@dataclass(frozen=True, slots=True)
class VisionServiceInfo:
    """GET /v1/info: the encoder whose keys the service makes, and where it runs."""

    version: EncoderVersion
    policy: ResolutionPolicy
    family: str
    device: str
    dtype: str

    def to_json(self) -> dict:
        # The whole policy, pooling included: it is part of every key the service makes (-pool2), so a client
        # that dropped it would key pages under a policy the service never encodes.
        policy = {"min_pixels": self.policy.min_pixels, "max_pixels": self.policy.max_pixels, "pool": self.policy.pool}
        return {"encoder_version": self.version, "policy": policy, "family": self.family, "device": self.device,
                "dtype": self.dtype}

    @classmethod
    def of_json(cls, body: dict) -> VisionServiceInfo:
        # A service from before pooling existed sends no "pool": it encoded unpooled.
        policy = ResolutionPolicy(body["policy"]["min_pixels"], body["policy"]["max_pixels"],
                                  body["policy"].get("pool", 1))
        return cls(EncoderVersion(body["encoder_version"]), policy, body["family"], body["device"], body["dtype"])


@dataclass(frozen=True, slots=True)
class EncodedEntry:
    """One image of an encode answer: its key, tokens, and whether the service ran a forward for it."""

    key: ImageKey
    value: EncodedImage
    source: str  # forward | store | shared (another caller's forward of the same key)


def pack_tokens(entries: list[EncodedEntry]) -> bytes:
    """safetensors: tensor ``str(i)`` holds image i's tokens; the header metadata its key, grid and source."""
    meta = [{"key": str(e.key), "grid_thw": e.value.grid_thw.reshape(3).tolist(), "source": e.source} for e in entries]
    tensors = {str(i): e.value.image_tokens.contiguous() for i, e in enumerate(entries)}
    return safetensors.torch.save(tensors, metadata={_IMAGES_META: json.dumps(meta)})


def unpack_tokens(blob: bytes) -> list[EncodedEntry]:
    """Inverse of :func:`pack_tokens`."""
    tensors = safetensors.torch.load(blob)
    (header_len,) = struct.unpack("<Q", blob[:8])  # safetensors.torch.load drops the metadata: read the header
    meta = json.loads(json.loads(blob[8 : 8 + header_len])["__metadata__"][_IMAGES_META])
    return [EncodedEntry(ImageKey.parse(m["key"]), EncodedImage(tensors[str(i)], torch.tensor([m["grid_thw"]])),
                         m["source"]) for i, m in enumerate(meta)]


def png_bytes(image: Image.Image) -> bytes:
    """Lossless, and fast to write (compress level 1: a page is sent once, over a fast link)."""
    out = io.BytesIO()
    image.save(out, format="PNG", compress_level=1)
    return out.getvalue()


class RemoteVisionEncoder:
    """:class:`mmrag.adapters.vision.VisionEncoder`'s interface, served by `mmrag vision serve` at ``url``.

    ``version`` and ``policy`` are the service's (GET /v1/info, at construction), so keys made here are the
    keys the service stores under. ``forwards`` counts the images the service ran its tower for on this
    client's behalf (not store hits nor forwards shared with another caller). ``api_key``: the service's
    MMRAG_VISION_API_KEY (empty: none sent).
    """

    def __init__(self, url: str, *, api_key: str = "", timeout_s: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self._api_key = api_key
        self._timeout_s = timeout_s
        self._http = _client(self.url, api_key, timeout_s)
        try:
            self.info = _fetch_info(self.url, self._http)
        except VisionServiceError:
            self._http.close()
            raise
        self.version, self.policy = self.info.version, self.info.policy
        self.forwards = 0
        self._token_counts: dict[tuple[int, int], int] = {}

    def key_for(self, content_hash: ContentHash) -> ImageKey:
        return ImageKey(content_hash, self.version, self.policy)

    def view(self) -> RemoteVisionEncoder:
        """A client of the same service with a forward count (and connection pool) of its own: what
        ``VisionEncoder.view`` is for the tower in this process."""
        return RemoteVisionEncoder(self.url, api_key=self._api_key, timeout_s=self._timeout_s)

    def num_tokens_for(self, image: Image.Image) -> int:
        """Asked of the service once per image size, then cached: the count is its processor's resize rule, so
        it cannot disagree with the tokens it makes, and this host needs no checkpoint for it. Pages of a PDF
        share a size, so a whole corpus costs a few round trips."""
        size = image.size
        if size not in self._token_counts:
            answer = self._call("GET /v1/tokens", lambda: self._http.get(
                "/v1/tokens", params={"width": size[0], "height": size[1]}))
            self._token_counts[size] = int(answer.json()["tokens"])
        return self._token_counts[size]

    def encode(self, images: list[Image.Image]) -> list[EncodedImage]:
        """One request for all ``images`` (the service may batch them with other callers' images)."""
        if not images:
            return []
        files = [("images", (f"{i}.png", png_bytes(im), "image/png")) for i, im in enumerate(images)]
        answer = self._call("POST /v1/encode", lambda: self._http.post(
            "/v1/encode", files=files, headers={"Accept": TOKENS_MEDIA_TYPE}))
        entries = unpack_tokens(answer.content)
        for image, entry in zip(images, entries, strict=True):
            expected = self.key_for(content_hash_of(image.mode, image.size, image.tobytes()))
            if entry.key != expected:
                raise VisionServiceError(
                    f"the vision service at {self.url} answered {entry.key} for an image whose key here is "
                    f"{expected}; it decodes images differently from this host: run both from the same mmrag version"
                )
            self._token_counts[image.size] = entry.value.num_tokens
        self.forwards += sum(e.source == "forward" for e in entries)
        return [e.value for e in entries]

    def close(self) -> None:
        self._http.close()

    def _call(self, what: str, send: Callable[[], httpx.Response]) -> httpx.Response:
        return _call(self.url, what, send)


def service_info(url: str, *, api_key: str = "", timeout_s: float = 10.0) -> VisionServiceInfo:
    """The service's encoder (GET /v1/info): the keys it makes, hence the tokens an API host may serve."""
    with _client(url.rstrip("/"), api_key, timeout_s) as http:
        return _fetch_info(url.rstrip("/"), http)


def _client(url: str, api_key: str, timeout_s: float) -> httpx.Client:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=url, timeout=timeout_s, headers=headers)


def _fetch_info(url: str, http: httpx.Client) -> VisionServiceInfo:
    return VisionServiceInfo.of_json(_call(url, "GET /v1/info", lambda: http.get("/v1/info")).json())


def _call(url: str, what: str, send: Callable[[], httpx.Response]) -> httpx.Response:
    """One request; an unreachable service or an error answer becomes a VisionServiceError with the cause (the
    service's own error message when it sent one)."""
    try:
        answer = send()
    except httpx.HTTPError as exc:
        raise VisionServiceError(
            f"the vision service at {url} is unreachable ({what}: {type(exc).__name__}: {exc}). Start it "
            "(`mmrag vision serve`) or fix MMRAG_VISION_URL (unset it to encode in this process), then retry"
        ) from exc
    if answer.is_success:
        return answer
    raise VisionServiceError(f"the vision service at {url} refused {what}: HTTP {answer.status_code}: "
                             f"{_error_text(answer)}")


def _error_text(answer: httpx.Response) -> str:
    try:
        error = answer.json()["error"]
        return f"{error['message']}" + (f"; {error['fix']}" if error.get("fix") else "")
    except (ValueError, KeyError, TypeError):
        return answer.text[:500]
