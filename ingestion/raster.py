"""Rasters the vision processor can take: an image whose sides differ by more than it accepts is fitted.

Qwen2-VL's processor (and vLLM's pixel path, which runs the same one) refuses an image whose long side is over
``MAX_ASPECT`` times its short one (``smart_resize``: "absolute aspect ratio must be smaller than 200"). A long
receipt, a wide banner, a one-pixel rule or a 14400 x 30 pt PDF page would then fail whole, and with it every
question about it. Such a raster is fitted instead: its short side padded with white to ``long / MAX_ASPECT``
(rounded up), the picture at the top left, so the processor takes it and the page can be asked about (at the
resolution the processor's pixel bound leaves it: a very long page reads small).

Only rasters that no processor could take are changed: an image within the ratio is returned as it is, so no key
made before this existed changes (a key's content hash is of the fitted raster, and the fitting is the same on
every host). Padding costs pixels: the fitted size is checked against MMRAG_MAX_IMAGE_PIXELS before any pixel is
made (:func:`fitted_size`), so a 1 x 50,000,000 line cannot become a bomb.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from PIL import Image

MAX_ASPECT = 200  # the processor's own bound (transformers' smart_resize): long side / short side, at most
_WHITE = (255, 255, 255)


def fitted_size(width: int, height: int) -> tuple[int, int]:
    """The (width, height) :func:`fit_aspect` makes of a ``width`` x ``height`` raster."""
    if width >= height:
        return width, max(height, math.ceil(width / MAX_ASPECT))
    return max(width, math.ceil(height / MAX_ASPECT)), height


def fit_aspect(image: Image.Image) -> Image.Image:
    """``image`` itself when the processor takes its aspect ratio, else a copy padded with white on its short side
    to :func:`fitted_size` (an RGB raster stays RGB)."""
    size = fitted_size(*image.size)
    if size == image.size:
        return image
    from PIL import Image

    fitted = Image.new(image.mode, size, _WHITE if image.mode == "RGB" else 255)
    fitted.paste(image, (0, 0))
    return fitted
