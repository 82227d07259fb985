"""Decoded pixels a process holds: a bound per request and a budget for all requests at once, admitted from the
pixels images declare in their headers, before any is decoded.

An image's file size says little about its memory: a one-colour 7000x7000 PNG is 160 KB of file and 147 MB of
RGB (3 bytes a pixel; at peak about 7 while it is decoded, hashed and preprocessed). So the vision service
(serving/vision/app.py) and question images (serving/api/services.py QuestionImages) read each image's size
from its header (ingestion/loaders.image_header_size) and admit the request's pixels here:

* over MMRAG_MAX_REQUEST_PIXELS (or over the whole budget) it is refused with :class:`TooManyPixelsError`: no
  retry can help (the HTTP layers answer 413);
* over what MMRAG_MAX_PIXELS_IN_FLIGHT has left it is refused with :class:`PixelsInFlightError`: it fits once
  others end (429 with Retry-After).

Nothing here speaks HTTP: the errors are this room's, and serving/http/errors.py maps them to their status.

An admitted request holds its pixels until each image's encode is done, then gives them back image by image
(:meth:`PixelHold.release`); whatever it still holds when it ends (an error, a client that left) goes back then.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import threading
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

# After a request that held this many pixels, the freed heap is handed back to the OS (return_freed_memory).
TRIM_AFTER_PIXELS = 10_000_000


class PixelBudget:
    """At most ``capacity`` pixels held at once, process-wide. Thread-safe: question images are decoded in
    worker threads, the vision service admits on its event loop."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"MMRAG_MAX_PIXELS_IN_FLIGHT must be at least 1, not {capacity}")
        self.capacity = capacity
        self.held = 0
        self._lock = threading.Lock()

    def try_hold(self, pixels: int) -> PixelHold | None:
        """A hold of ``pixels``, or None when they do not fit in what is left now."""
        with self._lock:
            if self.held + pixels > self.capacity:
                return None
            self.held += pixels
        return PixelHold(self, pixels)

    def _give_back(self, pixels: int) -> None:
        with self._lock:
            self.held -= pixels


class PixelHold:
    """One request's pixels: given back image by image (:meth:`release`), the rest when it closes."""

    def __init__(self, budget: PixelBudget, pixels: int) -> None:
        self._budget = budget
        self.pixels = pixels  # at admission: what close() measures the request by
        self.left = pixels

    def release(self, pixels: int) -> None:
        pixels = min(pixels, self.left)
        self.left -= pixels
        self._budget._give_back(pixels)

    def close(self) -> None:
        self.release(self.left)

    def __enter__(self) -> PixelHold:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class PixelsRefusedError(Exception):
    """A request whose images' pixels this process will not decode: ``kind`` names why (the API's error type),
    ``fix`` says what to do."""

    kind = "pixels_refused"

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


class TooManyPixelsError(PixelsRefusedError):
    """More pixels than one request may ever decode here: no retry helps."""

    kind = "too_many_pixels"


class PixelsInFlightError(PixelsRefusedError):
    """More pixels than the budget has left now: the request fits once others end, after ``retry_after_s``."""

    kind = "pixels_in_flight"

    def __init__(self, message: str, fix: str, retry_after_s: int) -> None:
        super().__init__(message, fix)
        self.retry_after_s = retry_after_s


def admit(budget: PixelBudget, sizes: Sequence[tuple[int, int]], *, request_limit: int,
          retry_after_s: Callable[[], int]) -> PixelHold:
    """A hold of the pixels the images of ``sizes`` (width, height, from their headers) declare. Refused with
    TooManyPixelsError over the request bound (or over the whole budget), PixelsInFlightError (``retry_after_s()``
    seconds to wait) when the budget has not that much left now."""
    pixels = sum(w * h for w, h in sizes)
    what = f"the {len(sizes)} image{'s' if len(sizes) != 1 else ''} of this request declare {pixels:,} pixels"
    if pixels > min(request_limit, budget.capacity):
        setting, limit = (("MMRAG_MAX_REQUEST_PIXELS", request_limit) if request_limit <= budget.capacity
                          else ("MMRAG_MAX_PIXELS_IN_FLIGHT", budget.capacity))
        raise TooManyPixelsError(f"{what}, over the limit of {limit:,} ({setting}); decoded they would take about "
                                 f"{3 * pixels / 2**20:,.0f} MiB", "send fewer or smaller (downscaled) images per "
                                 f"request, or raise {setting} if the host has the memory")
    hold = budget.try_hold(pixels)
    if hold is None:
        retry = retry_after_s()
        raise PixelsInFlightError(f"{what}; {budget.held:,} of the {budget.capacity:,} pixels this process "
                                  "decodes at once (MMRAG_MAX_PIXELS_IN_FLIGHT) are held by requests in progress",
                                  f"retry after the Retry-After seconds ({retry}); operators: raise "
                                  "MMRAG_MAX_PIXELS_IN_FLIGHT if the host has the memory (at peak about 7 bytes a "
                                  "pixel: the decoded RGB and the preprocessor's copies)", retry)
    return hold


def return_freed_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim(0)``); a no-op elsewhere.

    Decoded images are allocated in 16 MiB blocks (Pillow) and numpy arrays; once the first such block is freed,
    glibc raises its mmap threshold, so later ones come from the heap and stay in the process's RSS after they are
    freed. Call it in a worker thread (it walks the heap) after a request that held many pixels."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None  # CDLL: the call releases the GIL
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        log.debug("malloc_trim is not available: freed memory stays with the allocator")
        return None
