"""A small, deterministic sample corpus of figure-heavy documents, with a labelled question set.

Why it exists: the page-level image cache is only worth testing on documents where pages *recur*, as a
company's standard architecture slide recurs across its design reviews, manuals and sales decks. So the
corpus has whole pages that are pixel-identical across files (the cache must hit), pages that share a
figure but differ in text (the cache must miss), one scanned page without a text layer (the OCR fallback
must run), and checkable facts on every page so retrieval can be scored against known answer pages.

Everything is drawn from the page specs below with matplotlib (no pyplot: no global figure state) and
written with fixed metadata, so the same seed gives byte-identical files.
"""

from __future__ import annotations

import textwrap
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.backends.backend_pdf import PdfPages
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Polygon
from PIL import Image, ImageDraw, ImageFilter

from mmrag.devkit.manifest import (  # noqa: F401  (re-exported: the manifest is read from here too)
    AnswerRef,
    CorpusManifest,
    DocumentEntry,
    Kind,
    PageEntry,
    Question,
    _page_from_json,
    _page_json,
)

A4_LANDSCAPE = (11.69, 8.27)  # inches
LETTER_PORTRAIT = (8.5, 11.0)
SLIDE_SIZE_PX = (1280, 720)
_SLIDE_DPI = 100  # 12.8 x 7.2 in at 100 dpi is exactly 1280 x 720 px
_SCAN_DPI = 150  # a typical office-scanner resolution; the page embeds the raster at this density

# Type 42 embeds real TrueType glyphs with a ToUnicode map, so pdfium can extract the text layer.
# A fixed font keeps the output identical across machines whatever fonts the host has installed.
_RC = {
    "pdf.fonttype": 42,
    "font.family": "DejaVu Sans",
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.titleweight": "bold",
    "figure.facecolor": "white",
}
# CreationDate would otherwise stamp the build time into every PDF and break reproducibility.
_PDF_METADATA = {"CreationDate": None, "Creator": "mmrag sample corpus"}

INK = "#1f2a44"
MUTED = "#6b7280"
PALETTE = ("#2f6db5", "#f28e2b", "#59a14f", "#b07aa1", "#e15759", "#76b7b2")
FOOTER = "Northwind Analytics  ·  Internal"


# --------------------------------------------------------------------------------------------------
# Specs: what each page says and shows. Pages are values; the same PageSpec object in two documents
# is a verbatim duplicate page.
# --------------------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Fact:
    """One checkable statement printed on a page, and hand-written questions whose answer it is."""

    text: str
    questions: tuple[str, ...]


@dataclass(slots=True, frozen=True)
class PageSpec:
    title: str
    figure: str  # a key of FIGURES
    facts: tuple[Fact, ...]
    notes: tuple[str, ...] = ()  # context sentences that are not scored
    scanned: bool = False  # rasterised into an image-only PDF page: no text layer


@dataclass(slots=True, frozen=True)
class DocSpec:
    file: str
    kind: Kind
    pages: tuple[PageSpec, ...]
    size: tuple[float, float] = A4_LANDSCAPE  # inches; PNG slides ignore it
    footer: str = FOOTER


# --------------------------------------------------------------------------------------------------
# Figures. Each draws into one Axes. Labels of figures that recur on several pages carry no numbers
# from the pages' facts, so a question is answered by its page's text and not by a shared figure.
# --------------------------------------------------------------------------------------------------

FigureFn = Callable[[Axes, np.random.Generator], None]


def _chart(ax: Axes, title: str, grid_axis: str = "y") -> None:
    ax.set_title(title, loc="left", color=INK)
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(axis=grid_axis, color="#d1d5db", linewidth=0.6)
    ax.set_axisbelow(True)


def _blank(ax: Axes, title: str, xlim: float, ylim: float) -> None:
    ax.set_xlim(0, xlim)
    ax.set_ylim(0, ylim)
    ax.set_axis_off()
    ax.set_title(title, loc="left", color=INK)


def _regional_revenue_bars(ax: Axes, rng: np.random.Generator) -> None:
    regions = {
        "Nordic": (35.1, 37.9, 41.2),
        "DACH": (52.3, 54.0, 58.6),
        "Iberia": (22.4, 23.9, 26.1),
        "Benelux": (39.5, 40.2, 43.0),
    }
    x = np.arange(3)
    for i, (region, values) in enumerate(regions.items()):
        ax.bar(x + (i - 1.5) * 0.2, values, 0.2, label=region, color=PALETTE[i])
    ax.set_xticks(x, ["Q1 2025", "Q2 2025", "Q3 2025"])
    ax.set_ylabel("Revenue (million EUR)")
    ax.legend(frameon=False, ncols=4, loc="upper left", fontsize=9)
    ax.set_ylim(0, 72)
    _chart(ax, "Revenue by region")


def _gross_margin_line(ax: Axes, rng: np.random.Generator) -> None:
    months = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep"]
    margin = [61.9, 62.3, 62.1, 62.8, 63.1, 62.4, 62.9, 63.0, 63.8]
    ax.plot(months, margin, marker="o", color=PALETTE[0], linewidth=2)
    ax.axhline(np.mean(margin), color=MUTED, linestyle="--", linewidth=1)
    ax.text(0.1, np.mean(margin) + 0.08, "9-month average", color=MUTED, fontsize=9)
    ax.set_ylabel("Gross margin (%)")
    ax.set_ylim(60.5, 64.5)
    _chart(ax, "Gross margin by month, 2025")


def _pie(ax: Axes, title: str, shares: dict[str, int], hole: float = 0.0) -> None:
    """A pie with a legend underneath: slice labels beside the pie get clipped by the page edge."""
    wedges, _, autotexts = ax.pie(
        list(shares.values()), autopct="%d%%", startangle=90, counterclock=False, colors=PALETTE[:len(shares)],
        pctdistance=0.78 if hole else 0.65, radius=0.95,
        wedgeprops={"edgecolor": "white", "linewidth": 1.5, "width": 0.95 - hole},
        textprops={"fontsize": 11, "color": "white", "fontweight": "bold"},
    )
    ax.legend(wedges, list(shares), loc="upper center", bbox_to_anchor=(0.5, 0.02), ncols=3, frameon=False)
    ax.set_title(title, loc="left", color=INK)


