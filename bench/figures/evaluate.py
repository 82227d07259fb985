"""Measure figure detection (ingestion.figures) against hand-labelled boxes.

Usage::

    python -m bench.figures.evaluate --docs DIR --labels bench/figures/boxes.jsonl [--json]

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

from core.figures import Box, iou
from ingestion.figures import detect_figures

IOU_MATCH = 0.5
FETCH_HINT = "python -m bench.realdocs.fetch --out {docs}"


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


# Where the same figures are placed again: whole points, and a fractional place (pixel phase at 144 dpi).
KEY_OFFSETS: tuple[tuple[float, float], ...] = ((36.0, 24.0), (10.25, 17.5), (0.3, 0.7))


def crop_key_stability(docs_dir: Path, labels_path: Path, offsets=KEY_OFFSETS) -> dict:
    """How often the same drawn figure in another file gets the same key: each labelled page's detected figures
    are cropped (ingestion.figures.crop_figures, as ingestion does), then the page is placed, as a form XObject
    unchanged, on a larger page of a new PDF at each offset (as a figure included into another document is),
    and the same regions, shifted, rendered again. A raster figure keys by its own bitmap, which no placement
    changes, so only rendered crops (vector and form figures) are measured. Also: how many of them differ at
    all from their original, and by how much."""
    from ingestion.figures import _render_alone  # the crop a drawn figure gets

    docs_dir, labels = Path(docs_dir), load_labels(labels_path)
    same = total = 0
    worst = 0
    by_offset: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for row in labels:
        src = pdfium.PdfDocument(docs_dir / row["doc"])
        page = src[row["page"] - 1]
        regions = [r for r in detect_figures(page) if r.source != "raster"]
        if not regions:
            continue
        originals = [_render_alone(page, r.bbox_pt) for r in regions]
        w, h = page.get_size()
        for dx, dy in offsets:
            dest = pdfium.PdfDocument.new()
            xobject = src.page_as_xobject(row["page"] - 1, dest)
            placed = dest.new_page(w + 72, h + 72)
            obj = xobject.as_pageobject()
            obj.set_matrix(pdfium.PdfMatrix().translate(dx, 72 - dy))  # top-left origin: down by dy
            placed.insert_obj(obj)
            placed.gen_content()
            for region, original in zip(regions, originals):
                x0, y0, x1, y1 = region.bbox_pt
                again = _render_alone(placed, (x0 + dx, y0 + dy, x1 + dx, y1 + dy))
                equal = again.size == original.size and again.tobytes() == original.tobytes()
                if not equal and again.size == original.size:
                    a, b = again.tobytes(), original.tobytes()
                    worst = max(worst, max(abs(u - v) for u, v in zip(a, b)))
                same += equal
                total += 1
                by_offset[f"{dx},{dy}"][0] += equal
                by_offset[f"{dx},{dy}"][1] += 1
    return {"rendered_figures_x_offsets": total, "same_key": same,
            "same_key_share": round(same / total, 3) if total else None,
            "by_offset": {k: {"same": v[0], "of": v[1]} for k, v in by_offset.items()},
            "largest_pixel_difference": worst}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=Path, required=True, help="folder holding the realdocs PDFs")
    ap.add_argument("--labels", type=Path, default=Path(__file__).with_name("boxes.jsonl"))
    ap.add_argument("--json", action="store_true", help="print the whole result as JSON")
    ap.add_argument("--details", action="store_true", help="list misses and extra boxes per page")
    ap.add_argument("--keys", action="store_true", help="also measure how often a drawn figure placed elsewhere "
                                                        "in another file keeps its crop's key")
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
        k = result["crop_keys"]
        print(f"  crop keys: {k['same_key']} of {k['rendered_figures_x_offsets']} drawn figures placed elsewhere "
              f"keep their key ({k['same_key_share']}); by offset {k['by_offset']}; largest pixel difference "
              f"{k['largest_pixel_difference']}")
    if args.details:
        for p in result["page_details"]:
            if p["missed"] or p["extra"]:
                print(f"  {p['doc']} p{p['page']}: found {p['found']} extra {p['extra']} missed {p['missed']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
