"""Figure regions of a PDF page, found from the page's own structure (no layout model).

What a page is made of tells where its figures are:

* an image object is a picture (a screenshot, a photo, a raster plot), unless it is tiny (an icon, a bullet)
  or covers the page (a scanned page: the page itself, not a figure on it);
* a form XObject holding paths or images is an included graphic (asymptote.pdf includes each figure so);
* path and shading objects that lie close together are one vector drawing (a plot, a mosaic, a table's rules);
  what is thin (a header rule, an underline) is not a figure. Short text lines next to a drawing are its
  labels (tick labels, a legend) and join it;
* a caption line ("Figure 3: ...", "Table 2", parsed by ``mmrag.core.figures.captions``) names the regions right above
  or below it; several regions named by one caption are the panels of one figure and become one region.

Overlapping regions are merged and the result sorted in reading order. A pure function of a page: it reads
the page's objects and text, renders nothing. About 1-3 ms a page on the realdocs PDFs (mmrag/bench/figures).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pypdfium2 as pdfium
import pypdfium2.raw as pdfium_c
from PIL import Image

from mmrag.core.figures import Box, FigureRegion, area, captions, intersection, iou, region_name, union_box
from mmrag.core.keys import content_hash_of
from mmrag.core.pages import FigureCrop
from ingestion.raster import fit_aspect, fitted_size

log = logging.getLogger(__name__)

# --- what counts -------------------------------------------------------------------------------------------

GAP_PT = 4.0  # paths this close belong to one drawing
THIN_PT = 6.0  # a drawing thinner than this is a rule or an underline
MIN_SIDE_PT = 20.0  # smaller vector drawings are marks (bullets, boxes around a word)
MIN_AREA_SHARE = 0.004  # ... and so are drawings under this share of the page
MIN_IMAGE_SIDE_PT = 40.0  # images smaller than this on a side, or under 1.5 % of the page, are icons
MIN_IMAGE_SHARE = 0.015
PAGE_SHARE = 0.85  # an image or path covering this much of the page is the page (a scan, a background)
LABEL_GAP_PT = 6.0  # a short text line this close to a drawing is one of its labels
CAPTION_GAP_PT = 30.0  # a caption this close above or below a region names it
PANEL_GAP_PT = 24.0  # drawings this close, with nothing between them, are panels of one figure
_LINE_JOIN_PT = 12.0  # text rectangles on one baseline closer than this are one line

_GRAPHIC = (pdfium_c.FPDF_PAGEOBJ_PATH, pdfium_c.FPDF_PAGEOBJ_SHADING)


@dataclass(slots=True)
class _Line:
    box: Box
    text: str


@dataclass(slots=True)
class _Region:
    box: Box
    source: str
    caption: str = ""
    kind: str = ""
    number: str | None = None


# The figure step's bounds on one page (issue 41): a page of more drawing objects than this (a content stream of
# 200,000 tiny paths took 7 s a page to walk and cluster) or past its time budget keeps its image and text, its
# figures skipped and reported. Ordinary pages hold tens to a few thousand objects.
MAX_PAGE_OBJECTS = 20_000
PAGE_FIGURE_BUDGET_S = 2.0


class FigureBudgetError(Exception):
    """The page is over the figure step's object count or time budget: its figures are skipped (why in str)."""