def _revenue_mix_pie(ax: Axes, rng: np.random.Generator) -> None:
    _pie(ax, "Q3 revenue by product line",
         {"Platform licences": 46, "Managed services": 31, "Support": 15, "Training": 8})


def _table(ax: Axes, title: str, header: list[str], rows: list[list[str]], col_widths: list[float]) -> None:
    ax.set_axis_off()
    ax.set_title(title, loc="left", color=INK)
    table = ax.table(cellText=rows, colLabels=header, colWidths=col_widths, loc="upper center", cellLoc="left")
    table.auto_set_font_size(False)
    table.set_fontsize(10)
    table.scale(1, 1.9)
    for (row, _), cell in table.get_celld().items():
        cell.set_edgecolor("#d1d5db")
        if row == 0:
            cell.set_facecolor(INK)
            cell.get_text().set_color("white")
            cell.get_text().set_fontweight("bold")
        elif row % 2 == 0:
            cell.set_facecolor("#f3f4f6")


def _opex_table(ax: Axes, rng: np.random.Generator) -> None:
    rows = [
        ["Research & development", "36.9", "38.5", "+4%"],
        ["Sales & marketing", "31.2", "32.0", "+3%"],
        ["General & administrative", "14.8", "14.1", "-5%"],
        ["Travel", "2.2", "1.8", "-18%"],
        ["Total", "85.1", "86.4", "+2%"],
    ]
    _table(ax, "Operating expenses (million EUR)", ["Category", "Q2", "Q3", "Change"], rows, [0.46, 0.16, 0.16, 0.18])


def _hiring_plan_bars(ax: Axes, rng: np.random.Generator) -> None:
    teams = {"Engineering": 85, "Sales": 24, "Customer success": 18, "G&A": 7}
    y = np.arange(len(teams))[::-1]
    ax.barh(y, list(teams.values()), color=PALETTE[2])
    ax.set_yticks(y, list(teams))
    for yi, value in zip(y, teams.values()):
        ax.text(value + 1.5, yi, str(value), va="center", fontsize=10, color=INK)
    ax.set_xlabel("Planned hires, Q4 2025")
    ax.set_xlim(0, 100)
    _chart(ax, "Q4 hiring plan by team", grid_axis="x")


def _headcount_bars(ax: Axes, rng: np.random.Generator) -> None:
    offices = {"Oslo": 212, "Berlin": 174, "Amsterdam": 131, "Lisbon": 96}
    ax.bar(list(offices), list(offices.values()), color=PALETTE[:4])
    for i, value in enumerate(offices.values()):
        ax.text(i, value + 4, str(value), ha="center", fontsize=11, color=INK)
    ax.set_ylabel("Employees")
    ax.set_ylim(0, 250)
    _chart(ax, "Headcount by office")


def _box(ax: Axes, x: float, y: float, w: float, h: float, label: str, color: str) -> None:
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05,rounding_size=0.15",
                                facecolor=color, edgecolor=INK, linewidth=1.2))
    ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=9, color=INK)


def _arrow(ax: Axes, start: tuple[float, float], end: tuple[float, float], label: str = "") -> None:
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=12, color=INK, linewidth=1.2,
                                 shrinkA=2, shrinkB=2))
    if label:
        # Beside the middle of the edge, on its upper side, so the label never sits on the line.
        dx, dy = end[0] - start[0], end[1] - start[1]
        norm = float(np.hypot(dx, dy)) or 1.0
        px, py = (-dy / norm, dx / norm) if dx / norm >= 0 else (dy / norm, -dx / norm)
        ax.text((start[0] + end[0]) / 2 + 0.3 * px, (start[1] + end[1]) / 2 + 0.3 * py, label,
                fontsize=8, color=MUTED, ha="center", va="center")


def _system_architecture(ax: Axes, rng: np.random.Generator) -> None:
    _blank(ax, "Platform architecture", 12, 7.4)
    w, h = 2.2, 0.95
    _box(ax, 0.1, 3.2, 1.8, h, "Web & API\nclients", "#e5e7eb")
    _box(ax, 2.6, 3.2, 2.0, h, "API gateway", "#dbeafe")
    _box(ax, 5.4, 5.0, w, h, "Ingest service", "#dcfce7")
    _box(ax, 5.4, 1.4, w, h, "Query service", "#dcfce7")
    stores = ["Object store", "Page renderer\n+ OCR", "Redis\nfeature store", "Qdrant\nvector index", "vLLM\nworkers"]
    for i, label in enumerate(stores):
        _box(ax, 9.4, 6.2 - i * 1.45, w, h, label, "#fef3c7" if i < 3 else "#fde2e4")
    _arrow(ax, (1.9, 3.67), (2.6, 3.67))
    _arrow(ax, (4.6, 3.9), (5.4, 5.3))
    _arrow(ax, (4.6, 3.4), (5.4, 2.0))
    for i in (0, 1):
        _arrow(ax, (7.6, 5.5), (9.4, 6.65 - i * 1.45))
    _arrow(ax, (9.4 + w / 2, 4.75), (9.4 + w / 2, 4.3))  # renderer writes features
    for i in (3, 4):
        _arrow(ax, (7.6, 1.9), (9.4, 6.65 - i * 1.45))
    _arrow(ax, (7.6, 5.2), (9.4, 3.75 - 1.45))  # ingest writes page vectors


@dataclass(slots=True, frozen=True)
class _Node:
    x: float
    y: float
    label: str
    shape: Literal["box", "start", "decision"] = "box"


