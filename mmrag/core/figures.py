"""A figure region of a page: where a figure, table or picture sits, what it is called, and how it was found.

The contract between figure detection at ingest (``ingestion.figures``) and everything that stores, crops or
cites a figure (a Qdrant payload, a crop of the page image, "Figure 3" in an answer). Pure: no I/O, standard
library only.

Boxes are in PDF points with a TOP-LEFT origin and y growing down, so a page rendered at ``scale`` pixels per
point maps a box to pixels by one multiplication (:meth:`FigureRegion.bbox_px`).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any, Literal

from mmrag.core.keys import ImageKey
from mmrag.core.text import caption_label

Box = tuple[float, float, float, float]
"""x0, y0, x1, y1 in points, top-left origin, y down; x0 <= x1 and y0 <= y1."""

FigureKind = Literal["figure", "table", "image", "slide"]
FigureSource = Literal["raster", "vector", "form", "page"]

KINDS: frozenset[str] = frozenset({"figure", "table", "image", "slide"})
SOURCES: frozenset[str] = frozenset({"raster", "vector", "form", "page"})


@dataclass(frozen=True, slots=True)
class FigureRegion:
    """One figure on a page.

    ``number`` is the N of its caption ("Figure 3:", "Fig. 3.", "Table 3") when that is a whole number, else
    None (uncaptioned, or numbered "3.2"/"A.1": the caption text still carries it). ``kind`` is "figure",
    "table", "image" (an uncaptioned raster) or "slide". ``source`` says what the box was found from: a raster
    image object, a cluster of vector paths, a form XObject, or the page itself.
    """

    number: int | None
    kind: FigureKind
    caption: str
    bbox_pt: Box
    source: FigureSource

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {sorted(KINDS)}, not {self.kind!r}")
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {sorted(SOURCES)}, not {self.source!r}")
        x0, y0, x1, y1 = self.bbox_pt
        if not (x0 <= x1 and y0 <= y1) or not all(math.isfinite(v) for v in self.bbox_pt):
            raise ValueError(f"bbox_pt must be finite (x0, y0, x1, y1) with x0 <= x1 and y0 <= y1, not {self.bbox_pt}")

    @property
    def ref(self) -> tuple[str, str] | None:
        """How a question names it, as mmrag/core/text.py figure_refs gives it: ("figure" | "table", "3"); None without a
        whole number."""
        if self.number is None:
            return None
        return ("table" if self.kind == "table" else "figure"), str(self.number)

    def named_by(self, ref: tuple[str, str]) -> bool:
        """Whether a question's reference (mmrag/core/text.py figure_refs: ("figure", "3")) names this figure: by its
        kind (a table, or any other kind as a figure) and whole number, or as its caption prints it ("Table IV",
        "Figure 3.2", "Listing 2"), a panel of it included ("Figure 3a", "Figure 3B", "Figure 3.2a")."""
        kind, number = ref
        own = set()
        if self.number is not None and kind == ("table" if self.kind == "table" else "figure"):
            own.add(str(self.number))
        printed = caption_label(self.caption)
        if printed is not None and printed[0] == kind:
            own.add(printed[1].upper())
        panel = re.fullmatch(r"(\d[\d.]*)[a-z]", number, re.IGNORECASE)
        return number.upper() in own or (panel is not None and panel.group(1) in own)

    def bbox_px(self, scale: float, size: tuple[int, int] | None = None) -> tuple[int, int, int, int]:
        """The box on the page rendered at ``scale`` pixels per point: outward-rounded ints, clamped at 0 and,
        given the rendered image's ``size`` (width, height), at its edges."""
        x0, y0, x1, y1 = self.bbox_pt
        box = [math.floor(x0 * scale), math.floor(y0 * scale), math.ceil(x1 * scale), math.ceil(y1 * scale)]
        box = [max(0, v) for v in box]
        if size is not None:
            w, h = size
            box = [min(box[0], w), min(box[1], h), min(box[2], w), min(box[3], h)]
        return box[0], box[1], box[2], box[3]

    def to_json(self) -> dict[str, Any]:
        """A plain dict for a payload (lists, str, int, None)."""
        data = asdict(self)
        data["bbox_pt"] = [round(v, 2) for v in self.bbox_pt]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FigureRegion:
        x0, y0, x1, y1 = (float(v) for v in data["bbox_pt"])
        return cls(
            number=None if data.get("number") is None else int(data["number"]),
            kind=data["kind"],
            caption=data.get("caption", ""),
            bbox_pt=(x0, y0, x1, y1),
            source=data["source"],
        )


def figure_label(kind: str, number: int | None) -> str:
    """"Figure 3", "Table 2"; "a figure" ("a table") without a whole number."""
    word = "table" if kind == "table" else "figure"
    return f"a {word}" if number is None else f"{word.title()} {number}"


def figure_reference(kind: str, number: int | None, caption: str) -> str:
    """How a footnote or `mmrag ask` names a figure: its label and its caption without the "Figure 3:" / "Fig. 3."
    the caption starts with ("Figure 3: Revenue by quarter"); a caption that names it otherwise ("Figure 3.2 ...",
    "TABLE IV ...") as printed; the label alone without a caption."""
    caption = " ".join(caption.split())
    if not caption:
        return figure_label(kind, number)
    if number is None:
        return caption
    parsed = caption_label(caption)
    if parsed is None or parsed[1] != str(number):
        return caption
    return f"{figure_label(kind, number)}: {parsed[2]}" if parsed[2] else figure_label(kind, number)


def area(box: Box) -> float:
    return max(0.0, box[2] - box[0]) * max(0.0, box[3] - box[1])


def intersection(a: Box, b: Box) -> float:
    return area((max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])))


def iou(a: Box, b: Box) -> float:
    """Intersection over union of two boxes; 0.0 when both are empty."""
    inter = intersection(a, b)
    union = area(a) + area(b) - inter
    return inter / union if union > 0 else 0.0


def union_box(a: Box, b: Box) -> Box:
    return min(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), max(a[3], b[3])


@dataclass(frozen=True, slots=True)
class PageFigure:
    """A figure of an indexed page: its region, and the image entry of its crop (its own key, content-addressed
    like a page's: the same figure in two documents is one key, one vision forward, one KV prefix)."""

    region: FigureRegion
    image_key: ImageKey
    image_tokens: int

    @property
    def label(self) -> str:
        """How an answer names it: "Figure 3", "Table 2", or "a figure" when uncaptioned."""
        return figure_label(self.region.kind, self.region.number)

    def to_json(self) -> dict[str, Any]:
        return {**self.region.to_json(), "image_key": str(self.image_key), "image_tokens": self.image_tokens}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PageFigure:
        return cls(FigureRegion.from_json(data), ImageKey.parse(data["image_key"]), int(data["image_tokens"]))

    def citation(self) -> dict[str, Any]:
        """What a citation says of it (REST ``figure``): number, caption, kind and box in points (top-left
        origin) on the page."""
        return {"number": self.region.number, "kind": self.region.kind, "caption": self.region.caption,
                "bbox": [round(v, 1) for v in self.region.bbox_pt]}