def detect_figures(page: pdfium.PdfPage, *, textpage: pdfium.PdfTextPage | None = None,
                   max_objects: int | None = None, budget_s: float | None = None) -> list[FigureRegion]:
    """The figure regions of ``page``, in reading order, boxes in points with a top-left origin.
    :class:`FigureBudgetError` when the page holds over ``max_objects`` objects (counted before any is
    measured; MAX_PAGE_OBJECTS) or the walk takes over ``budget_s`` (PAGE_FIGURE_BUDGET_S)."""
    started = time.monotonic()
    max_objects = max_objects or MAX_PAGE_OBJECTS
    budget_s = budget_s or PAGE_FIGURE_BUDGET_S
    count = pdfium_c.FPDFPage_CountObjects(page.raw)  # the page's own objects, read without walking them
    if count > max_objects:
        raise FigureBudgetError(f"{count} drawing objects, over {max_objects}")
    view = _View.of(page)
    width, height = view.size
    page_area = width * height
    textpage = textpage or page.get_textpage()

    def flip(bounds: tuple[float, float, float, float]) -> Box:
        x0, y0, x1, y1 = view.box(bounds)
        return (max(0.0, x0), max(0.0, y0), min(width, x1), min(height, y1))

    images: list[Box] = []
    forms: list[Box] = []
    graphics: list[Box] = []
    for seen, obj in enumerate(page.get_objects(max_depth=1), 1):
        if seen > max_objects:
            raise FigureBudgetError(f"over {max_objects} drawing objects")
        if seen % 1024 == 0 and time.monotonic() - started > budget_s:
            raise FigureBudgetError(f"walking its objects took over {budget_s:g} s")
        kind = obj.type
        if kind == pdfium_c.FPDF_PAGEOBJ_FORM:
            box = _form_box(page, obj)
            if box is not None:
                forms.append(flip(box))
        elif kind == pdfium_c.FPDF_PAGEOBJ_IMAGE:
            images.append(flip(obj.get_bounds()))
        elif kind in _GRAPHIC:
            graphics.append(flip(obj.get_bounds()))

    lines = _text_lines(textpage, view)
    regions: list[_Region] = []
    for box in images:
        w, h = box[2] - box[0], box[3] - box[1]
        if min(w, h) < MIN_IMAGE_SIDE_PT or area(box) < MIN_IMAGE_SHARE * page_area:
            continue
        if area(box) >= PAGE_SHARE * page_area:
            continue  # a scanned page or a background: the page itself
        regions.append(_Region(box, "raster"))
    for box in forms:
        if _is_figure_sized(box, page_area) and area(box) < PAGE_SHARE * page_area:
            regions.append(_Region(box, "form"))
    graphics = [b for b in graphics if area(b) < PAGE_SHARE * page_area]
    if time.monotonic() - started > budget_s:
        raise FigureBudgetError(f"walking its objects took over {budget_s:g} s")
    for box in _cluster(graphics, GAP_PT, deadline=started + budget_s):
        if min(box[2] - box[0], box[3] - box[1]) < THIN_PT or not _is_figure_sized(box, page_area):
            continue
        regions.append(_Region(box, "vector"))

    regions = [r for r in regions if not _is_page_band(r.box, width, height)]
    caption_lines = _caption_lines(lines)
    regions = _merge_overlapping(regions)
    regions = [_with_labels(r, lines, caption_lines) for r in regions]
    regions = _merge_panels(regions, lines, caption_lines)
    regions = _attach_captions(regions, caption_lines, [l.box for l in lines if _is_body(l)])
    return [_finish(r) for r in _reading_order(regions)]


def _form_box(page: pdfium.PdfPage, form: pdfium.PdfObject) -> tuple[float, float, float, float] | None:
    """A form's drawn extent in page space (PDF coordinates), or None when it holds no paths or images.

    Its own bounds also cover what its clipping hides (asymptote.pdf p.165: a clipped image reaching far past
    the plot), so the extent is that of its paths and text, mapped through the form's matrix; a form of
    images only keeps its bounds."""
    graphic = False
    drawn: tuple[float, float, float, float] | None = None
    for child in page.get_objects(form=form, level=1, max_depth=2):
        if child.type in (*_GRAPHIC, pdfium_c.FPDF_PAGEOBJ_IMAGE):
            graphic = True
        if child.type in (pdfium_c.FPDF_PAGEOBJ_PATH, pdfium_c.FPDF_PAGEOBJ_TEXT):
            b = child.get_bounds()
            drawn = b if drawn is None else union_box(drawn, b)
    if not graphic:
        return None
    bounds = form.get_bounds()
    a, b, c, d, e, f = form.get_matrix().get()
    if drawn is None or b or c:  # images only, or a rotated form: its bounds
        return bounds
    xs = (a * drawn[0] + e, a * drawn[2] + e)
    ys = (d * drawn[1] + f, d * drawn[3] + f)
    box = (max(min(xs), bounds[0]), max(min(ys), bounds[1]), min(max(xs), bounds[2]), min(max(ys), bounds[3]))
    return box if box[0] < box[2] and box[1] < box[3] else bounds


def _is_page_band(box: Box, width: float, height: float) -> bool:
    """A band across the page at its top or bottom edge: a slide's title bar or footer, a running head."""
    across = box[2] - box[0] >= 0.9 * width
    return across and (box[1] <= 2.0 or box[3] >= height - 2.0) and box[3] - box[1] < 0.2 * height