def _flowchart(ax: Axes, title: str, nodes: dict[str, _Node], edges: list[tuple[str, str, str]]) -> None:
    _blank(ax, title, 10, 10)
    w, h = 3.0, 0.9
    colors = {"box": "#dbeafe", "start": "#dcfce7", "decision": "#fef3c7"}
    for node in nodes.values():
        if node.shape == "decision":
            ax.add_patch(Polygon([(node.x - 1.6, node.y), (node.x, node.y + 0.65), (node.x + 1.6, node.y),
                                  (node.x, node.y - 0.65)], facecolor=colors["decision"], edgecolor=INK))
            ax.text(node.x, node.y, node.label, ha="center", va="center", fontsize=9, color=INK)
        else:
            _box(ax, node.x - w / 2, node.y - h / 2, w, h, node.label, colors[node.shape])
    for a, b, label in edges:
        src, dst = nodes[a], nodes[b]
        start = (src.x, src.y - 0.65) if dst.y < src.y and abs(dst.x - src.x) < 0.5 else _side(src, dst)
        end = (dst.x, dst.y + (0.65 if dst.shape == "decision" else h / 2)) if dst.y < src.y else _side(dst, src)
        _arrow(ax, start, end, label)


def _side(node: _Node, towards: _Node) -> tuple[float, float]:
    """The point where an edge leaves ``node`` towards another node beside or below it."""
    half = 1.6 if node.shape == "decision" else 1.5
    if abs(towards.x - node.x) < 0.5:
        return (node.x, node.y - 0.45)
    return (node.x + half if towards.x > node.x else node.x - half, node.y)


def _ingest_flowchart(ax: Axes, rng: np.random.Generator) -> None:
    nodes = {
        "upload": _Node(5, 9.3, "Upload received", "start"),
        "validate": _Node(5, 8.0, "Validate type and size"),
        "layer": _Node(5, 6.6, "Text layer?", "decision"),
        "extract": _Node(1.8, 5.2, "Extract PDF text"),
        "ocr": _Node(8.2, 5.2, "OCR with tesseract"),
        "hash": _Node(5, 4.0, "Render + hash page"),
        "seen": _Node(5, 2.6, "Hash seen?", "decision"),
        "reuse": _Node(1.8, 1.1, "Reuse cached features"),
        "encode": _Node(8.2, 1.1, "Encode with VLM"),
    }
    edges = [
        ("upload", "validate", ""), ("validate", "layer", ""), ("layer", "extract", "yes"),
        ("layer", "ocr", "no"), ("extract", "hash", ""), ("ocr", "hash", ""), ("hash", "seen", ""),
        ("seen", "reuse", "yes"), ("seen", "encode", "no"),
    ]
    _flowchart(ax, "Ingestion pipeline", nodes, edges)


def _escalation_flowchart(ax: Axes, rng: np.random.Generator) -> None:
    nodes = {
        "alert": _Node(5, 9.2, "Alert fires", "start"),
        "ack": _Node(5, 7.8, "Primary on-call acks"),
        "triage": _Node(5, 6.3, "Severity 1?", "decision"),
        "fix": _Node(1.8, 4.8, "Fix in business hours"),
        "war": _Node(8.2, 4.8, "Open incident channel"),
        "resolved": _Node(8.2, 3.2, "Resolved?", "decision"),
        "ic": _Node(8.2, 1.2, "Incident commander"),
        "pm": _Node(1.8, 1.2, "Write postmortem"),
    }
    edges = [
        ("alert", "ack", ""), ("ack", "triage", ""), ("triage", "fix", "no"), ("triage", "war", "yes"),
        ("war", "resolved", ""), ("resolved", "ic", "no"), ("resolved", "pm", "yes"),
    ]
    _flowchart(ax, "Incident escalation path", nodes, edges)


def _ingest_volume_line(ax: Axes, rng: np.random.Generator) -> None:
    days = np.arange(1, 31)
    volume = 1.35 + 0.25 * np.sin(days / 30 * 2 * np.pi * 4) + rng.normal(0, 0.06, days.size)
    ax.plot(days, volume, color=PALETTE[0], linewidth=2, label="v1 observed")
    ax.axhline(2.5, color=PALETTE[4], linestyle="--", linewidth=1.5, label="v2 design peak")
    ax.set_xlabel("Day of September 2025")
    ax.set_ylabel("Pages ingested per day (millions)")
    ax.set_ylim(0, 3)
    ax.legend(frameon=False, loc="lower right")
    _chart(ax, "Daily ingest volume")


def _latency_percentiles(ax: Axes, rng: np.random.Generator) -> None:
    weeks = np.arange(1, 13)
    p50 = 0.72 - 0.01 * weeks + rng.normal(0, 0.03, weeks.size)
    p95 = 1.62 - 0.015 * weeks + rng.normal(0, 0.06, weeks.size)
    ax.plot(weeks, p50, marker="o", color=PALETTE[0], label="p50")
    ax.plot(weeks, p95, marker="s", color=PALETTE[1], label="p95")
    ax.axhline(1.8, color=PALETTE[4], linestyle="--", linewidth=1.5, label="p95 target")
    ax.set_xlabel("Week")
    ax.set_ylabel("Query latency (s)")
    ax.set_ylim(0, 2.2)
    ax.legend(frameon=False, ncols=3, loc="lower left")
    _chart(ax, "Query latency at the gateway")


def _capacity_table(ax: Axes, rng: np.random.Generator) -> None:
    rows = [
        ["API gateway", "3", "2 vCPU", "4 GiB"],
        ["Ingest service", "4", "4 vCPU", "8 GiB"],
        ["OCR pool", "2-12", "2 vCPU", "4 GiB"],
        ["Qdrant", "3", "8 vCPU", "64 GiB"],
        ["vLLM workers", "4", "1 GPU", "141 GiB"],
    ]
    _table(ax, "Capacity plan per component", ["Component", "Replicas", "CPU", "Memory"], rows,
           [0.38, 0.18, 0.2, 0.2])


def _maintenance_table(ax: Axes, rng: np.random.Generator) -> None:
    rows = [
        ["Vector index snapshot", "6-hourly", "any time"],
        ["Redis patching", "weekly", "Sun 02-04 UTC"],
        ["OS security updates", "weekly", "Tue 01-03 UTC"],
        ["Certificate rotation", "60 days", "business hours"],
        ["Restore drill", "quarterly", "announced"],
    ]
    _table(ax, "Maintenance calendar", ["Task", "Frequency", "Window"], rows, [0.44, 0.22, 0.3])


