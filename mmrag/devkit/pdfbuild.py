"""PDF pages built object by object with pdfium: image objects, path objects and standard-font text placed at
known boxes, so that what figure detection and ingestion find can be checked against where things were put.

Shared by the tests (tests/test_figures.py, tests/test_figure_entries.py) and the benchmark's figure corpus
(mmrag/bench/figure_keys.py). Boxes are top-left-origin points, y down, as mmrag.core.figures.FigureRegion reports them.
"""

from __future__ import annotations

import ctypes
import io
import random

import pypdfium2 as pdfium
import pypdfium2.raw as pdfium_c
from PIL import Image

W, H = 612.0, 792.0  # US letter, points


class PageBuilder:
    """Places objects by top-left-origin boxes, as FigureRegion reports them."""

    def __init__(self, width: float = W, height: float = H) -> None:
        self.h = height
        self.pdf = pdfium.PdfDocument.new()
        self.page = self.pdf.new_page(width, height)
        self.font = pdfium_c.FPDFText_LoadStandardFont(self.pdf, b"Helvetica")

    def text(self, x: float, y_top: float, text: str, size: float = 10.0) -> None:
        obj = pdfium_c.FPDFPageObj_NewTextObj(self.pdf, b"Helvetica", ctypes.c_float(size))
        data = (text + "\0").encode("utf-16-le")  # FPDF_WIDESTRING is UTF-16LE, NUL-terminated
        pdfium_c.FPDFText_SetText(obj, ctypes.cast(ctypes.c_char_p(data), pdfium_c.FPDF_WIDESTRING))
        pdfium_c.FPDFPageObj_Transform(obj, 1, 0, 0, 1, x, self.h - y_top - size)
        pdfium_c.FPDFPage_InsertObject(self.page, obj)

    def image(self, box: tuple[float, float, float, float], jpeg_bytes: bytes | None = None) -> None:
        """A JPEG image object filling ``box`` (a flat navy picture unless ``jpeg_bytes`` are given)."""
        x0, y0, x1, y1 = box
        jpeg = io.BytesIO(jpeg_bytes or b"")
        if jpeg_bytes is None:
            Image.new("RGB", (64, 48), "navy").save(jpeg, "JPEG")
        jpeg.seek(0)
        img = pdfium.PdfImage.new(self.pdf)
        img.load_jpeg(jpeg, inline=False, autoclose=False)
        img.set_matrix(pdfium.PdfMatrix().scale(x1 - x0, y1 - y0).translate(x0, self.h - y1))
        self.page.insert_obj(img)

    def rect(self, box: tuple[float, float, float, float], fill: bool = False) -> None:
        x0, y0, x1, y1 = box
        path = pdfium_c.FPDFPageObj_CreateNewRect(x0, self.h - y1, x1 - x0, y1 - y0)
        pdfium_c.FPDFPageObj_SetStrokeColor(path, 0, 0, 0, 255)
        pdfium_c.FPDFPageObj_SetFillColor(path, 120, 120, 200, 255)
        pdfium_c.FPDFPath_SetDrawMode(path, pdfium_c.FPDF_FILLMODE_WINDING if fill else 0, True)
        pdfium_c.FPDFPage_InsertObject(self.page, path)

    def background(self, rgb: tuple[int, int, int]) -> None:
        """A slide's background: the whole page filled with ``rgb``, behind what is placed after it."""
        width = pdfium_c.FPDF_GetPageWidthF(self.page.raw)
        path = pdfium_c.FPDFPageObj_CreateNewRect(0, 0, width, self.h)
        pdfium_c.FPDFPageObj_SetFillColor(path, *rgb, 255)
        pdfium_c.FPDFPath_SetDrawMode(path, pdfium_c.FPDF_FILLMODE_WINDING, False)
        pdfium_c.FPDFPage_InsertObject(self.page, path)

    def line(self, x0: float, y: float, x1: float) -> None:
        path = pdfium_c.FPDFPageObj_CreateNewPath(x0, self.h - y)
        pdfium_c.FPDFPath_LineTo(path, x1, self.h - y)
        pdfium_c.FPDFPageObj_SetStrokeColor(path, 0, 0, 0, 255)
        pdfium_c.FPDFPath_SetDrawMode(path, 0, True)
        pdfium_c.FPDFPage_InsertObject(self.page, path)

    def body(self, y_top: float, lines: int) -> None:
        for k in range(lines):
            self.text(72, y_top + 14 * k, "This is running body text of the page, long enough to be a paragraph line.")

    def chart(self, box: tuple[float, float, float, float]) -> None:
        """A bar chart of many paths: a frame, bars, ticks."""
        x0, y0, x1, y1 = box
        self.rect(box)
        n = 12
        step = (x1 - x0) / n
        for k in range(n):
            top = y0 + 10 + (k * 37 % (y1 - y0 - 20))
            self.rect((x0 + k * step + 3, top, x0 + (k + 1) * step - 3, y1), fill=True)
            self.line(x0 + k * step + step / 2, y1, x0 + k * step + step / 2)  # a zero-length tick mark

    def line_chart(self, box: tuple[float, float, float, float], series: int = 3, points: int = 41) -> None:
        """A line chart: a frame and ``series`` polylines of ``points`` seeded random values each, diagonal edges
        at arbitrary coordinates (where a render's rounding shows, unlike the bar chart's straight ones)."""
        x0, y0, x1, y1 = box
        self.rect(box)
        rng = random.Random(7)
        for k in range(series):
            xs = [x0 + 10 + (x1 - x0 - 20) * i / (points - 1) for i in range(points)]
            ys = [y0 + 20 + (y1 - y0 - 40) * rng.random() for _ in range(points)]
            path = pdfium_c.FPDFPageObj_CreateNewPath(xs[0], self.h - ys[0])
            for x, y in zip(xs[1:], ys[1:]):
                pdfium_c.FPDFPath_LineTo(path, x, self.h - y)
            pdfium_c.FPDFPageObj_SetStrokeColor(path, 40 * k, 0, 200 - 40 * k, 255)
            pdfium_c.FPDFPageObj_SetStrokeWidth(path, ctypes.c_float(0.7))
            pdfium_c.FPDFPath_SetDrawMode(path, 0, True)
            pdfium_c.FPDFPage_InsertObject(self.page, path)

    def form(self, figure_pdf: bytes, at: tuple[float, float], scale: float = 1.0) -> None:
        """The first page of ``figure_pdf`` included as ONE form XObject, its top-left corner at ``at`` (points),
        at ``scale``: what LaTeX's \\includegraphics of a PDF figure writes."""
        figure = pdfium.PdfDocument(figure_pdf)
        form = figure.page_as_xobject(0, self.pdf).as_pageobject()
        height = figure[0].get_size()[1] * scale
        form.set_matrix(pdfium.PdfMatrix().scale(scale, scale).translate(at[0], self.h - at[1] - height))
        self.page.insert_obj(form)

    def open(self) -> pdfium.PdfPage:
        return pdfium.PdfDocument(self.bytes())[0]

    def bytes(self) -> bytes:
        self.page.gen_content()
        out = io.BytesIO()
        self.pdf.save(out)
        return out.getvalue()


