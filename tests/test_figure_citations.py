"""Figures in citations (issue 26): a citation names the figure its hit was on, in the REST answer, the stream,
the OpenAI footnotes and `mmrag ask`; GET /v1/pages/{id}/image?figure=N (or ?bbox=) outlines that box on the page.

The image routes run on their own app over a copy of the session corpus, whose pages are given known figures
before the app opens it (Qdrant local mode: one client per folder); the session's engine is shared, and nothing
here asks it anything. Answers with figures are built from rag.answer values: which figure a hit lands on is
retrieval's business and is tested with it.
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import httpx
import pytest
from PIL import Image, ImageChops
from pydantic import ValidationError
from typer.testing import CliRunner

from mmrag.core.engine import Usage
from mmrag.core.figures import FigureRegion, PageFigure
from mmrag.core.keys import ImageKey
from rag.answer import Answer, Citation
from serving.api import schemas
from serving.api.openai_schemas import ChatCompletion
from serving.api.routers.openai import chat_usage, footnotes
from tests.conftest import API_KEY, copy_corpus, serving

AUTH = {"Authorization": f"Bearer {API_KEY}"}
REPORT = "q3_quarterly_report.pdf"
CROP_KEY = ImageKey.parse(f"img1-{'a' * 64}-{'0' * 16}-px3136-1003520")  # what a citation says needs no real crop


def figure(number: int | None, caption: str, bbox: tuple[float, float, float, float],
           kind: str = "figure") -> PageFigure:
    return PageFigure(FigureRegion(number, kind, caption, bbox, "vector"), CROP_KEY, 64)


# --- what a citation says -------------------------------------------------------------------------------------


def test_a_citation_carries_its_figure_or_null_for_the_whole_page():
    revenue = figure(3, "Figure 3: Revenue by quarter", (72.04, 90.0, 540.0, 400.55))
    on_figure = Citation("p1", REPORT, 23, 0.91234, figure=revenue).to_json()
    whole = Citation("p2", REPORT, 24, 0.5).to_json()
    assert on_figure["figure"] == {"number": 3, "kind": "figure", "caption": "Figure 3: Revenue by quarter",
                                   "bbox": [72.0, 90.0, 540.0, 400.6]}
    assert whole["figure"] is None
    for body in (on_figure, whole):  # the documented model takes both as they are, and gives them back
        assert schemas.Citation.model_validate(body).model_dump() == body
    event = schemas.AskEvent.model_validate({"event": "citations", "citations": [on_figure, whole]})
    assert event.citations[0].figure.number == 3 and event.citations[1].figure is None
    with pytest.raises(ValidationError, match="bbox"):  # a box is four numbers
        schemas.Citation.model_validate({**on_figure, "figure": {**on_figure["figure"], "bbox": [1, 2, 3]}})


def test_the_figure_field_is_documented_in_the_answer_schema():
    spec = schemas.AskResponse.model_json_schema()
    cited = spec["$defs"]["Citation"]["properties"]["figure"]
    assert "null" in cited["description"] and "?figure=N" in cited["description"]
    fields = spec["$defs"]["FigureCitation"]["properties"]
    assert set(fields) == {"number", "kind", "caption", "bbox"} and all(f["description"] for f in fields.values())
    assert "top-left origin" in fields["bbox"]["description"] and "MMRAG_PDF_DPI/72" in fields["bbox"]["description"]


def test_footnotes_name_the_figure_and_leave_a_whole_page_as_it_was():
    cites = [Citation("p1", "report.pdf", 23, 0.9, figure=figure(3, "Figure 3: Revenue by quarter",
                                                                 (1, 2, 3, 4))).to_json(),
             Citation("p2", "report.pdf", 24, 0.8).to_json(),
             Citation("p3", "deck.pdf", 2, 0.7, figure=figure(None, "", (1, 2, 3, 4), "table")).to_json(),
             Citation("p4", "paper.pdf", 5, 0.6, figure=figure(None, "Figure 3.2: Cache hits",
                                                               (1, 2, 3, 4))).to_json()]
    assert footnotes(cites) == ("\n\n[1] report.pdf, page 23, Figure 3: Revenue by quarter\n"
                                "[2] report.pdf, page 24\n"
                                "[3] deck.pdf, page 2, a table\n"
                                "[4] paper.pdf, page 5, Figure 3.2: Cache hits")
    chat = ChatCompletion.model_validate({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "mmrag",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "x"}}],
        "usage": chat_usage(Answer("x", [], [], Usage(), "m", False).to_json()["usage"]), "citations": cites})
    assert chat.model_dump()["citations"][0]["figure"]["caption"] == "Figure 3: Revenue by quarter"


@pytest.mark.parametrize("caption, number, kind, named", [
    ("Fig. 3. Revenue", 3, "figure", "Figure 3: Revenue"),
    ("TABLE 2 - Plan comparison", 2, "table", "Table 2: Plan comparison"),
    ("Figure 3", 3, "figure", "Figure 3"),
    ("", 5, "table", "Table 5"),
    ("TABLE IV Latency", 4, "table", "TABLE IV Latency"),  # a caption that names it otherwise: as printed
])
def test_a_figure_is_named_by_its_label_and_its_caption_once(caption, number, kind, named):
    assert schemas.FigureCitation(number=number, kind=kind, caption=caption, bbox=[0, 0, 1, 1]).reference() == named


def test_mmrag_ask_prints_each_citations_figure_and_json_carries_it(monkeypatch):
    from mmrag import ask_cmd, cli

    answer = Answer("Revenue rose.", ["How did revenue move?"], [
        Citation("p1", REPORT, 1, 0.9, figure=figure(3, "Figure 3: Revenue by quarter",
                                                     (72, 90.5, 540, 400))),
        Citation("p2", REPORT, 2, 0.4)], Usage(), "tiny", random_weights=False)
    monkeypatch.setattr(ask_cmd, "ask", lambda *args, **kwargs: answer)
    runner = CliRunner()
    printed = runner.invoke(cli.app, ["ask", "How did revenue move?"])
    assert printed.exit_code == 0, printed.output
    text = " ".join(printed.stderr.split())  # rich wraps at the console's width
    assert f"cited: [{REPORT}, page 1] score 0.900, Figure 3: Revenue by quarter (box 72,90.5,540,400 pt)" in text
    assert f"cited: [{REPORT}, page 2] score 0.400 usage" in text  # a whole page: nothing after its score
    as_json = runner.invoke(cli.app, ["ask", "How did revenue move?", "--json"])
    assert as_json.exit_code == 0, as_json.output
    cites = json.loads(as_json.stdout)["citations"]
    assert [c["figure"] for c in cites] == [{"number": 3, "kind": "figure", "caption": "Figure 3: Revenue by quarter",
                                             "bbox": [72.0, 90.5, 540.0, 400.0]}, None]


# --- the page image with a box outlined ------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def figures_app(engine_settings, ingested, inprocess_engine, tmp_path_factory):
    """An app over a copy of the session corpus where page 1 of the report has figures 3 and 5 (one with a box
    at the page's edge) and an unnumbered one, page 2 none; the boxes in points, as fractions of the page."""
    from ingestion.loaders import render_page
    from mmrag import wiring

    data = tmp_path_factory.mktemp("figure-citations-data")
    copy_corpus(engine_settings, data)
    settings = engine_settings.replace(**{"data_dir": data, "api_key": API_KEY, "warm_top": 0})
    index = wiring.read_index(settings)
    try:
        first, second = index.find_page(REPORT, 1), index.find_page(REPORT, 2)
        slide = next(p for p in index.pages() if p.doc.endswith(".png"))
        scale = settings.ingestion.pdf_dpi / 72
        w, h = (v / scale for v in render_page(Path(first.path), 1, settings.documents).image.size)
        boxes = {3: (0.1 * w, 0.2 * h, 0.6 * w, 0.5 * h), 5: (0.5 * w, 0.8 * h, w, h)}
        figures = [figure(n, f"Figure {n}: chart {n}", box) for n, box in boxes.items()]
        figures.append(figure(None, "", (0.1 * w, 0.6 * h, 0.3 * w, 0.7 * h), "image"))
        index.set_page_fields(first.page_id, {"figures": [f.to_json() for f in figures]})
        index.set_page_fields(second.page_id, {"figures": []})
    finally:
        index.client.close()
    app = wiring.create_app(settings, engine=inprocess_engine, store=wiring.feature_store(settings))
    async with serving(app) as url, httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as http:
        yield {"http": http, "settings": settings, "scale": scale, "boxes": boxes, "page": first.page_id,
               "plain_page": second.page_id, "slide": slide, "path": first.path, "payload": first}


def _image(body: bytes) -> Image.Image:
    return Image.open(io.BytesIO(body)).convert("RGB")


def _changed(plain: Image.Image, outlined: Image.Image) -> tuple[int, int, int, int] | None:
    """The pixel box (x0, y0, x1 exclusive, y1 exclusive) of every pixel the outline changed."""
    assert plain.size == outlined.size
    return ImageChops.difference(plain, outlined).getbbox()


async def test_without_parameters_the_page_image_is_the_plain_render(figures_app):
    from ingestion.loaders import render_page

    got = await figures_app["http"].get(f"/v1/pages/{figures_app['page']}/image")
    assert got.status_code == 200 and got.headers["content-type"] == "image/png"
    buf = io.BytesIO()
    render_page(Path(figures_app["path"]), 1, figures_app["settings"].documents).image.save(buf, format="PNG")
    assert got.content == buf.getvalue()


async def test_a_page_lists_its_figures_so_a_client_knows_which_figure_n_exist(figures_app):
    """GET /v1/pages/{id} names each figure of the page as a citation does (number, kind, caption, box in points):
    each numbered one is outlined by ?figure=N, the unnumbered one by its box; a page without figures lists none."""
    http, page = figures_app["http"], figures_app["page"]
    got = await http.get(f"/v1/pages/{page}")
    assert got.status_code == 200, got.text
    listed = got.json()["figures"]
    boxes = figures_app["boxes"]
    assert [(f["number"], f["kind"], f["caption"]) for f in listed] == [
        (3, "figure", "Figure 3: chart 3"), (5, "figure", "Figure 5: chart 5"), (None, "image", "")]
    for f in listed[:2]:
        assert f["bbox"] == pytest.approx(boxes[f["number"]], abs=0.1)  # points, to a tenth (as citations)
        outlined = await http.get(f"/v1/pages/{page}/image", params={"figure": f["number"], "kind": f["kind"]})
        assert outlined.status_code == 200, outlined.text
    by_box = await http.get(f"/v1/pages/{page}/image", params={"bbox": ",".join(map(str, listed[2]["bbox"]))})
    assert by_box.status_code == 200, by_box.text
    assert (await http.get(f"/v1/pages/{figures_app['plain_page']}")).json()["figures"] == []
    assert (await http.get(f"/v1/pages/{figures_app['slide'].page_id}")).json()["figures"] == []


@pytest.mark.parametrize("number", [3, 5])
async def test_figure_n_is_outlined_in_red_exactly_where_its_box_says(figures_app, number):
    http, scale, page = figures_app["http"], figures_app["scale"], figures_app["page"]
    plain = _image((await http.get(f"/v1/pages/{page}/image")).content)
    got = await http.get(f"/v1/pages/{page}/image", params={"figure": number})
    assert got.status_code == 200 and got.headers["content-type"] == "image/png", got.text
    outlined = _image(got.content)
    box = FigureRegion(number, "figure", "", figures_app["boxes"][number], "vector").bbox_px(scale, plain.size)
    x0, y0, x1, y1 = box
    assert _changed(plain, outlined) == box  # nothing drawn outside the box, and its edges are reached
    mid_x, mid_y = (x0 + x1) // 2, (y0 + y1) // 2
    for edge in ((x0, mid_y), (x0 + 2, mid_y), (x1 - 1, mid_y), (mid_x, y0), (mid_x, y1 - 3)):
        assert outlined.getpixel(edge) == (255, 0, 0), edge  # a 3 px red line inside the box's edge
    assert outlined.getpixel((x0 + 3, mid_y)) == plain.getpixel((x0 + 3, mid_y))  # the figure itself untouched
    assert outlined.getpixel((mid_x, mid_y)) == plain.getpixel((mid_x, mid_y))


async def test_any_box_is_outlined_with_bbox_in_points_on_a_pdf_and_in_pixels_on_an_image(figures_app):
    http, settings, page = figures_app["http"], figures_app["settings"], figures_app["page"]
    plain = _image((await http.get(f"/v1/pages/{page}/image")).content)
    got = await http.get(f"/v1/pages/{page}/image", params={"bbox": "36, 54.5, 144, 108"})
    assert got.status_code == 200, got.text
    assert settings.ingestion.pdf_dpi == 96  # 4/3 px a point: 54.5 pt is 72.67 px, taken outward
    assert _changed(plain, _image(got.content)) == (48, 72, 192, 144)
    slide = figures_app["slide"].page_id  # an image document: its pixels are its points
    plain = _image((await http.get(f"/v1/pages/{slide}/image")).content)
    got = await http.get(f"/v1/pages/{slide}/image", params={"bbox": "10,20,110,70"})
    assert got.status_code == 200, got.text
    assert _changed(plain, _image(got.content)) == (10, 20, 110, 70)


@pytest.mark.parametrize("params, status, kind, says, fix", [
    ({"figure": 7}, 404, "unknown_figure", "numbered 3, 5", "figure=3, 5"),
    ({"figure": 1, "on": "plain_page"}, 404, "unknown_figure", "no figures were found", "bbox=x0,y0,x1,y1"),
    ({"bbox": "1,2,3"}, 400, "invalid_bbox", "not four numbers", "x0,y0,x1,y1"),
    ({"bbox": "1,2,nan,4"}, 400, "invalid_bbox", "not four numbers", "x0,y0,x1,y1"),
    ({"bbox": "10,10,5,20"}, 400, "invalid_bbox", "x0 < x1", "inside the page"),
    ({"bbox": "0,0,100000,10"}, 400, "invalid_bbox", "not inside the page", "inside the page"),
    ({"bbox": "1,2,3,4", "figure": 3}, 400, "conflicting_parameters", "both", "one of them"),
    ({"figure": 0}, 422, "invalid_request", "figure", ""),
])
async def test_a_figure_or_box_that_cannot_be_drawn_is_an_error_with_the_fix(figures_app, params, status, kind,
                                                                           says, fix):
    params = dict(params)
    page = figures_app[params.pop("on", "page")]
    got = await figures_app["http"].get(f"/v1/pages/{page}/image", params=params)
    assert got.status_code == status, got.text
    error = got.json()["error"]
    assert error["type"] == kind and says in error["message"] and error["fix"].strip(), error
    assert fix in error["fix"], error


def test_a_page_whose_figures_have_no_number_says_to_outline_one_by_its_box(figures_app):
    from serving.api.routers.documents import _figure_box
    from serving.http.errors import ApiError

    page = dataclasses.replace(figures_app["payload"], figures=(figure(None, "", (1, 2, 3, 4)),))
    with pytest.raises(ApiError) as refused:
        _figure_box(page, 1)
    assert refused.value.kind == "unknown_figure" and "none of its 1 figures has a number" in refused.value.message
    assert "figure.bbox" in refused.value.fix


def test_a_figure_and_a_table_of_one_number_are_told_apart_by_kind(figures_app):
    """A page may number a figure and a table alike ("Figure 2", "Table 2"): ``kind`` (a citation's
    ``figure.kind``) says which to outline; unset, the figure."""
    from serving.api.routers.documents import _figure_box
    from serving.http.errors import ApiError

    both = dataclasses.replace(figures_app["payload"], figures=(
        figure(2, "Table 2: Latency", (5, 6, 70, 80), "table"), figure(2, "Figure 2: Revenue", (1, 2, 30, 40))))
    assert _figure_box(both, 2) == _figure_box(both, 2, "figure") == (1, 2, 30, 40)
    assert _figure_box(both, 2, "table") == (5, 6, 70, 80)
    only_figure = dataclasses.replace(both, figures=both.figures[1:])
    with pytest.raises(ApiError) as refused:
        _figure_box(only_figure, 2, "table")
    assert refused.value.kind == "unknown_figure" and "no table 2, only a figure 2" in refused.value.message
    assert "kind=figure" in refused.value.fix


async def test_kind_outlines_a_table_by_its_number_and_is_refused_without_figure(figures_app):
    http, page = figures_app["http"], figures_app["page"]
    plain = await http.get(f"/v1/pages/{page}/image", params={"figure": 3})
    same = await http.get(f"/v1/pages/{page}/image", params={"figure": 3, "kind": "figure"})
    assert plain.status_code == same.status_code == 200 and plain.content == same.content
    table = await http.get(f"/v1/pages/{page}/image", params={"figure": 3, "kind": "table"})
    assert table.status_code == 404 and table.json()["error"]["type"] == "unknown_figure", table.text
    alone = await http.get(f"/v1/pages/{page}/image", params={"kind": "table"})
    assert alone.status_code == 400 and alone.json()["error"]["type"] == "conflicting_parameters", alone.text
    bad = await http.get(f"/v1/pages/{page}/image", params={"figure": 3, "kind": "chart"})
    assert bad.status_code == 422, bad.text