def _disk_usage_bars(ax: Axes, rng: np.random.Generator) -> None:
    usage = np.clip(rng.normal(58, 8, 8), 35, 76)
    usage[6] = 88  # storage-07, the failing node the page text names
    names = [f"storage-{i:02d}" for i in range(1, 9)]
    colors = [PALETTE[4] if u >= 80 else PALETTE[0] for u in usage]
    ax.bar(names, usage, color=colors)
    ax.axhline(80, color=PALETTE[4], linestyle="--", linewidth=1.5)
    ax.text(7.4, 81.5, "warning", color=PALETTE[4], fontsize=9, ha="right")
    ax.set_ylabel("Disk used (%)")
    ax.set_ylim(0, 100)
    ax.tick_params(axis="x", rotation=35)
    _chart(ax, "Disk usage by storage node")


def _backup_retention_bars(ax: Axes, rng: np.random.Generator) -> None:
    tiers = {"Hourly": 2, "Daily": 35, "Weekly": 84, "Monthly": 395}
    y = np.arange(len(tiers))[::-1]
    ax.barh(y, list(tiers.values()), color=PALETTE[5])
    ax.set_yticks(y, list(tiers))
    ax.set_xscale("log")
    ax.set_xlabel("Retention (days, log scale)")
    _chart(ax, "Backup retention by tier", grid_axis="x")


def _signoff_checklist(ax: Axes, rng: np.random.Generator) -> None:
    rows = [
        ["1", "Fail over to Frankfurt", "SRE", "done"],
        ["2", "Restore vector index", "Data", "done"],
        ["3", "Verify query latency", "SRE", "done"],
        ["4", "Fail back to Dublin", "SRE", "done"],
    ]
    _table(ax, "DR drill checklist", ["#", "Step", "Owner", "Status"], rows, [0.08, 0.5, 0.18, 0.18])
    # A hand-drawn signature under the table makes the "scan" look like a signed form.
    x = np.linspace(0.15, 0.75, 200)
    ax.plot(x, 0.06 + 0.025 * np.sin(x * 40) * np.cos(x * 7), color="#1e3a8a", linewidth=1.4,
            transform=ax.transAxes)


def _accuracy_vs_resolution(ax: Axes, rng: np.random.Generator) -> None:
    side = [224, 336, 448, 560, 672]
    ax.plot(side, [0.68, 0.76, 0.81, 0.812, 0.813], marker="o", color=PALETTE[0], label="text + image")
    ax.plot(side, [0.52, 0.63, 0.71, 0.715, 0.716], marker="s", color=PALETTE[1], label="image only")
    ax.plot(side, [0.70] * 5, linestyle="--", color=PALETTE[2], label="text only")
    ax.set_xlabel("Page image side (pixels)")
    ax.set_ylabel("Recall@5")
    ax.set_ylim(0.4, 0.9)
    ax.legend(frameon=False, loc="lower right")
    _chart(ax, "Figure 1: recall@5 versus page resolution")


def _ablation_table(ax: Axes, rng: np.random.Generator) -> None:
    rows = [
        ["Text + image vectors", "0.81", "0.74"],
        ["Without OCR text", "0.66", "0.59"],
        ["Text vectors only", "0.70", "0.63"],
        ["Image vectors only", "0.62", "0.55"],
    ]
    _table(ax, "Table 2: ablation on the enterprise set", ["Configuration", "Recall@5", "MRR"], rows,
           [0.5, 0.2, 0.2])


def _latency_scatter(ax: Axes, rng: np.random.Generator) -> None:
    tokens = rng.uniform(200, 1300, 80)
    ax.scatter(tokens, 0.26 * tokens + rng.normal(0, 15, tokens.size), s=14, color=PALETTE[4], label="uncached")
    ax.scatter(tokens, 14 + rng.normal(0, 3, tokens.size), s=14, color=PALETTE[0], label="prefix cache hit")
    ax.set_xlabel("Image tokens per page")
    ax.set_ylabel("Prefill latency (ms)")
    ax.legend(frameon=False, loc="upper left")
    _chart(ax, "Figure 3: prefill latency per page image")


def _cache_hit_bars(ax: Axes, rng: np.random.Generator) -> None:
    workloads = {"Slide decks": 58, "Manuals": 31, "Reports": 22, "Papers": 9, "Scanned\ncontracts": 4}
    ax.bar(list(workloads), list(workloads.values()), color=PALETTE[0])
    for i, value in enumerate(workloads.values()):
        ax.text(i, value + 1, f"{value}%", ha="center", fontsize=10, color=INK)
    ax.set_ylabel("Page cache hit rate (%)")
    ax.set_ylim(0, 70)
    _chart(ax, "Figure 4: hit rate by workload")


def _adoption_line(ax: Axes, rng: np.random.Generator) -> None:
    months = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep"]
    customers = [1210, 1290, 1370, 1440, 1530, 1610, 1720, 1820, 1930]
    ax.fill_between(range(9), customers, color=PALETTE[0], alpha=0.2)
    ax.plot(range(9), customers, color=PALETTE[0], linewidth=2)
    ax.set_xticks(range(9), months)
    ax.set_ylabel("Active customers")
    ax.set_ylim(1000, 2100)
    _chart(ax, "Insight active customers, 2025")


def _plan_comparison_table(ax: Axes, rng: np.random.Generator) -> None:
    yes, no = "✓", "–"
    rows = [
        ["Page-level search", yes, yes, yes],
        ["Single sign-on", no, yes, yes],
        ["Audit log", no, yes, yes],
        ["Private deployment", no, no, yes],
        ["Named support engineer", no, no, yes],
    ]
    _table(ax, "Plans at a glance", ["Feature", "Starter", "Team", "Enterprise"], rows, [0.42, 0.17, 0.17, 0.2])