def _is_figure_sized(box: Box, page_area: float) -> bool:
    w, h = box[2] - box[0], box[3] - box[1]
    return min(w, h) >= MIN_SIDE_PT and w * h >= MIN_AREA_SHARE * page_area


# --- text ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _View:
    """A page as it is shown: its crop box, turned by its /Rotate. ``box`` maps pdfium's (left, bottom, right, top)
    in PDF space (objects' bounds, text rectangles) to points with a top-left origin on the page as rendered, which
    FigureRegion reports and the page's image shows (a landscape page stored portrait with /Rotate 90, a page whose
    crop box does not start at the origin); ``bounds`` maps such a box back. Unclamped."""

    left: float
    bottom: float
    width: float  # the crop box's, before the turn
    height: float
    turn: int  # /Rotate, clockwise: 0, 90, 180 or 270

    @classmethod
    def of(cls, page: pdfium.PdfPage) -> _View:
        left, bottom, right, top = page.get_cropbox()  # the media box where the page sets none
        return cls(left, bottom, right - left, top - bottom, page.get_rotation() % 360)

    @property
    def size(self) -> tuple[float, float]:
        return (self.height, self.width) if self.turn in (90, 270) else (self.width, self.height)

    def box(self, bounds: tuple[float, float, float, float]) -> Box:
        left, bottom, right, top = bounds
        w, h = self.width, self.height
        u0, u1 = left - self.left, right - self.left  # top-left origin on the crop box, before the turn
        v0, v1 = self.bottom + h - top, self.bottom + h - bottom
        return {0: (u0, v0, u1, v1), 90: (h - v1, u0, h - v0, u1), 180: (w - u1, h - v1, w - u0, h - v0),
                270: (v0, w - u1, v1, w - u0)}[self.turn]

    def bounds(self, box: Box) -> tuple[float, float, float, float]:
        x0, y0, x1, y1 = box
        w, h = self.width, self.height
        u0, v0, u1, v1 = {0: (x0, y0, x1, y1), 90: (y0, h - x1, y1, h - x0), 180: (w - x1, h - y1, w - x0, h - y0),
                          270: (w - y1, x0, w - y0, x1)}[self.turn]
        return (self.left + u0, self.bottom + h - v1, self.left + u1, self.bottom + h - v0)


def _text_lines(textpage: pdfium.PdfTextPage, view: _View) -> list[_Line]:
    """The text page's rectangles joined into lines (pdfium splits a line at font changes and wide gaps)."""
    rects: list[_Line] = []
    for i in range(textpage.count_rects()):
        rect = textpage.get_rect(i)
        text = textpage.get_text_bounded(*rect)
        if text.strip():
            rects.append(_Line(view.box(rect), text.strip()))
    lines: list[_Line] = []
    for rect in rects:  # pdfium gives them in reading order, a line's pieces one after another
        last = lines[-1] if lines else None
        if last is not None and _same_line(last.box, rect.box):
            lines[-1] = _Line(union_box(last.box, rect.box), last.text + " " + rect.text)
        else:
            lines.append(rect)
    return lines


def words_inside(page: pdfium.PdfPage, textpage: pdfium.PdfTextPage, box: Box) -> str:
    """The text drawn inside ``box`` (points, top-left origin, as a FigureRegion's): a plot's tick and axis labels,
    its legend, a diagram's node names, as the page's text objects hold them (raw; mmrag.core.figures.figure_words
    keeps what a figure point needs)."""
    return textpage.get_text_bounded(*_View.of(page).bounds(box))


def _same_line(a: Box, b: Box) -> bool:
    overlap = min(a[3], b[3]) - max(a[1], b[1])
    return overlap > 0.5 * min(a[3] - a[1], b[3] - b[1]) and -2.0 <= b[0] - a[2] <= _LINE_JOIN_PT


def _caption_lines(lines: list[_Line]) -> list[_Region]:
    """Caption lines with their boxes: mmrag.core.figures.captions over the page's lines, mapped back to each line."""
    found: list[_Region] = []
    text = "\n".join(line.text for line in lines)
    start = 0
    for cap in captions(text):
        for i in range(start, len(lines)):
            if cap.text.startswith(lines[i].text):
                box = lines[i].box
                for nxt in lines[i + 1 : i + 4]:  # continuation lines the parser took into the caption
                    if nxt.text in cap.text[len(lines[i].text) :]:
                        box = union_box(box, nxt.box)
                found.append(_Region(box, "caption", caption=" ".join(cap.text.split()), kind=cap.kind,
                                     number=cap.number))
                start = i + 1
                break
    return found


