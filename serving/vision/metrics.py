"""The vision service's Prometheus names (prefix ``mmrag_vision_``), on the service's own registry.

Counters are in images and bytes; rates (forwards/s, the store hit ratio) are left to PromQL.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from serving.vision.batcher import Source

FORWARDS = "mmrag_vision_forwards"  # images run through the tower
BATCH_SIZE = "mmrag_vision_batch_size"
QUEUE_WAIT = "mmrag_vision_queue_wait_seconds"
IMAGES = "mmrag_vision_images"  # answered images, by source: forward | store | shared
QUEUED = "mmrag_vision_queued_images"
REFUSED = "mmrag_vision_refused_images"  # 429: the queue was full
PIXELS_IN_FLIGHT = "mmrag_vision_pixels_in_flight"  # declared pixels of admitted images not yet answered
REFUSED_PIXELS = "mmrag_vision_pixel_refusals"  # requests refused for their images' pixels, by kind
BYTES_IN = "mmrag_vision_bytes_in"
BYTES_OUT = "mmrag_vision_bytes_out"
ENCODER = "mmrag_vision_encoder"  # info: the sample is mmrag_vision_encoder_info

_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8)


class VisionMetrics:
    """Observes the batcher (serving/vision/batcher.py BatchObserver) and the endpoints."""

    def __init__(self, info: dict[str, str]) -> None:
        self.registry = r = CollectorRegistry()
        self._forwards = Counter(FORWARDS, "Images run through the vision tower.", registry=r)
        self._batch = Histogram(BATCH_SIZE, "Images per forward of the tower.", buckets=_BATCH_BUCKETS, registry=r)
        self._wait = Histogram(QUEUE_WAIT, "Time an image waited in the queue before its forward started.",
                               buckets=_WAIT_BUCKETS, registry=r)
        self._images = Counter(IMAGES, "Images answered, by where their tokens came from: forward (encoded for "
                               "this request), store (already stored), shared (another request's forward).",
                               ["source"], registry=r)
        for source in Source:
            self._images.labels(source.value)
        self.queued = Gauge(QUEUED, "Images admitted and waiting for (or in) a forward.", registry=r)
        self._refused = Counter(REFUSED, "Images refused with 429 because the queue was full.", registry=r)
        self.pixels_in_flight = Gauge(PIXELS_IN_FLIGHT, "Pixels (declared by image headers) of admitted images not "
                                      "yet answered: what MMRAG_MAX_PIXELS_IN_FLIGHT bounds.", registry=r)
        self._refused_pixels = Counter(REFUSED_PIXELS, "Requests refused for their images' declared pixels: "
                                       "too_many_pixels (413, MMRAG_MAX_REQUEST_PIXELS) or pixels_in_flight (429, "
                                       "MMRAG_MAX_PIXELS_IN_FLIGHT).", ["kind"], registry=r)
        for kind in ("too_many_pixels", "pixels_in_flight"):
            self._refused_pixels.labels(kind)
        self._bytes_in = Counter(BYTES_IN, "Image bytes received.", registry=r)
        self._bytes_out = Counter(BYTES_OUT, "Response body bytes sent by /v1/encode.", registry=r)
        Info(ENCODER, "The encoder whose keys this service makes.", registry=r).info(info)

    def batch(self, size: int, waits_s: list[float]) -> None:
        self._forwards.inc(size)
        self._batch.observe(size)
        for wait in waits_s:
            self._wait.observe(wait)

    def answered(self, sources: list[Source]) -> None:
        for source in sources:
            self._images.labels(source.value).inc()

    def refused(self, images: int) -> None:
        self._refused.inc(images)

    def refused_pixels(self, kind: str) -> None:
        self._refused_pixels.labels(kind).inc()

    def transferred(self, bytes_in: int, bytes_out: int) -> None:
        self._bytes_in.inc(bytes_in)
        self._bytes_out.inc(bytes_out)