def _roadmap_gantt(ax: Axes, rng: np.random.Generator) -> None:
    items = [  # (label, start month index from Oct 2025, length in months)
        ("Table extraction v2", 0, 3),
        ("EU data residency", 2, 4),
        ("Video ingestion", 4, 5),
        ("Air-gapped on-prem", 6, 6),
    ]
    for i, (label, start, length) in enumerate(items):
        y = len(items) - 1 - i
        ax.barh(y, length, left=start, color=PALETTE[i], height=0.5)
        # Labels on the bars, as roadmap slides do; tick labels would run into the page text.
        ax.text(start + 0.15, y + 0.4, label, fontsize=10, color=INK, va="bottom")
    ax.set_yticks([])
    ax.set_ylim(-0.5, len(items))
    ax.set_xticks([0, 3, 6, 9, 12], ["Q4 2025", "Q1 2026", "Q2 2026", "Q3 2026", "Q4 2026"])
    ax.set_xlim(0, 12.5)
    _chart(ax, "Product roadmap", grid_axis="x")


def _customer_segments_pie(ax: Axes, rng: np.random.Generator) -> None:
    _pie(ax, "Accounts by industry",
         {"Manufacturing": 34, "Financial services": 22, "Public sector": 17, "Healthcare": 15, "Other": 12},
         hole=0.45)


FIGURES: dict[str, FigureFn] = {
    "regional_revenue_bars": _regional_revenue_bars,
    "gross_margin_line": _gross_margin_line,
    "revenue_mix_pie": _revenue_mix_pie,
    "opex_table": _opex_table,
    "hiring_plan_bars": _hiring_plan_bars,
    "headcount_bars": _headcount_bars,
    "system_architecture": _system_architecture,
    "ingest_flowchart": _ingest_flowchart,
    "escalation_flowchart": _escalation_flowchart,
    "ingest_volume_line": _ingest_volume_line,
    "latency_percentiles": _latency_percentiles,
    "capacity_table": _capacity_table,
    "maintenance_table": _maintenance_table,
    "disk_usage_bars": _disk_usage_bars,
    "backup_retention_bars": _backup_retention_bars,
    "signoff_checklist": _signoff_checklist,
    "accuracy_vs_resolution": _accuracy_vs_resolution,
    "ablation_table": _ablation_table,
    "latency_scatter": _latency_scatter,
    "cache_hit_bars": _cache_hit_bars,
    "adoption_line": _adoption_line,
    "plan_comparison_table": _plan_comparison_table,
    "roadmap_gantt": _roadmap_gantt,
    "customer_segments_pie": _customer_segments_pie,
}


# --------------------------------------------------------------------------------------------------
# Content. Pages used in several documents are module constants; everything else is inline.
# --------------------------------------------------------------------------------------------------


def _f(text: str, *questions: str) -> Fact:
    return Fact(text, questions)


ARCHITECTURE_OVERVIEW = PageSpec(
    "Architecture overview",
    "system_architecture",
    (
        _f("All client traffic enters through the API gateway, which terminates TLS.",
           "Which component terminates TLS for incoming client traffic?"),
        _f("Page features are kept in the Redis feature store for 30 days.",
           "How long does the Redis feature store retain page features?",
           "For how many days are page features cached in Redis?"),
        _f("The query service sends retrieved page images to a pool of 4 vLLM workers.",
           "How many vLLM workers receive page images from the query service?"),
    ),
    ("Arrows show the direction of requests; the stores on the right are managed services.",),
)

COMPANY_OVERVIEW = PageSpec(
    "Northwind Analytics at a glance",
    "headcount_bars",
    (
        _f("Northwind Analytics employs 613 people across 4 offices.",
           "How many people work at Northwind Analytics?",
           "In how many offices does Northwind Analytics have people?"),
        _f("The company was founded in Oslo in 2011.",
           "In which year and city was the company founded?"),
    ),
)

QUARTERLY_REPORT = DocSpec("q3_quarterly_report.pdf", "pdf", (
    PageSpec("Q3 2025 at a glance", "regional_revenue_bars", (
        _f("Group revenue grew 12.4 percent year over year to 168.9 million euros in Q3.",
           "By what percentage did group revenue grow year over year in the third quarter?",
           "What was the total group revenue for Q3 2025?"),
        _f("Recurring subscription revenue made up 71 percent of the Q3 total.",
           "What share of third-quarter revenue came from recurring subscriptions?"),
    ), ("All four regions grew quarter over quarter.",)),
    PageSpec("Gross margin", "gross_margin_line", (
        _f("Gross margin averaged 62.7 percent over the first nine months of 2025.",
           "What was the average gross margin from January to September?"),
        _f("Cloud hosting costs fell by 3.1 million euros after the move to reserved instances.",
           "How much did hosting costs drop when the company switched to reserved instances?"),
    )),
    PageSpec("Revenue mix", "revenue_mix_pie", (
        _f("Platform licences accounted for 46 percent of Q3 revenue.",
           "What percentage of revenue came from platform licences?"),
        _f("Training revenue doubled after the online academy launched in July.",
           "In which month did the online academy launch, doubling training revenue?"),
    )),
    PageSpec("Operating expenses", "opex_table", (
        _f("Research and development spending was 38.5 million euros, 23 percent of revenue.",
           "How much was spent on research and development in Q3?"),
        _f("Travel costs were cut by 18 percent compared with Q2.",
           "By how much did travel costs fall versus the second quarter?"),
    )),
    PageSpec("Outlook for Q4", "hiring_plan_bars", (
        _f("Full-year revenue guidance was raised to between 655 and 670 million euros.",
           "What is the updated guidance range for full-year revenue?"),
        _f("The company plans to hire 85 engineers in Q4, mostly in Lisbon.",
           "How many engineers does the company plan to recruit in the fourth quarter, and in which city?"),
    )),
))