def _with_labels(region: _Region, lines: list[_Line], caption_lines: list[_Region]) -> _Region:
    """A drawing grows by the short text lines inside or just beside it: tick labels, a legend, axis titles."""
    if region.source == "form":
        return region  # a form's bounds already hold its text
    box = region.box
    for _ in range(3):
        grown = box
        for line in lines:
            lb = line.box
            if any(intersection(lb, c.box) > 0 for c in caption_lines):
                continue
            inside = intersection(lb, box) >= 0.9 * area(lb)
            near = _gap(lb, box) <= LABEL_GAP_PT
            short = (lb[2] - lb[0]) <= 1.05 * max(box[2] - box[0], 100.0)
            if inside or (near and short):
                grown = union_box(grown, lb)
        if grown == box:
            break
        box = grown
    return _Region(box, region.source)


def _gap(a: Box, b: Box) -> float:
    dx = max(0.0, max(a[0], b[0]) - min(a[2], b[2]))
    dy = max(0.0, max(a[1], b[1]) - min(a[3], b[3]))
    return max(dx, dy)


# --- regions -----------------------------------------------------------------------------------------------


def _cluster(boxes: list[Box], gap: float, *, deadline: float | None = None) -> list[Box]:
    """Union of boxes that touch within ``gap``, transitively: a sweep down the page with union-find.

    The boxes still in reach of the sweep are kept in columns ``gap`` wide, each box in every column it spans, so a
    box is compared only with those in the columns within ``gap`` of it: linear in the boxes for a page of many
    small marks (32,000 marks of a scatter plot: 3.9 s compared with every box in reach, 0.6 s in columns). A box
    is dropped from a column once the sweep has passed its bottom by more than ``gap``: no later box, which starts
    lower, can reach it. Boxes that each span the page (thousands of large overlapping shapes) are in every
    column and meet each other in each: :class:`FigureBudgetError` once ``deadline`` (time.monotonic) passes,
    checked at each box."""
    parent = list(range(len(boxes)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    width = max(gap, 1.0)
    columns: dict[int, list[int]] = {}
    for i in sorted(range(len(boxes)), key=lambda i: boxes[i][1]):
        if deadline is not None and time.monotonic() > deadline:
            raise FigureBudgetError(f"grouping its {len(boxes)} drawn shapes took over the page's time budget")
        x0, y0, x1, y1 = boxes[i]
        for c in range(int((x0 - gap) // width), int((x1 + gap) // width) + 1):
            column = columns.get(c)
            if not column:
                continue
            in_reach = [j for j in column if boxes[j][3] + gap >= y0]
            columns[c] = in_reach
            for j in in_reach:  # a box in several columns is met again: the union is idempotent
                a = boxes[j]
                if a[0] - gap <= x1 and x0 - gap <= a[2] and (root := find(j)) != i:
                    parent[root] = i  # i stays its component's root for the rest of its turn
        for c in range(int(x0 // width), int(x1 // width) + 1):
            columns.setdefault(c, []).append(i)
    merged: dict[int, Box] = {}
    for i, b in enumerate(boxes):
        root = find(i)
        merged[root] = union_box(merged[root], b) if root in merged else b
    return list(merged.values())


_SOURCE_RANK = {"raster": 0, "form": 1, "vector": 2, "page": 3}


def _merged_while(regions: list[_Region], joins: Callable[[_Region, _Region], bool]) -> list[_Region]:
    """Merge the first pair (in list order) that ``joins`` into one region (the union box, the stronger source),
    until no pair joins."""
    out = list(regions)
    while pair := next(((i, j) for i in range(len(out)) for j in range(i + 1, len(out)) if joins(out[i], out[j])),
                       None):
        i, j = pair
        a, b = out[i], out[j]
        out[i] = _Region(union_box(a.box, b.box), min(a.source, b.source, key=_SOURCE_RANK.__getitem__))
        del out[j]
    return out


def _merge_overlapping(regions: list[_Region]) -> list[_Region]:
    return _merged_while(regions, lambda a, b: intersection(a.box, b.box) > 0)


def _merge_panels(regions: list[_Region], lines: list[_Line], caption_lines: list[_Region]) -> list[_Region]:
    """Regions that overlap, or lie within PANEL_GAP_PT of each other with no caption and no body text between
    them, are one figure (the tiles of a mosaic plot, the panels of a figure)."""
    body = [line.box for line in lines if _is_body(line)] + [c.box for c in caption_lines]

    def joins(a: _Region, b: _Region) -> bool:
        if _gap(a.box, b.box) > PANEL_GAP_PT:
            return False
        joined = union_box(a.box, b.box)
        return intersection(a.box, b.box) > 0 or not any(
            intersection(t, joined) > 0 and intersection(t, a.box) <= 0 and intersection(t, b.box) <= 0
            for t in body
        )

    return _merged_while(regions, joins)


def _is_body(line: _Line) -> bool:
    """A line of running text, not a label: long."""
    return len(line.text) >= 50 or line.box[2] - line.box[0] >= 250.0


def _attach_captions(regions: list[_Region], caption_lines: list[_Region], body: list[Box]) -> list[_Region]:
    """Each region takes the nearest caption right below or above it (horizontally overlapping), else a
    figure caption further below it with no body text or other caption between them (the upper panels of a
    tall figure); the regions one caption names are merged into one (the panels of a figure)."""
    named: dict[int, list[_Region]] = {}
    loose: list[_Region] = []
    for region in regions:
        best, best_gap = None, CAPTION_GAP_PT
        for k, cap in enumerate(caption_lines):
            if min(region.box[2], cap.box[2]) - max(region.box[0], cap.box[0]) <= 0:
                continue
            below = cap.box[1] - region.box[3]  # caption under the region (figures)
            above = region.box[1] - cap.box[3]  # caption over the region (tables)
            for gap in (below, above):
                if -2.0 <= gap < best_gap:
                    best, best_gap = k, gap
        if best is None:
            best = _caption_below(region, caption_lines, body)
        if best is None:
            loose.append(region)
        else:
            named.setdefault(best, []).append(region)
    out = loose
    for k, group in named.items():
        cap = caption_lines[k]
        box = group[0].box
        for r in group[1:]:
            box = union_box(box, r.box)
        source = min((r.source for r in group), key=_SOURCE_RANK.__getitem__)
        out.append(_Region(box, source, caption=cap.caption, kind=cap.kind, number=cap.number))
    return out


def _caption_below(region: _Region, caption_lines: list[_Region], body: list[Box]) -> int | None:
    for k, cap in sorted(enumerate(caption_lines), key=lambda kc: kc[1].box[1]):
        if cap.kind != "figure" or cap.box[1] < region.box[3]:
            continue
        if min(region.box[2], cap.box[2]) - max(region.box[0], cap.box[0]) <= 0:
            return None
        between = (min(region.box[0], cap.box[0]), region.box[3], max(region.box[2], cap.box[2]), cap.box[1])
        blockers = body + [c.box for c in caption_lines if c is not cap]
        if any(intersection(b, between) > 0 for b in blockers):
            return None
        return k
    return None


def _reading_order(regions: list[_Region]) -> list[_Region]:
    """Top to bottom; regions side by side (overlapping vertically) left to right."""
    rows: list[list[_Region]] = []
    for r in sorted(regions, key=lambda r: r.box[1]):
        row = rows[-1] if rows else None
        if row is not None and r.box[1] < min(x.box[3] for x in row):
            row.append(r)
        else:
            rows.append([r])
    return [r for row in rows for r in sorted(row, key=lambda r: r.box[0])]


def _finish(region: _Region) -> FigureRegion:
    kind, number = region_name(region.kind, region.number, region.source)  # named as mmrag/core/figures.py says
    x0, y0, x1, y1 = region.box
    return FigureRegion(number, kind, region.caption, (x0, y0, x1, y1), region.source)  # type: ignore[arg-type]


# --- crops: each figure as an image of its own -------------------------------------------------------------

# A figure's crop is its own image entry, content-addressed like a page (mmrag/core/keys.py), so its key must depend on
# the figure only, never on where it sits on its page or what surrounds it:
# - an embedded picture (a raster region that is one image object) keys by the image object's own bitmap, at its
#   own resolution: the same chart pasted into a report and into a deck is one key, whatever size it is shown at;
# - a drawing included as one form XObject (a region that is one form: what LaTeX's \includegraphics of a PDF
#   figure, and most "place a PDF" tools, write) is rendered from the form alone, in its own coordinates: in a
#   scratch copy of the page, every other object switched off, the form's matrix set to a translation of its
#   drawn extent to the origin, at FIGURE_SCALE pixels per unit of the form's own space. Its placement (offset,
#   scale, any enclosing form) never enters the render, so the same figure included at another place or size, in
#   another document, renders to the same pixels: one key (mmrag/bench/figures `--keys`);
# - a drawing made of the page's own objects (a vector cluster with its labels, a picture with labels around it)
#   is rendered from those objects alone: in a scratch copy of the page, every top-level object not lying (mostly)
#   inside the region switched off, the rest moved so their joint extent starts at the origin, at FIGURE_SCALE pixels
#   per point. Its offset on the page never enters the render, so the same drawing at another place renders to
#   the same pixels up to pdfium's float rounding of the moved coordinates (mmrag/bench/figures `--keys` measures how
#   often that rounding still changes a pixel). Its coordinates are absolute, so a drawing drawn at another size
#   has other coordinates and renders to other pixels: two keys;
# - forms and drawings alone are rendered without anti-aliasing of paths and text (FIGURE_RENDER). Moved, a
#   drawing's device coordinates differ by float rounding (~1e-5 pt): anti-aliased, that shifts the grey level of
#   some edge pixels of almost every moved drawing, so its key; aliased, a pixel changes only where an edge passes
#   within that distance of its centre. What the model loses: grey edges (a diagonal or a glyph is stair-stepped
#   at 144 dpi; a hairline is one full pixel);
# - what none of these takes (no object lies mostly inside the region, pdfium refuses to move one, or no page
#   index was given) is the page inside the region: the crop box set to it, at FIGURE_SCALE pixels per point,
#   its pixel grid starting at the region's corner.
# Every crop is turned as its page is shown (/Rotate; for a form, with its placement's quarter turns), like the
# regions' boxes (_View): a landscape page stored portrait gives the crops of the page stored landscape.
FIGURE_SCALE = 2.0  # 144 dpi: a figure's crop keeps the detail a page render at MMRAG_PDF_DPI would lose
FIGURES_VERSION = "fig-v5"  # in a page's fingerprint: a changed detector or crop re-ingests (v2: forms alone,
# v3: drawings of the page's own objects alone, v4: without anti-aliasing, moved by their exact offset; boxes and
# crops on the page as shown, its crop box turned by /Rotate), and so does a changed naming of what it found
# (mmrag/core/figures.py: captions, region_name, figure_text; v5: a figure point's text adds the words drawn in it,
# a raster's OCR, and the sentences naming it on every page of its document)
FIGURE_RENDER = {"no_smoothpath": True, "no_smoothtext": True}  # pypdfium2's render flags for what is drawn alone
SIZE_GRID_PT = 1 / 1024  # ... on a page of its extent's size rounded to this (far above pdfium's float noise)
RASTER_MATCH_IOU = 0.9  # a raster region is one image object when their boxes agree this well
FORM_MATCH_IOU = 0.9  # ... and a drawn region is one form XObject when its box and the form's drawn box do
INSIDE_SLACK_PT = 1.0  # an object lies inside a region when its bounds do, give or take this ...
MOSTLY_INSIDE = 0.5  # ... or when this share of them does (it is then drawn whole, past the region's edge)


def crop_figures(page: pdfium.PdfPage, regions: list[FigureRegion], *, max_pixels: int, index: int | None = None
                 ) -> list[FigureCrop]:
    """Each region as an RGB image with its content hash (see above). ``max_pixels``: a picture larger than this
    (MMRAG_MAX_IMAGE_PIXELS, the decompression-bomb bound) is rendered at FIGURE_SCALE instead of decoded, and a
    form rendered alone is scaled down to fit it. ``index``: the page's 0-based index in its document, which
    rendering a form or a drawing alone needs (its scratch copy); None renders them as regions of the page."""
    crops = []
    images = _image_objects(page) if any(r.source == "raster" for r in regions) else []
    forms = _top_forms(page) if index is not None and any(r.source == "form" for r in regions) else []
    for region in regions:
        image = None
        if region.source == "raster":
            image = _own_pixels(images, region.bbox_pt, max_pixels)
        elif region.source == "form" and index is not None:
            image = _or_none(_form_alone, page, index, forms, region.bbox_pt, max_pixels)
        if image is None and index is not None:
            image = _or_none(_objects_alone, page, index, region.bbox_pt, max_pixels)
        if image is None:
            image = _render_alone(page, region.bbox_pt)
        fw, fh = fitted_size(*image.size)  # a figure as long as its page may be past the processor's ratio
        if (fw, fh) != image.size and max_pixels and fw * fh > max_pixels:
            log.warning("figure at %s skipped: %dx%d px, padded to the vision model's aspect ratio %dx%d, is over "
                        "MMRAG_MAX_IMAGE_PIXELS=%d (its page is kept)", region.bbox_pt, *image.size, fw, fh,
                        max_pixels)
            continue
        image = fit_aspect(image)
        crops.append(FigureCrop(region, image, content_hash_of(image.mode, image.size, image.tobytes())))
    return crops


def _or_none(render: Callable[..., Image.Image | None], page: pdfium.PdfPage, *args: Any) -> Image.Image | None:
    """``render``'s image, or None where pdfium refuses an object (the region is then cropped from the page): a
    figure the scratch copy cannot draw never costs its page."""
    try:
        return render(page, *args)
    except pdfium.PdfiumError as exc:
        log.warning("figure at %s rendered as a region of its page: %s (%s)", args[-2], exc, render.__name__)
        return None


def _top_forms(page: pdfium.PdfPage) -> list[Box | None]:
    """Each top-level form object's drawn box (points, top-left origin; None when it draws nothing), in page
    order: the k-th is the k-th form of a copy of the page."""
    view = _View.of(page)
    out: list[Box | None] = []
    for obj in page.get_objects(max_depth=1):
        if obj.type == pdfium_c.FPDF_PAGEOBJ_FORM:
            box = _form_box(page, obj)
            out.append(None if box is None else view.box(box))
    return out


def _form_alone(page: pdfium.PdfPage, index: int, forms: list[Box | None], box: Box, max_pixels: int
                ) -> Image.Image | None:
    """The one top-level form filling ``box``, rendered alone in its own coordinates (see above); None when no
    single form fills it or the form draws nothing of its own."""
    fits = [k for k, b in enumerate(forms) if b is not None and iou(b, box) >= FORM_MATCH_IOU]
    if len(fits) != 1:
        return None
    with _scratch_copy(page, index) as copy:
        objects = list(copy.get_objects(max_depth=1))
        form = [o for o in objects if o.type == pdfium_c.FPDF_PAGEOBJ_FORM][fits[0]]
        for obj in objects:  # switched off, not removed: nothing is rewritten
            if obj is not form:
                pdfium_c.FPDFPageObj_SetIsActive(obj.raw, False)
        # Shown as on the page: the quarter turns of its placement and of the page's /Rotate stay (a figure on a
        # landscape page stored portrait is upright), whatever else of the placement goes.
        a, b = form.get_matrix().get()[:2]
        turn = (_View.of(page).turn - 90 * round(math.degrees(math.atan2(b, a)) / 90)) % 360
        form.set_matrix(pdfium.PdfMatrix())  # its own space: the placement's offset and scale are gone
        drawn = _form_box(copy, form)
        if drawn is None:
            return None
        form.set_matrix(pdfium.PdfMatrix().translate(-drawn[0], -drawn[1]))
        return _render_from_origin(copy, drawn, max_pixels, turn)


def _objects_alone(page: pdfium.PdfPage, index: int, box: Box, max_pixels: int) -> Image.Image | None:
    """The page's top-level objects lying (mostly) inside ``box``, rendered alone from their joint extent's corner
    (see above); None when none does."""
    view = _View.of(page)
    with _scratch_copy(page, index) as copy:
        inside, extent = [], None
        for obj in copy.get_objects(max_depth=1):
            bounds = obj.get_bounds()
            if _mostly_inside(view.box(bounds), box):
                inside.append(obj)
                extent = bounds if extent is None else union_box(extent, bounds)
            else:
                pdfium_c.FPDFPageObj_SetIsActive(obj.raw, False)
        if extent is None:
            return None
        for obj in inside:  # by the extent's own corner: a drawing at any offset lands where the others do
            try:
                a, b, c, d, e, f = obj.get_matrix().get()
                obj.set_matrix(pdfium.PdfMatrix(a, b, c, d, e - extent[0], f - extent[1]))
            except pdfium.PdfiumError:  # a shading object has no matrix of its own: moved as it is
                obj.transform(pdfium.PdfMatrix().translate(-extent[0], -extent[1]))
            pdfium_c.FPDFPageObj_TransformClipPath(obj.raw, 1, 0, 0, 1, -extent[0], -extent[1])  # or it would hide it
        return _render_from_origin(copy, extent, max_pixels, view.turn)  # turned as the page is shown


def _mostly_inside(b: Box, box: Box) -> bool:
    """At least MOSTLY_INSIDE of ``b`` lies in ``box`` (each grown by INSIDE_SLACK_PT, so that a line, whose
    bounds have no area, counts by its length): a drawing's own object, though it reaches past a region that
    detection drew a little short, is drawn whole; a page's background or a frame around much more is not."""
    s = INSIDE_SLACK_PT
    grown = (b[0] - s, b[1] - s, b[2] + s, b[3] + s)
    return intersection(grown, (box[0] - s, box[1] - s, box[2] + s, box[3] + s)) >= MOSTLY_INSIDE * area(grown)


@contextmanager
def _scratch_copy(page: pdfium.PdfPage, index: int) -> Iterator[pdfium.PdfPage]:
    """Page ``index`` of ``page``'s document, copied into a new document closed on exit: its objects can be
    switched off and moved without touching the page."""
    scratch = pdfium.PdfDocument.new()
    try:
        scratch.import_pages(page.pdf, [index])
        yield scratch[0]
    finally:
        scratch.close()


def _render_from_origin(copy: pdfium.PdfPage, extent: tuple[float, float, float, float], max_pixels: int,
                        turn: int) -> Image.Image | None:
    """``copy``, whose content was moved so ``extent`` (PDF space) starts at the origin, rendered on a page of
    that extent turned by ``turn`` (clockwise degrees) at FIGURE_SCALE (scaled down only to fit ``max_pixels``)
    without anti-aliasing (FIGURE_RENDER); None for an empty extent. Its size is rounded to SIZE_GRID_PT: the
    bitmap's is the ceiling of size x scale, which float noise in the extent (222.00002 pt) would otherwise push a
    pixel further."""
    width, height = (round((hi - lo) / SIZE_GRID_PT) * SIZE_GRID_PT for lo, hi in ((extent[0], extent[2]),
                                                                                   (extent[1], extent[3])))
    if width <= 0 or height <= 0:
        return None
    copy.set_rotation(turn)
    copy.set_mediabox(0, 0, width, height)
    copy.set_cropbox(0, 0, width, height)
    bitmap = copy.render(scale=min(FIGURE_SCALE, (max_pixels / (width * height)) ** 0.5), **FIGURE_RENDER)
    try:
        return bitmap.to_pil().convert("RGB")
    finally:
        bitmap.close()


def _image_objects(page: pdfium.PdfPage) -> list[tuple[Box, pdfium.PdfImage]]:
    view = _View.of(page)
    out = []
    for obj in page.get_objects(max_depth=2):
        if obj.type == pdfium_c.FPDF_PAGEOBJ_IMAGE:
            out.append((view.box(obj.get_bounds()), obj))
    return out


def _own_pixels(images: list[tuple[Box, pdfium.PdfImage]], box: Box, max_pixels: int) -> Image.Image | None:
    """The one image object filling ``box``, decoded at its own resolution (its masks and matrix not applied);
    None when no single object fills it, it is too large, or pdfium cannot decode it."""
    fits = [obj for b, obj in images if iou(b, box) >= RASTER_MATCH_IOU]
    if len(fits) != 1:
        return None
    try:
        width, height = fits[0].get_px_size()
        if width * height > max_pixels:
            return None
        bitmap = fits[0].get_bitmap(render=False)
    except pdfium.PdfiumError:
        return None
    try:
        return bitmap.to_pil().convert("RGB")  # convert copies out of pdfium's buffer
    finally:
        bitmap.close()


def _render_alone(page: pdfium.PdfPage, box: Box) -> Image.Image:
    """The page inside ``box`` (points, top-left origin, as shown) at FIGURE_SCALE, turned as the page is, its pixel
    grid starting at the box's corner. The crop box is set for the render and put back."""
    left, bottom, right, top = page.get_cropbox()
    page.set_cropbox(*_View.of(page).bounds(box))
    try:
        bitmap = page.render(scale=FIGURE_SCALE)
    finally:
        page.set_cropbox(left, bottom, right, top)
    try:
        return bitmap.to_pil().convert("RGB")
    finally:
        bitmap.close()