def join_pages(documents: list[bytes]) -> bytes:
    """One PDF of the pages of ``documents`` (each a PageBuilder's ``bytes()``), in order."""
    out = pdfium.PdfDocument.new()
    for data in documents:
        out.import_pages(pdfium.PdfDocument(data))
    buf = io.BytesIO()
    out.save(buf)
    return buf.getvalue()


def stored_turned(data: bytes, turn: int) -> bytes:
    """The one page of ``data`` shown the same, but stored turned: its content turned a quarter the other way and
    /Rotate ``turn`` (90 or 270) set, as a landscape page of a portrait document (LaTeX's pdflscape) is stored."""
    pdf = pdfium.PdfDocument(data)
    page = pdf[0]
    width, height = page.get_size()
    m = {90: (0, 1, -1, 0, height, 0), 270: (0, -1, 1, 0, 0, width)}[turn]
    for obj in page.get_objects(max_depth=1):
        obj.transform(pdfium.PdfMatrix(*m))
        pdfium_c.FPDFPageObj_TransformClipPath(obj.raw, *m)
    page.set_mediabox(0, 0, height, width)
    page.set_cropbox(0, 0, height, width)
    page.set_rotation(turn)
    page.gen_content()
    out = io.BytesIO()
    pdf.save(out)
    return out.getvalue()


def shaded_chart(dx: float = 0.0, dy: float = 0.0) -> bytes:
    """A one-page PDF drawing a framed chart: three bars and an axial shading (an ``sh`` operator: a shading
    object, which pdfium's editing API cannot make, so the PDF is written by hand), the whole moved by (dx, dy)."""
    content = (f"q 1 0 0 1 {dx} {dy} cm 0 0 0 RG 100 400 300 200 re S "
               "q 110 410 280 80 re W n /Sh0 sh Q "
               "0.5 0.5 0.8 rg 120 500 40 90 re f 180 500 40 60 re f 240 500 40 80 re f Q").encode()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        b"/Resources << /Shading << /Sh0 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream",
        b"<< /ShadingType 2 /ColorSpace /DeviceRGB /Coords [110 0 390 0] /Extend [true true] "
        b"/Function << /FunctionType 2 /Domain [0 1] /C0 [1 0 0] /C1 [0 0 1] /N 1 >> >>",
    ]
    out, offsets = b"%PDF-1.4\n", []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    return out + b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