DESIGN_REVIEW = DocSpec("design_review_ingest_v2.pdf", "pdf", (
    PageSpec("Ingest v2: goals and scope", "ingest_volume_line", (
        _f("Ingest v2 must handle 2.5 million pages per day at peak.",
           "What peak daily page volume is ingest v2 designed for?",
           "How many pages per day must ingest v2 cope with at peak load?"),
        _f("The architecture board approved the ingest v2 design on 14 October 2025.",
           "On what date did the architecture board sign off the ingest v2 design?"),
    )),
    ARCHITECTURE_OVERVIEW,
    PageSpec("Ingestion pipeline", "ingest_flowchart", (
        _f("Pages are rendered at 96 dpi before hashing, so identical pages get identical keys.",
           "At what dpi are pages rendered before the page hash is computed?"),
        _f("The ingest service retries failed uploads 5 times with exponential backoff.",
           "How many times does the ingest service retry a failed upload?",
           "What backoff strategy does the ingest service use when an upload fails?"),
    )),
    PageSpec("Latency budget", "latency_percentiles", (
        _f("The p95 query latency target is 1.8 seconds, measured at the gateway.",
           "What is the 95th percentile query latency target?",
           "Where is the p95 query latency measured?"),
        _f("Cached image prefixes cut time to first token by 64 percent in the load test.",
           "By how much did cached image prefixes reduce time to first token during load testing?"),
    )),
    PageSpec("Capacity plan", "capacity_table", (
        _f("The OCR pool autoscales between 2 and 12 pods based on queue depth.",
           "Between how many pods does the OCR pool scale?"),
        _f("Qdrant runs as a three-node cluster with replication factor 2.",
           "What replication factor is configured for the Qdrant cluster?"),
    )),
    PageSpec("Proposal: split the query service", "system_architecture", (
        _f("Reranking would move into a separate service owned by the search squad.",
           "Which squad would own the new reranking service?"),
        _f("Splitting the query service is expected to save 140 GPU hours per week.",
           "How many GPU hours per week would splitting the query service save?"),
    ), ("Same platform as today; only the query path changes.",)),
))

OPERATIONS_MANUAL = DocSpec("operations_manual.pdf", "pdf", (
    ARCHITECTURE_OVERVIEW,
    PageSpec("Routine maintenance", "maintenance_table", (
        _f("Vector index snapshots are taken every 6 hours.",
           "How often is a snapshot of the vector index taken?"),
        _f("Redis is patched in the Sunday window from 02:00 to 04:00 UTC.",
           "When is the maintenance window for patching Redis?"),
    )),
    PageSpec("Incident escalation", "escalation_flowchart", (
        _f("The primary on-call engineer must acknowledge an alert within 15 minutes.",
           "How quickly does the primary on-call have to acknowledge an alert?"),
        _f("Severity 1 incidents still open after 45 minutes go to the incident commander.",
           "After how long is an unresolved sev-1 incident handed to the incident commander?"),
    )),
    PageSpec("Disk usage alerts", "disk_usage_bars", (
        _f("A warning fires when any storage node passes 80 percent disk usage.",
           "At what disk usage level does a storage node raise a warning?"),
        _f("Node storage-07 will be replaced because of repeated SMART errors.",
           "Which storage node is due for replacement, and why?"),
    )),
    PageSpec("Backup and restore", "backup_retention_bars", (
        _f("Daily backups are kept for 35 days and monthly backups for 13 months.",
           "How many days are daily backups retained?",
           "What is the retention period for monthly backups?"),
        _f("A full restore of the vector index took 47 minutes in the last drill.",
           "How long did restoring the vector index take in the most recent drill?"),
    )),
    PageSpec("Disaster recovery drill sign-off", "signoff_checklist", (
        _f("The disaster recovery drill on 9 September 2025 was signed off by Maria Lindqvist.",
           "Who signed off the September disaster recovery drill?"),
        _f("Failover to the Frankfurt region completed in 11 minutes.",
           "How long did the failover to the Frankfurt region take?"),
    ), scanned=True),
))

RESEARCH_PAPER = DocSpec("page_cache_paper.pdf", "pdf", (
    PageSpec("Page-level prefix caching for multimodal RAG", "accuracy_vs_resolution", (
        _f("Page-level prefix caching reduces vision encoder compute by 3.7 times on enterprise slide decks.",
           "By what factor does page-level prefix caching lower vision encoder compute on slide decks?"),
        _f("Recall at 5 saturates at 448 by 448 pixels per page image.",
           "Above which page image resolution does recall@5 stop improving?"),
    ), ("We study retrieval and answer quality on figure-heavy enterprise documents.",)),
    PageSpec("Ablation study", "ablation_table", (
        _f("Removing OCR text from the index lowers recall at 5 from 0.81 to 0.66.",
           "What happens to recall@5 when OCR text is dropped from the index?"),
        _f("Combining text and image vectors gives the best MRR of 0.74.",
           "Which configuration achieves the best MRR, and what is its value?"),
    ), ("Each row removes or isolates one source of evidence; all runs use the same encoder and index.",)),
    PageSpec("Prefill latency", "latency_scatter", (
        _f("Uncached prefill takes 212 milliseconds per page image on average.",
           "What is the average prefill time of one page image without a cache hit?"),
        _f("The evaluation set has 1,240 questions over 310 documents.",
           "How many questions and documents does the evaluation set contain?"),
    ), ("A prefix cache hit skips the vision encoder and the prefill of the image tokens entirely.",)),
    PageSpec("Cache hit rates by workload", "cache_hit_bars", (
        _f("Slide decks reach a 58 percent page cache hit rate because template slides recur.",
           "Why do slide decks have a high page cache hit rate, and how high is it?"),
        _f("Scanned contracts have the lowest hit rate, at 4 percent.",
           "Which workload shows the lowest cache hit rate?"),
    ), ("Hits are counted per page image, after rendering and hashing the page.",)),
), size=LETTER_PORTRAIT, footer="Page-level prefix caching for multimodal RAG  ·  preprint")

