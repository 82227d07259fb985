"""Rasters past the vision processor's aspect ratio (ingestion/raster.py): fitted, never changed otherwise, and
bounded before any pixel is made. The processor itself (transformers' smart_resize, which vLLM's pixel path runs
too) is the judge of what it takes."""

from __future__ import annotations

import io

import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

from mmrag.core.settings import Settings
from ingestion.loaders import ImageTooLargeError, decode_image, image_header_size
from ingestion.raster import MAX_ASPECT, fit_aspect, fitted_size


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize("size, fitted", [((10_000, 1), (10_000, 50)), ((1, 10_000), (50, 10_000)),
                                          ((20_001, 2), (20_001, 101)), ((400, 2), (400, 2)), ((5, 7), (5, 7))])
def test_only_a_raster_the_processor_refuses_is_padded_to_the_ratio_it_takes(size, fitted):
    assert fitted_size(*size) == fitted
    h, w = fitted[1], fitted[0]
    assert max(h, w) / min(h, w) <= MAX_ASPECT
    smart_resize(h, w, factor=28, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)  # the processor takes it
    if fitted != size:
        with pytest.raises(ValueError, match="aspect ratio"):
            smart_resize(size[1], size[0], factor=28, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)


def test_fitting_keeps_the_picture_at_the_top_left_on_white_and_leaves_others_as_they_are():
    line = Image.new("RGB", (1000, 2), (10, 20, 30))
    fitted = fit_aspect(line)
    assert fitted.size == (1000, 5) and fitted.mode == "RGB"
    assert fitted.getpixel((999, 1)) == (10, 20, 30) and fitted.getpixel((999, 2)) == (255, 255, 255)
    square = Image.new("RGB", (30, 30))
    assert fit_aspect(square) is square  # within the ratio: the same raster, so the same key as before


def test_a_decoded_image_is_fitted_and_one_whose_padding_would_pass_the_pixel_bound_is_refused_first():
    settings = Settings(max_image_pixels=100_000)
    assert decode_image(png(Image.new("RGB", (4000, 1), "black")), settings.documents).size == (4000, 20)
    wide = png(Image.new("L", (6000, 1)))  # 6,000 pixels, padded 6000 x 30 = 180,000
    with pytest.raises(ImageTooLargeError, match="aspect ratio over 200:1.*cut it into parts"):
        image_header_size(wide, settings.documents)
    with pytest.raises(ImageTooLargeError, match="padded to 6000x30 px"):
        decode_image(wide, settings.documents)
