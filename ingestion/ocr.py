"""OCR behind one small function, so the engine can be swapped (tesseract today).

Tesseract is run as a subprocess directly rather than through pytesseract: it must see
``OMP_THREAD_LIMIT=1`` (without it, its OpenMP threads thrash on small machines: ~6 s a page instead of
~0.9 s on 2 cores), and pytesseract hands the child ``os.environ`` itself, so the only way to set the
variable through it is to set it for the whole process. That also caps the OpenMP pool of torch when torch
is imported later in the same process (measured: a 2000x2000 matmul went from 0.41 s to 0.97 s). Here the
limit goes into the child's environment only.
"""

from __future__ import annotations

import functools
import io
import os
import shutil
import subprocess

from PIL import Image

TESSERACT = "tesseract"
OCR_TIMEOUT_S = 120.0  # a pathological page must not stall a whole ingest run


class OcrError(RuntimeError):
    """Tesseract is installed but failed on an image; the loader names the page and the fix."""


def ocr_available() -> bool:
    """Whether the tesseract binary is on PATH."""
    return shutil.which(TESSERACT) is not None


def missing_languages(lang: str) -> list[str]:
    """The parts of a tesseract language spec (``"eng+deu"``) whose trained data is not installed."""
    installed = _installed_languages(_tesseract_path())
    return [code for code in lang.split("+") if code and code not in installed]


def ocr_image(img: Image.Image, lang: str, *, dpi: float | None = None, timeout_s: float = OCR_TIMEOUT_S) -> str:
    """The text tesseract reads in ``img`` (raw, not whitespace-normalised).

    ``dpi`` is the image's resolution when known (a rendered PDF page); tesseract scales its
    expectations of glyph size with it and otherwise guesses.
    """
    cmd = [_tesseract_path(), "stdin", "stdout", "-l", lang]
    if dpi:
        cmd += ["--dpi", str(round(dpi))]
    try:
        proc = subprocess.run(
            cmd, input=_as_ppm(img), capture_output=True, timeout=timeout_s, env=_tesseract_env(), check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise OcrError(f"tesseract took longer than {timeout_s:.0f} s") from exc
    except OSError as exc:
        raise OcrError(f"tesseract could not be started: {exc}") from exc
    if proc.returncode != 0:
        stderr = proc.stderr.decode("utf-8", errors="replace").strip()
        raise OcrError(f"tesseract exited with status {proc.returncode}: {stderr[-500:]}")
    return proc.stdout.decode("utf-8", errors="replace")


def _tesseract_path() -> str:
    path = shutil.which(TESSERACT)
    if path is None:
        raise OcrError("tesseract is not on PATH")
    return path


def _tesseract_env() -> dict[str, str]:
    # The child's environment only: see the module docstring for why not os.environ.
    return {**os.environ, "OMP_THREAD_LIMIT": "1"}


def _as_ppm(img: Image.Image) -> bytes:
    # Uncompressed PPM/PGM: nothing to encode or decode on either side of the pipe, and leptonica
    # reads it from stdin. Anything other than RGB/L is converted first (PPM holds no alpha).
    if img.mode not in ("RGB", "L"):
        img = img.convert("RGB")
    buf = io.BytesIO()
    img.save(buf, format="PPM")
    return buf.getvalue()


@functools.cache
def _installed_languages(tesseract: str) -> frozenset[str]:
    # Cached per binary: an ingest run opens many documents and the answer does not change under it.
    try:
        proc = subprocess.run(
            [tesseract, "--list-langs"], capture_output=True, text=True, timeout=30, env=_tesseract_env(), check=True
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise OcrError(f"`tesseract --list-langs` failed: {exc}") from exc
    # The first line is a header: List of available languages in "/usr/share/tesseract-ocr/5/tessdata/" (2):
    return frozenset(line.strip() for line in proc.stdout.splitlines()[1:] if line.strip())