PRODUCT_DECK = DocSpec("product_deck_2025.pdf", "pdf", (
    PageSpec("Northwind Insight in 2025", "adoption_line", (
        _f("Northwind Insight had 1,930 active customers at the end of September.",
           "How many active customers did Insight have at the end of September?"),
        _f("Net revenue retention for Insight customers was 118 percent.",
           "What is the net revenue retention of Insight customers?"),
    )),
    PageSpec("Plans and pricing", "plan_comparison_table", (
        _f("The Team plan costs 49 euros per user per month.",
           "What is the monthly price per user of the Team plan?",
           "How many euros does one user on the Team plan cost each month?"),
        _f("Enterprise contracts include a 99.95 percent uptime SLA.",
           "What uptime does the Enterprise SLA guarantee?"),
    )),
    PageSpec("Roadmap", "roadmap_gantt", (
        _f("Video ingestion enters public beta in February 2026.",
           "When will video ingestion be available as a public beta?"),
        _f("On-premises deployments will support air-gapped clusters from Q2 2026.",
           "From which quarter can on-premises deployments run in air-gapped clusters?"),
    )),
    ARCHITECTURE_OVERVIEW,
    PageSpec("Who buys Insight", "customer_segments_pie", (
        _f("Manufacturing is the largest customer segment, with 34 percent of accounts.",
           "Which industry is the largest customer segment?"),
        _f("Public sector customers grew from 60 to 142 accounts in one year.",
           "How many public sector accounts are there now, compared with a year ago?"),
    )),
))


def _slide(file: str, page: PageSpec) -> DocSpec:
    return DocSpec(file, "png", (page,))


SLIDES = (
    _slide("allhands_01_company_overview.png", COMPANY_OVERVIEW),
    _slide("allhands_02_q3_revenue.png", PageSpec("Q3 sales highlights", "regional_revenue_bars", (
        _f("The Iberia team signed 14 new enterprise customers in Q3.",
           "How many new enterprise customers did the Iberia team win in the third quarter?"),
        _f("Average sales cycles shortened to 52 days.",
           "How long is the average sales cycle now?"),
    ))),
    _slide("allhands_03_platform.png", PageSpec("Platform update", "system_architecture", (
        _f("All tenants move to the new platform by 30 November.",
           "By what date will all tenants be on the new platform?"),
        _f("The platform team is hiring 6 site reliability engineers.",
           "How many site reliability engineers is the platform team recruiting?"),
    ))),
    _slide("sales_kickoff_01_company_overview.png", COMPANY_OVERVIEW),
    _slide("sales_kickoff_02_pricing.png", PageSpec("Pricing rules for FY26", "plan_comparison_table", (
        _f("Annual prepayment earns a 15 percent discount on every plan.",
           "What discount applies to every plan when customers pay a year up front?"),
        _f("Reps may approve discounts up to 10 percent without deal desk review.",
           "Up to what discount can a sales rep approve without the deal desk?"),
    ))),
    _slide("oncall_training_01_escalation.png", PageSpec("Going on call", "escalation_flowchart", (
        _f("New engineers shadow two on-call rotations before carrying the pager.",
           "How many rotations does a new engineer shadow before going on call?"),
        _f("Alerts are routed through Opsgenie to the on-call phone.",
           "Which tool routes alerts to the on-call engineer's phone?"),
    ))),
)

DOCUMENTS: tuple[DocSpec, ...] = (
    QUARTERLY_REPORT, DESIGN_REVIEW, OPERATIONS_MANUAL, RESEARCH_PAPER, PRODUCT_DECK, *SLIDES,
)


# --------------------------------------------------------------------------------------------------
# Layout: one function per page format. Nothing here may depend on the document a page sits in, or
# verbatim pages would stop being pixel-identical.
# --------------------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class _Layout:
    title_y: float  # baseline of the title; a rule sits just below it
    title_size: float
    body_size: float
    wrap: int  # characters per body line
    body_xy: tuple[float, float]  # top-left of the text column, figure fraction
    figure_rect: tuple[float, float, float, float]
    bullets: bool


_LANDSCAPE = _Layout(0.91, 24, 13, 40, (0.05, 0.82), (0.49, 0.12, 0.47, 0.68), bullets=False)
_PORTRAIT = _Layout(0.935, 18, 11, 84, (0.05, 0.89), (0.12, 0.08, 0.78, 0.46), bullets=False)
_SLIDE = _Layout(0.91, 28, 17, 29, (0.61, 0.80), (0.08, 0.10, 0.48, 0.66), bullets=True)


def _figure_rng(seed: int, figure: str) -> np.random.Generator:
    """Per-figure stream, so a figure draws the same wherever and in whatever order it appears."""
    return np.random.default_rng([seed, zlib.crc32(figure.encode())])


def _draw_page(fig: Figure, spec: PageSpec, layout: _Layout, footer: str, seed: int) -> None:
    fig.text(0.05, layout.title_y, spec.title, fontsize=layout.title_size, fontweight="bold", color=INK)
    rule_y = layout.title_y - 0.25 * layout.title_size / 72 / fig.get_figheight()
    fig.add_artist(Line2D([0.05, 0.95], [rule_y, rule_y], color=PALETTE[0], linewidth=2))
    _draw_body(fig, [f.text for f in spec.facts] + list(spec.notes), layout)
    ax = fig.add_axes(layout.figure_rect)
    FIGURES[spec.figure](ax, _figure_rng(seed, spec.figure))
    fig.text(0.05, 0.025, footer, fontsize=9, color=MUTED)


def _draw_body(fig: Figure, paragraphs: list[str], layout: _Layout) -> None:
    """Paragraphs (or bullets) stacked top-down; line height from the font size, so no renderer query."""
    x, y = layout.body_xy
    line = layout.body_size * 1.45 / 72 / fig.get_figheight()
    indent = 0.022 if layout.bullets else 0.0
    for text in paragraphs:
        # Never split "on-call" or "storage-07": the text layer must keep each fact as one phrase.
        lines = textwrap.wrap(text, layout.wrap, break_on_hyphens=False, break_long_words=False)
        if layout.bullets:
            fig.text(x, y, "•", fontsize=layout.body_size, color=PALETTE[0], va="top")
        fig.text(x + indent, y, "\n".join(lines), fontsize=layout.body_size, color=INK, va="top",
                 linespacing=1.45)
        y -= line * len(lines) + line * 0.8


def _pdf_layout(size: tuple[float, float]) -> _Layout:
    return _PORTRAIT if size[1] > size[0] else _LANDSCAPE


