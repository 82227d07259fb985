"""Measure figure detection (ingestion.figures) against hand-labelled boxes.

Usage::

    python -m mmrag.bench.figures.evaluate --docs DIR --labels mmrag/bench/figures/boxes.jsonl [--json]

A detected box matches a labelled one at IoU >= 0.5, greedily one to one (highest IoU first). Reports
precision, recall and F1 overall, per document and per source kind (a false positive counts against the
source that produced it; a missed label against the source of no detection, "missed"), the share of matched
figures whose caption number is right, and milliseconds per page.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import pypdfium2 as pdfium
import pypdfium2.raw as pdfium_c

from mmrag.core.figures import Box, iou
from mmrag.core.settings import default_of
from ingestion.figures import detect_figures

MAX_PIXELS: int = default_of("max_image_pixels")  # MMRAG_MAX_IMAGE_PIXELS' default

IOU_MATCH = 0.5
FETCH_HINT = "python -m mmrag.bench.realdocs.fetch --out {docs}"


def match(predicted: list[Box], labelled: list[Box], threshold: float = IOU_MATCH) -> list[tuple[int, int]]:
    """Greedy one-to-one matching by IoU: (predicted index, labelled index) pairs with IoU >= threshold."""
    pairs = sorted(
        ((iou(p, g), i, j) for i, p in enumerate(predicted) for j, g in enumerate(labelled)), reverse=True
    )
    used_p: set[int] = set()
    used_g: set[int] = set()
    out: list[tuple[int, int]] = []
    for score, i, j in pairs:
        if score < threshold:
            break
        if i in used_p or j in used_g:
            continue
        used_p.add(i)
        used_g.add(j)
        out.append((i, j))
    return out


def _prf(tp: int, fp: int, fn: int) -> dict:
    p = tp / (tp + fp) if tp + fp else 1.0
    r = tp / (tp + fn) if tp + fn else 1.0
    f = 2 * p * r / (p + r) if p + r else 0.0
    return {"precision": round(p, 3), "recall": round(r, 3), "f1": round(f, 3), "tp": tp, "fp": fp, "fn": fn}


def load_labels(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def evaluate(docs_dir: Path, labels_path: Path) -> dict:
    docs_dir, labels = Path(docs_dir), load_labels(labels_path)
    missing = sorted({r["doc"] for r in labels if not (docs_dir / r["doc"]).is_file()})
    if missing:
        raise FileNotFoundError(
            f"{', '.join(missing)} not in {docs_dir}: fetch them with `{FETCH_HINT.format(docs=docs_dir)}`"
        )
    counts: dict[str, dict[str, int]] = defaultdict(lambda: {"tp": 0, "fp": 0, "fn": 0})
    numbered = numbered_right = 0
    elapsed = 0.0
    pages: list[dict] = []
    pdfs: dict[str, pdfium.PdfDocument] = {}
    for row in labels:
        pdf = pdfs.get(row["doc"]) or pdfs.setdefault(row["doc"], pdfium.PdfDocument(docs_dir / row["doc"]))
        page = pdf[row["page"] - 1]
        start = time.perf_counter()
        found = detect_figures(page)
        elapsed += time.perf_counter() - start
        truth = row["figures"]
        pairs = match([f.bbox_pt for f in found], [tuple(g["bbox_pt"]) for g in truth])
        hit_p, hit_g = {i for i, _ in pairs}, {j for _, j in pairs}
        for key in ("all", f"doc:{row['doc']}"):
            counts[key]["tp"] += len(pairs)
            counts[key]["fp"] += len(found) - len(pairs)
            counts[key]["fn"] += len(truth) - len(pairs)
        for i, f in enumerate(found):
            counts[f"source:{f.source}"]["tp" if i in hit_p else "fp"] += 1
        counts["source:missed"]["fn"] += len(truth) - len(pairs)
        for i, j in pairs:
            if truth[j].get("number") is not None or found[i].number is not None:
                numbered += 1
                numbered_right += found[i].number == truth[j].get("number")
        pages.append({
            "doc": row["doc"], "page": row["page"],
            "found": [[round(v, 1) for v in f.bbox_pt] + [f.source, f.number] for f in found],
            "missed": [truth[j]["bbox_pt"] for j in range(len(truth)) if j not in hit_g],
            "extra": [i for i in range(len(found)) if i not in hit_p],
        })
    result = {"overall": _prf(**counts.pop("all"))}
    result["per_doc"] = {k[4:]: _prf(**v) for k, v in sorted(counts.items()) if k.startswith("doc:")}
    result["per_source"] = {k[7:]: v | ({"precision": round(v["tp"] / (v["tp"] + v["fp"]), 3)}
                                       if v["tp"] + v["fp"] else {})
                            for k, v in sorted(counts.items()) if k.startswith("source:")}
    result["number_right"] = round(numbered_right / numbered, 3) if numbered else None
    result["numbered_matches"] = numbered
    result["pages"] = len(labels)
    result["ms_per_page"] = round(1000 * elapsed / max(1, len(labels)), 2)
    result["page_details"] = pages
    return result


# Where the same figures are placed again, (dx, dy, scale): top-left offset in points and scale. The first moves
# nothing: the harness's own floor, since rewriting a page's content stream (pdfium's gen_content, which saving the
# moved page needs) can itself change how a drawing renders. Then whole points, quarter and half points, a
# fractional place (another pixel phase at 144 dpi), two arbitrary places (as in another document: no offset on a
# binary grid) and two smaller sizes (a figure shown smaller on a slide).
PLACEMENTS: tuple[tuple[float, float, float], ...] = (
    (0.0, 0.0, 1.0), (36.0, 24.0, 1.0), (10.25, 17.5, 1.0), (0.3, 0.7, 1.0), (47.37, 103.91, 1.0),
    (13.06, 58.44, 1.0), (20.0, 30.0, 0.8), (5.5, 7.3, 0.63))


def moved_copy(src: pdfium.PdfDocument, index: int, dx: float, dy: float, scale: float) -> pdfium.PdfDocument:
    """A new PDF whose one page is page ``index`` of ``src`` with all its content moved by (dx, dy) points (down and
    right) and scaled by ``scale``, on a page 72 pt larger: every top-level object (and its clip) transformed in
    place, so its structure stays what it was (a form stays one form, paths stay paths)."""
    dest = pdfium.PdfDocument.new()
    dest.import_pages(src, [index])
    page = dest[0]
    width, height = page.get_size()
    new_w, new_h = width * scale + 72, height * scale + 72
    e, f = dx, new_h - dy - height * scale
    for obj in page.get_objects(max_depth=1):
        obj.transform(pdfium.PdfMatrix(scale, 0, 0, scale, e, f))
        pdfium_c.FPDFPageObj_TransformClipPath(obj.raw, scale, 0, 0, scale, e, f)
    page.set_rotation(0)
    page.set_mediabox(0, 0, new_w, new_h)
    page.set_cropbox(0, 0, new_w, new_h)
    page.gen_content()
    return dest


def crop_key_stability(docs_dir: Path, labels_path: Path, placements=PLACEMENTS) -> dict:
    """How often the same drawn figure in another file gets the same key: each labelled page's drawn figures
    (vector clusters and forms) are detected and cropped as ingestion does (detect_figures, crop_figures), then
    the page's content is moved and scaled onto a new page (moved_copy, as the same figure placed in another
    document is), detected and cropped again, and each figure's crop key compared with its original's (the first
    placement moves nothing: "rewritten", the harness's own floor). A raster
    figure keys by its own bitmap, which no placement changes, so only drawn figures are measured."""
    from ingestion.figures import crop_figures

    docs_dir, labels = Path(docs_dir), load_labels(labels_path)
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for row in labels:
        src = pdfium.PdfDocument(docs_dir / row["doc"])
        index = row["page"] - 1
        page = src[index]
        regions = [r for r in detect_figures(page) if r.source != "raster"]
        if not regions:
            continue
        originals = crop_figures(page, regions, max_pixels=MAX_PIXELS, index=index)
        for dx, dy, scale in placements:
            moved = moved_copy(src, index, dx, dy, scale)
            found = detect_figures(moved[0])
            crops = crop_figures(moved[0], found, max_pixels=MAX_PIXELS, index=0)
            for region, original in zip(regions, originals):
                x0, y0, x1, y1 = region.bbox_pt
                want = (x0 * scale + dx, y0 * scale + dy, x1 * scale + dx, y1 * scale + dy)
                again = [c for c in crops if iou(c.region.bbox_pt, want) >= 0.5]
                same = bool(again) and again[0].content_hash == original.content_hash
                how = "rewritten" if (dx, dy, scale) == (0, 0, 1) else "moved" if scale == 1 else "scaled"
                for key in (region.source, f"{region.source}, {how}", f"{dx},{dy},{scale}", "all"):
                    counts[key][0] += same
                    counts[key][1] += 1
    return {key: {"same": n, "of": of, "share": round(n / of, 3)} for key, (n, of) in sorted(counts.items())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=Path, required=True, help="folder holding the realdocs PDFs")
    ap.add_argument("--labels", type=Path, default=Path(__file__).with_name("boxes.jsonl"))
    ap.add_argument("--json", action="store_true", help="print the whole result as JSON")
    ap.add_argument("--details", action="store_true", help="list misses and extra boxes per page")
    ap.add_argument("--keys", action="store_true", help="also measure how often a drawn figure placed elsewhere "
                                                        "(and smaller) in another file keeps its crop's key")
    args = ap.parse_args(argv)
    try:
        result = evaluate(args.docs, args.labels)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.keys:
        result["crop_keys"] = crop_key_stability(args.docs, args.labels)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    o = result["overall"]
    print(f"{result['pages']} pages  P {o['precision']}  R {o['recall']}  F1 {o['f1']}  "
          f"(tp {o['tp']} fp {o['fp']} fn {o['fn']})  number right {result['number_right']} "
          f"of {result['numbered_matches']}  {result['ms_per_page']} ms/page")
    for name, m in result["per_doc"].items():
        print(f"  {name:22s} P {m['precision']}  R {m['recall']}  F1 {m['f1']}  (tp {m['tp']} fp {m['fp']} fn {m['fn']})")
    for name, m in result["per_source"].items():
        print(f"  source {name:8s} {m}")
    if args.keys:
        for name, k in result["crop_keys"].items():
            print(f"  crop keys, {name:18s} {k['same']} of {k['of']} drawn figures placed again keep their key "
                  f"({k['share']})")
    if args.details:
        for p in result["page_details"]:
            if p["missed"] or p["extra"]:
                print(f"  {p['doc']} p{p['page']}: found {p['found']} extra {p['extra']} missed {p['missed']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