def _write_pdf(path: Path, doc: DocSpec, seed: int) -> None:
    with PdfPages(path, metadata={**_PDF_METADATA, "Title": doc.pages[0].title}) as pdf:
        for spec in doc.pages:
            fig = _scanned_figure(spec, doc, seed) if spec.scanned else _vector_figure(spec, doc, seed)
            pdf.savefig(fig)


def _vector_figure(spec: PageSpec, doc: DocSpec, seed: int) -> Figure:
    fig = Figure(figsize=doc.size)
    _draw_page(fig, spec, _pdf_layout(doc.size), doc.footer, seed)
    return fig


def _rasterise(fig: Figure, dpi: int) -> Image.Image:
    fig.set_dpi(dpi)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return Image.fromarray(np.asarray(canvas.buffer_rgba())).convert("RGB")


def _scanned_figure(spec: PageSpec, doc: DocSpec, seed: int) -> Figure:
    """The page printed and scanned: a grey, slightly skewed, speckled raster, and no text objects."""
    scan = _scan_effects(_rasterise(_vector_figure(spec, doc, seed), _SCAN_DPI), seed)
    fig = Figure(figsize=doc.size)
    ax = fig.add_axes((0, 0, 1, 1))
    # interpolation="none" makes the PDF backend embed the raster as is instead of resampling it.
    ax.imshow(np.asarray(scan.convert("RGB")), interpolation="none", aspect="auto")
    ax.set_axis_off()
    return fig


def _scan_effects(page: Image.Image, seed: int) -> Image.Image:
    rng = np.random.default_rng([seed, zlib.crc32(b"scan")])
    grey = page.convert("L").rotate(0.4, resample=Image.Resampling.BICUBIC, fillcolor=255)
    grey = grey.point(lambda v: 28 + v * 222 // 255)  # paper is never pure white, toner never pure black
    draw = ImageDraw.Draw(grey)
    specks = zip(rng.integers(0, grey.width, 120), rng.integers(0, grey.height, 120), rng.integers(1, 3, 120))
    for x, y, r in specks:
        draw.ellipse((int(x), int(y), int(x + r), int(y + r)), fill=90)
    return grey.filter(ImageFilter.GaussianBlur(0.5))


def _write_png(path: Path, doc: DocSpec, seed: int) -> None:
    (spec,) = doc.pages  # one slide per file, as exported slide images are
    fig = Figure(figsize=(SLIDE_SIZE_PX[0] / _SLIDE_DPI, SLIDE_SIZE_PX[1] / _SLIDE_DPI))
    _draw_page(fig, spec, _SLIDE, doc.footer, seed)
    image = _rasterise(fig, _SLIDE_DPI)
    if image.size != SLIDE_SIZE_PX:
        raise RuntimeError(f"slide {doc.file} rendered at {image.size}, expected {SLIDE_SIZE_PX}")
    image.save(path, format="PNG")  # Pillow writes no timestamp chunk, so the bytes are reproducible


# --------------------------------------------------------------------------------------------------
# Manifest construction and the entry point.
# --------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Placement:
    """Where each distinct page spec was placed, first copy first."""

    refs: dict[PageSpec, list[AnswerRef]] = field(default_factory=dict)
    formats: dict[PageSpec, tuple[Kind, tuple[float, float]]] = field(default_factory=dict)

    def add(self, spec: PageSpec, ref: AnswerRef, doc: DocSpec) -> None:
        fmt = (doc.kind, doc.size if doc.kind == "pdf" else SLIDE_SIZE_PX)
        if self.formats.setdefault(spec, fmt) != fmt:
            raise ValueError(f"page {spec.title!r} is reused in {ref} with a different page format; "
                             "verbatim pages must share kind and size to render identically")
        self.refs.setdefault(spec, []).append(ref)


def _place(docs: tuple[DocSpec, ...]) -> _Placement:
    placement = _Placement()
    for doc in docs:
        for number, spec in enumerate(doc.pages, start=1):
            placement.add(spec, AnswerRef(doc.file, number), doc)
    return placement


def _check_unique(placement: _Placement) -> None:
    """A fact or question on two distinct pages would make its question ambiguous."""
    seen: dict[str, str] = {}
    for spec in placement.refs:
        for fact in spec.facts:
            for text in (fact.text, *fact.questions):
                if text in seen:
                    raise ValueError(f"{text!r} appears on {seen[text]!r} and {spec.title!r}; reword one")
                seen[text] = spec.title


def _manifest(docs: tuple[DocSpec, ...], placement: _Placement) -> CorpusManifest:
    documents = tuple(
        DocumentEntry(doc.file, doc.kind, tuple(
            _page_entry(spec, AnswerRef(doc.file, n), doc, placement) for n, spec in enumerate(doc.pages, start=1)
        ))
        for doc in docs
    )
    questions = tuple(
        Question(q, tuple(refs), fact.text)
        for spec, refs in placement.refs.items()
        for fact in spec.facts
        for q in fact.questions
    )
    return CorpusManifest(documents, questions)


def _page_entry(spec: PageSpec, ref: AnswerRef, doc: DocSpec, placement: _Placement) -> PageEntry:
    first = placement.refs[spec][0]
    return PageEntry(
        page=ref.page,
        title=spec.title,
        facts=tuple(f.text for f in spec.facts),
        figure=spec.figure,
        text_layer=doc.kind == "pdf" and not spec.scanned,
        duplicate_of=None if first == ref else str(first),
    )


def build_sample_corpus(out: Path, *, seed: int = 0) -> CorpusManifest:
    """Write the sample PDFs, PNG slides and ``manifest.json`` into ``out``; same seed, same bytes.

    The seed only moves incidental data (noise in latency curves, scatter points, scan specks); the
    facts, titles and page structure are fixed so the question set stays valid for every seed.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    placement = _place(DOCUMENTS)
    _check_unique(placement)
    with matplotlib.rc_context(_RC):
        for doc in DOCUMENTS:
            writer = _write_pdf if doc.kind == "pdf" else _write_png
            writer(out / doc.file, doc, seed)
    manifest = _manifest(DOCUMENTS, placement)
    (out / "manifest.json").write_text(manifest.to_json(), encoding="utf-8")
    return manifest
