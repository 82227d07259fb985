"""GET /ui, the page to look at mmrag with, on the session's real server, and in a real browser: Debian's chromium,
headless, driven by selenium through chromedriver (nothing downloaded; one browser per test session).

What an evaluator does with it, in order: a wrong key shows the API's own 401; a PDF uploaded through the page is
ingested as a job whose progress the page shows, then listed; a question with an image dropped on the page streams
its answer in (sub-questions first, then the tokens) beside the cited page images, the cited figure outlined where
the citation's box says, with the cache panel; a follow-up reuses the conversation and shows that its image came
from the cache; the document is deleted after a confirmation. The page is keyboard-operable, every control is
labelled, every text is readable (contrast measured in the browser), and it reaches no other host.

The server runs in this process's event loop (tests/conftest.py `api_server`), so every browser step runs in a
worker thread (:func:`in_browser`) while the loop serves the browser's requests. A screenshot of the session is
saved under $MMRAG_TEST_ARTIFACTS (default tests/artifacts/); with MMRAG_UI_SCREENSHOT_TO_DOCS=1 it also replaces
docs/ui.png, the README's.
"""

from __future__ import annotations

import asyncio
import base64
import fnmatch
import io
import os
import random
import re
import shutil
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image, ImageDraw

from mmrag.core.figures import FigureRegion
from serving.api.routers.ui import ASSETS, UI_PATH
from tests.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
REPO = Path(__file__).resolve().parents[1]
UI_FILES = REPO / "serving" / "api" / "ui"
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
WAIT_S = 120  # the longest any one step may take (an ask on a loaded 2-core machine); none takes it normally

# The uploaded document: page 1 carries a captioned figure (its box in points, top-left origin), page 2 none.
DOC = "greenhouse.pdf"
FIGURE_BOX = (150.0, 170.0, 450.0, 357.5)
CAPTION = "Figure 7: Tomato yield per greenhouse bay, in kilograms."
QUESTION = "What does Figure 7 show about tomato yield per greenhouse bay?"
FOLLOW_UP = "Which bar of the image is the tallest?"


# --- the page's files, without a browser ------------------------------------------------------------------------


@pytest.fixture
async def http(api_server):
    async with httpx.AsyncClient(base_url=api_server["url"], timeout=120) as client:
        yield client


async def test_the_page_and_its_files_are_served_with_their_types_and_need_no_key(http):
    page = await http.get(UI_PATH)
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.text == (UI_FILES / "index.html").read_text()
    for name, media_type in ASSETS.items():
        r = await http.get(f"{UI_PATH}/{name}")
        assert r.status_code == 200 and r.headers["content-type"] == media_type, name
        assert r.content == (UI_FILES / name).read_bytes(), name
        # The browser itself refuses anything from another host, whatever a later edit adds.
        assert "default-src 'self'" in r.headers["content-security-policy"], name
        assert r.headers["x-content-type-options"] == "nosniff"
    missing = await http.get(f"{UI_PATH}/nope.js")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found"
    assert missing.json()["error"]["fix"] == "open /ui; its files are api.js, app.css, app.js, index.html"
    for name in ("..%2Fmain.py", "%2E%2E%2Frouters%2Fui.py", "..%2F..%2F..%2Fpyproject.toml"):
        outside = await http.get(f"{UI_PATH}/{name}")  # only the listed files: nothing else of the package
        assert outside.status_code == 404 and outside.json()["error"]["type"] == "not_found", name


async def test_page_images_asked_for_at_once_are_all_served(http):
    # The page loads an answer's cited pages in parallel; pdfium, which renders them, is not thread-safe, and two
    # renders at once crashed the server (SIGSEGV) before the image route made them take turns.
    docs = (await http.get("/v1/documents", params={"limit": 1000}, headers=AUTH)).json()["documents"]
    pages = [p["page_id"] for d in docs if d["doc"].endswith(".pdf") for p in d["pages"]][:12]
    assert len(pages) >= 6
    for _ in range(3):
        got = await asyncio.gather(*(http.get(f"/v1/pages/{p}/image", headers=AUTH) for p in pages))
        assert [r.status_code for r in got] == [200] * len(pages)
        assert all(r.content.startswith(b"\x89PNG") for r in got)


def test_every_file_of_the_page_is_served_and_shipped_as_package_data():
    assert {p.name for p in UI_FILES.iterdir()} == set(ASSETS)
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = package_data["serving.api"]
    assert all(any(fnmatch.fnmatch(f"ui/{name}", glob) for glob in shipped) for name in ASSETS), shipped


def test_the_page_reaches_no_other_host():
    for name in ASSETS:
        text = (UI_FILES / name).read_text()
        assert not re.search(r"https?:|//[\w.-]+\.[a-z]+/", text, re.IGNORECASE), name  # no address of a host
    assert not re.search(r"@import|url\(", (UI_FILES / "app.css").read_text())  # no stylesheet or font from anywhere
    html = (UI_FILES / "index.html").read_text()
    loaded = re.findall(r'<(?:script|link)[^>]*(?:src|href)="([^"]+)"', html)
    assert sorted(loaded) == ["/ui/app.css", "/ui/app.js", "data:,"], loaded  # data:, is the empty favicon
    modules = re.findall(r'from "([^"]+)"', (UI_FILES / "app.js").read_text())
    assert modules == ["./api.js"], modules


# --- the browser: one per test session --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """Headless chromium under chromedriver, both from Debian (`make setup` installs them as root)."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("selenium (the dev extra: pip install -e '.[dev]')")
    if missing:
        why = f"no browser to test the page with: {', '.join(missing)} missing; `make setup` installs them as root"
        if os.geteuid() != 0:
            pytest.skip(why + " (not root here: apt-get install chromium chromium-driver)")
        pytest.fail(why)
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000",
                "--no-first-run", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--disable-default-apps", "--lang=en-US"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_script_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


async def in_browser(step: Callable[..., Any], *args) -> Any:
    """``step`` in a worker thread: the server shares this event loop, and must serve the browser meanwhile."""
    return await asyncio.to_thread(step, *args)


def wait_until(driver, script: str, *args, what: str) -> Any:
    """Poll ``script`` (a JS expression's body, `return ...`) until it returns something truthy."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(lambda d: d.execute_script(script, *args),
                                                                    message=f"waiting for {what}")


def by_id(driver, element_id: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id)


def use_key(driver, key: str) -> None:
    from selenium.webdriver.common.keys import Keys

    field = by_id(driver, "key")
    field.clear()
    field.send_keys(key, Keys.ENTER)  # the form's own submit, from the keyboard


@pytest.fixture(scope="module")
async def page(api_server, browser) -> Any:
    """The page opened on the session's server with the right key."""
    url = api_server["url"]

    def open_page():
        browser.get(f"{url}{UI_PATH}")
        wait_until(browser, "return document.body.dataset.ready === 'true'", what="the page's script")
        use_key(browser, API_KEY)
        wait_until(browser, "return /documents? in the index/.test(document.getElementById('documents-status')"
                            ".textContent)", what="the document list")
        return browser

    return await in_browser(open_page)


# --- the key ----------------------------------------------------------------------------------------------------


async def test_a_wrong_key_shows_the_error_the_api_returns_and_the_key_stays_in_the_tab(page, http):
    refused = (await http.get("/v1/documents", headers={"Authorization": "Bearer not-the-key"})).json()["error"]

    def wrong_then_right():
        use_key(page, "not-the-key")
        shown = wait_until(page, "return document.getElementById('alert').innerText", what="the error")
        status = page.execute_script("return document.getElementById('alert').dataset.status")
        wait_until(page, "return document.getElementById('documents-status').innerText.startsWith('Enter your')",
                   what="the document list's status to ask for the key")
        listed = page.execute_script("return document.getElementById('documents-status').innerText")
        storage = page.execute_script("return [sessionStorage.getItem('mmrag.key'), localStorage.length, "
                                      "document.cookie]")
        use_key(page, API_KEY)
        wait_until(page, "return document.getElementById('alert').innerText === ''", what="the error to clear")
        return shown, status, listed, storage

    shown, status, listed, storage = await in_browser(wrong_then_right)
    assert status == "401" and shown.startswith("401 unauthorized: ")
    assert listed == "Enter your API key (or your tenant's key) above to see your documents."
    assert refused["message"] in shown and f"Fix: {refused['fix']}" in shown, shown  # the API's words, whole
    assert storage == ["not-the-key", 0, ""]  # this tab's session storage only: no localStorage, no cookie


# --- documents: upload with the job's progress, list, delete ------------------------------------------------------


def chart_jpeg() -> bytes:
    image = Image.new("RGB", (320, 200), "white")
    draw = ImageDraw.Draw(image)
    for k, h in enumerate((50, 120, 80, 160, 140, 180)):
        draw.rectangle((20 + 48 * k, 190 - h, 56 + 48 * k, 190), fill=(30 + 35 * k, 140, 60))
    out = io.BytesIO()
    image.save(out, "JPEG", quality=90)
    return out.getvalue()


def greenhouse_pdf() -> bytes:
    """Two pages, built object by object: a captioned chart (FIGURE_BOX) on the first, text only on the second."""
    from mmrag.devkit.pdfbuild import PageBuilder, join_pages

    first = PageBuilder()
    first.text(72, 72, "Greenhouse tomato harvest", size=18)
    first.body(110, 3)
    first.image(FIGURE_BOX, chart_jpeg())
    first.text(150, 370, CAPTION)
    first.body(420, 5)
    second = PageBuilder()
    second.text(72, 72, "Irrigation schedule", size=18)
    second.text(72, 110, "The drip lines of every bay run twice a day, at dawn and at dusk, for twelve minutes.")
    second.body(140, 8)
    return join_pages([first.bytes(), second.bytes()])


# Every change to an upload row, as the page shows it: its state, its <progress> and its status text.
WATCH_UPLOADS = """
window.uploadsSeen = [];
const seen = () => { const row = document.querySelector('#uploads li'); if (!row) return;
  const bar = row.querySelector('progress');
  window.uploadsSeen.push({state: row.dataset.state, determinate: bar.hasAttribute('value'), value: bar.value,
                           max: bar.max, text: row.querySelector('.upload-status').textContent}); };
new MutationObserver(seen).observe(document.getElementById('uploads'),
                                   {subtree: true, childList: true, attributes: true, characterData: true});
"""


@pytest.fixture(scope="module")
async def uploaded(page, tmp_path_factory) -> dict:
    """DOC uploaded through the page's file input; what its row showed, the job and the document it made."""
    path = tmp_path_factory.mktemp("ui-upload") / DOC
    path.write_bytes(greenhouse_pdf())

    def upload():
        page.execute_script(WATCH_UPLOADS)
        by_id(page, "files").send_keys(str(path))
        wait_until(page, "const r = document.querySelector('#uploads li'); return r && "
                         "['done', 'failed'].includes(r.dataset.state)", what="the ingest job")
        row = page.execute_script("const r = document.querySelector('#uploads li'); return {...r.dataset}")
        wait_until(page, "return !!document.querySelector(`#document-rows tr[data-doc-id='${arguments[0]}']`)",
                   row["docId"], what="the new document in the list")
        listed = page.execute_script("return [...document.querySelectorAll('#document-rows tr')].map(r => "
                                     "[r.dataset.docId, r.innerText])")
        scope = page.execute_script("return [...document.getElementById('scope').options].map(o => o.value)")
        return {**row, "seen": page.execute_script("return window.uploadsSeen"), "listed": dict(listed),
                "scope": scope}

    return await in_browser(upload)


async def test_an_upload_shows_its_bytes_then_its_ingest_job_until_it_is_listed(uploaded, http):
    seen = uploaded["seen"]
    states = [s["state"] for s in seen]
    assert states[0] == "uploading" and states[-1] == "done", states
    assert {"queued", "running"} & set(states), states  # the job, polled, between upload and end
    assert all(not s["determinate"] for s in seen if s["state"] in ("queued", "running"))
    last = seen[-1]
    assert last["determinate"] and last["value"] == last["max"] == 1
    assert last["text"] == "done: 2 pages indexed (2 encoded, 0 cached, 1 figure)", last
    job = (await http.get(f"/v1/ingest/{uploaded['jobId']}", headers=AUTH)).json()
    assert job["status"] == "done" and job["progress"] == {"files_done": 1, "files_total": 1, "pages_done": 2}
    assert uploaded["listed"][uploaded["docId"]].split("\t")[:2] == [DOC, "2"]
    assert uploaded["docId"] in uploaded["scope"]  # and a question can be asked about it alone


# --- ask: the streamed answer beside its sources, with the cache ----------------------------------------------------


def question_png() -> bytes:
    """A picture no earlier question sent (random boxes): the first ask encodes it, the follow-up must not."""
    rng = random.Random()
    image = Image.new("RGB", (280, 280), "white")
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        x, y = rng.randrange(240), rng.randrange(240)
        draw.rectangle((x, y, x + 40, y + 30), fill=tuple(rng.randrange(256) for _ in range(3)))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


# A file dropped on the image zone, as a drag and drop from the desktop delivers it.
DROP = """
const [zone, b64, name] = arguments;
const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
const files = new DataTransfer();
files.items.add(new File([bytes], name, {type: 'image/png'}));
for (const type of ['dragover', 'drop'])
  zone.dispatchEvent(new DragEvent(type, {dataTransfer: files, bubbles: true, cancelable: true}));
"""

# The newest answer as it changes: each token appended to its text (a record's oldValue is the text before it),
# and when the sub-questions and the sources appeared.
WATCH_ANSWER = """
window.answerSeen = [];
window.answerWatch?.disconnect();
(window.answerWatch = new MutationObserver(records => { for (const r of records) {
  if (r.type === 'characterData') window.answerSeen.push(['text', r.oldValue]);
  else if (r.target.matches('.sub-questions') && r.addedNodes.length) window.answerSeen.push(['sub_questions']);
  else if (r.target.matches('.source-list') && r.addedNodes.length) window.answerSeen.push(['sources']);
}})).observe(document.getElementById('turns'), {subtree: true, childList: true, characterData: true,
                                                characterDataOldValue: true});
"""

# Red pixels of the outline the server drew (255, 0, 0) in a loaded <img>: how many, and their bounding box.
RED_PIXELS = """
const img = arguments[0];
const canvas = document.createElement('canvas');
canvas.width = img.naturalWidth; canvas.height = img.naturalHeight;
const g = canvas.getContext('2d'); g.drawImage(img, 0, 0);
const d = g.getImageData(0, 0, canvas.width, canvas.height).data;
let n = 0, x0 = Infinity, y0 = Infinity, x1 = -1, y1 = -1;
for (let i = 0; i < d.length; i += 4) {
  if (d[i] === 255 && d[i + 1] === 0 && d[i + 2] === 0) {
    const p = i / 4, x = p % canvas.width, y = Math.floor(p / canvas.width);
    n++; x0 = Math.min(x0, x); y0 = Math.min(y0, y); x1 = Math.max(x1, x + 1); y1 = Math.max(y1, y + 1);
  }
}
return {red: n, box: n ? [x0, y0, x1, y1] : null};
"""

SOURCES = """
return [...document.querySelectorAll('#turns > li:last-child .source')].map(s => {
  const img = s.querySelector('img');
  return {src: img.dataset.src, loaded: img.complete && img.naturalWidth > 0, width: img.naturalWidth,
          height: img.naturalHeight, alt: img.alt, caption: s.querySelector('figcaption').innerText, img: img};
});
"""


def newest_answer(driver) -> dict:
    """What the newest answer shows once done: its text, sub-questions, cache panel and sources."""
    wait_until(driver, "const t = document.querySelector('#turns > li:last-child'); return t && "
                       "t.dataset.state !== 'streaming'", what="the answer")
    wait_until(driver, "return [...document.querySelectorAll('#turns > li:last-child .source img')]"
                       ".every(i => i.complete && i.naturalWidth > 0)", what="the cited page images")
    shown = driver.execute_script("""
        const t = document.querySelector('#turns > li:last-child');
        const text = (sel) => t.querySelector(sel)?.innerText ?? null;
        const answer = t.querySelector('.answer');
        return {state: t.dataset.state, answer: answer.textContent, busy: answer.ariaBusy,
                live: answer.getAttribute('aria-live'),
                sub_questions: [...t.querySelectorAll('.sub-questions li')].map(l => l.innerText),
                cache: text('.cache'), cached: text('.cached-image-tokens'), forwards: text('.vision-forwards'),
                badge: !!t.querySelector('.image-from-cache'), fill: t.querySelector('.bar .fill')?.style.width,
                segments: t.querySelectorAll('.stack .seg').length,
                legend: [...t.querySelectorAll('.legend li')].map(l => l.innerText),
                conversation: document.getElementById('conversation').innerText,
                image_chosen: !document.getElementById('image-chosen').hidden,
                alert: document.getElementById('alert').innerText};""")
    sources = driver.execute_script(SOURCES)
    for source in sources:
        source.update(driver.execute_script(RED_PIXELS, source.pop("img")))
    return {**shown, "sources": sources, "seen": driver.execute_script("return window.answerSeen")}


@pytest.fixture(scope="module")
async def asked(page, uploaded) -> dict:
    """QUESTION about DOC alone, with an image dropped on the page, asked from the keyboard (Ctrl+Enter)."""
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    image = base64.b64encode(question_png()).decode()

    def ask():
        Select(by_id(page, "scope")).select_by_value(uploaded["docId"])
        page.execute_script(DROP, by_id(page, "image-drop"), image, "chart.png")
        wait_until(page, "return !document.getElementById('image-chosen').hidden", what="the dropped image")
        page.execute_script(WATCH_ANSWER)
        question = by_id(page, "question")
        question.send_keys(QUESTION)
        question.send_keys(Keys.CONTROL, Keys.ENTER)
        return newest_answer(page)

    return await in_browser(ask)


async def test_the_answer_streams_in_after_its_sub_questions(asked):
    assert asked["state"] == "done" and asked["alert"] == "", asked["alert"]
    seen, final = asked["seen"], asked["answer"]
    assert final and asked["sub_questions"] == [QUESTION]
    kinds = [s[0] for s in seen]
    assert kinds.index("sub_questions") < kinds.index("sources") < kinds.index("text"), kinds
    partials = [s[1] for s in seen if s[0] == "text"]  # the text before each token was appended
    assert len(partials) >= 2 and partials[0] == "" and len(set(partials)) == len(partials), partials
    assert all(final.startswith(p) and len(p) < len(final) for p in partials)  # it grew, piece by piece, to this
    assert asked["live"] == "polite" and asked["busy"] == "false"


async def test_the_cited_pages_show_with_the_cited_figure_outlined_where_its_box_says(asked, http, uploaded,
                                                                                     api_server):
    # Retrieval reads the question's text alone: without the image the API cites the same pages.
    api = (await http.post("/v1/ask", headers=AUTH, json={"question": QUESTION, "docs": [uploaded["docId"]]})).json()
    cited = api["citations"]
    assert [c["figure"]["caption"] if c["figure"] else None for c in cited] == [CAPTION, None], cited
    sources = asked["sources"]
    assert len(sources) == len(cited) == 2
    for source, c in zip(sources, cited):
        assert source["loaded"], source
        assert source["caption"].split("\n")[:2] == [f"{DOC}, page {c['page']}", f"score {c['score']:.4f}"]
    on_figure, whole = sources
    assert on_figure["src"] == f"v1/pages/{cited[0]['page_id']}/image?figure=7"
    assert CAPTION in on_figure["caption"] and "outlined" in on_figure["alt"]
    scale = api_server["settings"].ingestion.pdf_dpi / 72  # the render's pixels per point
    assert (on_figure["width"], on_figure["height"]) == (round(612 * scale), round(792 * scale))  # the whole page
    box = FigureRegion(7, "figure", CAPTION, FIGURE_BOX, "raster").bbox_px(scale, (on_figure["width"],
                                                                                  on_figure["height"]))
    # Red only on the 3 px outline the server drew, exactly around the citation's box: drawn, and in place.
    assert on_figure["box"] == list(box) and on_figure["red"] > 3 * 2 * (box[2] - box[0]), on_figure
    assert whole["src"] == f"v1/pages/{cited[1]['page_id']}/image" and whole["red"] == 0
    assert "the page as a whole" in whole["caption"]


async def test_the_cache_panel_shows_image_tokens_from_the_cache_forwards_and_stage_timings(asked):
    cached, total = map(int, re.fullmatch(r"from cache: ([\d,]+) of ([\d,]+) image tokens",
                                          asked["cached"].replace(",", "")).groups())
    assert 0 <= cached <= total and total > 0
    assert float(asked["fill"].removesuffix("%")) == pytest.approx(100 * cached / total, abs=0.05)
    assert asked["forwards"] == "1" and not asked["badge"]  # a new image: encoded once, here
    assert "Question image: 100 tokens, encoded now (1 vision forward), kept for follow-ups." in asked["cache"]
    assert [item.split(" ")[0] for item in asked["legend"]] == ["decompose", "retrieve", "answer"]
    assert all(re.fullmatch(r"\w+ \d+\.\d+ s", item) for item in asked["legend"]), asked["legend"]
    assert asked["segments"] == len(asked["legend"])


# --- a follow-up in the conversation ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def followed(page, asked) -> dict:
    def follow_up():
        page.execute_script(WATCH_ANSWER)
        by_id(page, "question").send_keys(FOLLOW_UP)
        by_id(page, "ask-button").click()
        return newest_answer(page)

    return await in_browser(follow_up)


async def test_a_follow_up_reuses_the_conversation_and_shows_its_image_came_from_the_cache(asked, followed, http):
    conversation = re.search(r"Conversation ([\w-]+):", asked["conversation"]).group(1)
    assert not asked["image_chosen"]  # kept by the conversation: not sent again
    assert followed["state"] == "done" and followed["conversation"] == asked["conversation"]
    assert followed["forwards"] == "0" and followed["badge"], followed["cache"]
    cached, total = map(int, re.fullmatch(r"from cache: (\d+) of (\d+) image tokens",
                                          followed["cached"].replace(",", "")).groups())
    assert cached > 0, followed["cached"]
    assert "Question image: 100 tokens, from the cache: not sent or encoded again" in followed["cache"]
    # The id the page keeps is the server's: the API answers a follow-up on it from the image it holds.
    again = await http.post("/v1/ask", headers=AUTH, json={"question": FOLLOW_UP, "conversation_id": conversation})
    assert again.status_code == 200 and again.json()["usage"]["vision_encodes"] == 0, again.text


async def test_a_screenshot_of_the_session_is_saved_as_an_artefact(page, followed):
    out = Path(os.environ.get("MMRAG_TEST_ARTIFACTS") or REPO / "tests" / "artifacts")
    out.mkdir(parents=True, exist_ok=True)

    def shoot() -> bytes:
        page.execute_script("window.scrollTo(0, 0)")
        shot = page.execute_cdp_cmd("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        return base64.b64decode(shot["data"])

    png = await in_browser(shoot)
    (out / "ui.png").write_bytes(png)
    with Image.open(io.BytesIO(png)) as image:
        assert image.width >= 1300 and image.height >= 1000  # the window, less its scroll bar; the whole page
    if os.environ.get("MMRAG_UI_SCREENSHOT_TO_DOCS") == "1":
        (REPO / "docs").mkdir(exist_ok=True)
        shutil.copy(out / "ui.png", REPO / "docs" / "ui.png")


# --- accessibility --------------------------------------------------------------------------------------------------

# Every control has a label and every button a name; nothing but buttons, links and form fields is clickable.
CONTROLS = """
const named = (e) => (e.labels && e.labels.length) || e.getAttribute('aria-label') || e.getAttribute('aria-labelledby');
return {
  unlabelled: [...document.querySelectorAll('input, select, textarea, progress')].filter(e => !named(e))
    .map(e => e.outerHTML.slice(0, 80)),
  nameless: [...document.querySelectorAll('button')].filter(b => !(b.innerText.trim() || b.getAttribute('aria-label')))
    .map(b => b.outerHTML.slice(0, 80)),
  fake: [...document.querySelectorAll('[onclick], [role=button], div[tabindex], span[tabindex]')]
    .map(e => e.outerHTML.slice(0, 80)),
};
"""

# WCAG 2 contrast of every visible text against the background it is drawn on (the nearest opaque ancestor's).
CONTRAST = """
const rgb = (c) => c.match(/[\\d.]+/g).map(Number);
const linear = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
const lum = ([r, g, b]) => 0.2126 * linear(r) + 0.7152 * linear(g) + 0.0722 * linear(b);
const background = (e) => { for (; e; e = e.parentElement) { const c = rgb(getComputedStyle(e).backgroundColor);
                              if (c.length < 4 || c[3] > 0) return c.slice(0, 3); } return [255, 255, 255]; };
const low = [];
for (const e of document.querySelectorAll('body *')) {
  const own = [...e.childNodes].some(n => n.nodeType === 3 && n.data.trim());
  const style = getComputedStyle(e);
  if (!own || style.visibility === 'hidden' || !e.getClientRects().length) continue;
  const [a, b] = [lum(rgb(style.color)), lum(background(e))];
  const ratio = (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
  if (ratio < 4.5) low.push(`${e.tagName}.${e.className}: ${ratio.toFixed(2)} "${e.innerText.slice(0, 30)}"`);
}
return low;
"""


async def test_every_control_is_labelled_keyboard_operable_and_every_text_readable(page, followed):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    focused = ("const e = document.activeElement, s = getComputedStyle(e); "
               "return [e.id || e.innerText, e.matches(':focus-visible') && s.outlineStyle, s.outlineWidth]")

    def check():
        controls = page.execute_script(CONTROLS)
        low = page.execute_script(CONTRAST)
        # Tab from the key field walks the controls in reading order (Stop is disabled: not asking), each focus
        # shown; Shift+Tab from it reaches the skip link.
        by_id(page, "key").click()
        order = [page.execute_script(focused)]
        for _ in range(8):
            ActionChains(page).send_keys(Keys.TAB).perform()
            order.append(page.execute_script(focused))
        by_id(page, "key").click()
        ActionChains(page).key_down(Keys.SHIFT).send_keys(Keys.TAB).key_up(Keys.SHIFT).perform()
        return controls, low, order, page.execute_script(focused)

    controls, low, order, skip = await in_browser(check)
    assert controls == {"unlabelled": [], "nameless": [], "fake": []}, controls
    assert low == [], low
    assert [name for name, _, _ in order] == ["key", "Use key", "key-forget", "question", "image", "tier", "scope",
                                              "ask-button", "new-conversation"], order
    assert all(style == "solid" and float(width.removesuffix("px")) >= 2 for _, style, width in order[1:]), order
    assert skip[:2] == ["Skip to the question", "solid"], skip


# --- delete, after a confirmation ---------------------------------------------------------------------------------


async def test_deleting_a_document_asks_first_and_cancel_keeps_it(page, uploaded, followed, http):
    doc_id = uploaded["docId"]
    row = f"#document-rows tr[data-doc-id='{doc_id}']"

    def cancel_then_delete():
        from selenium.webdriver.common.by import By

        page.find_element(By.CSS_SELECTOR, f"{row} button").click()
        asked = page.execute_script("const d = document.getElementById('confirm-delete'); "
                                    "return [d.open, document.getElementById('confirm-text').innerText, "
                                    "document.activeElement.id]")
        by_id(page, "confirm-cancel").click()
        kept = page.execute_script("return [document.getElementById('confirm-delete').open, "
                                   f"!!document.querySelector(\"{row}\")]")
        page.find_element(By.CSS_SELECTOR, f"{row} button").click()
        by_id(page, "confirm-yes").click()
        wait_until(page, f"return !document.querySelector(\"{row}\")", what="the row to go")
        status = wait_until(page, "const s = document.getElementById('documents-status').innerText; "
                                  "return s.startsWith('Deleted') && s", what="the deletion's status")
        return asked, kept, status

    asked, kept, status = await in_browser(cancel_then_delete)
    assert asked[0] and f"{DOC} and its 2 indexed pages leave the index" in asked[1], asked
    assert asked[2] == "confirm-cancel"  # the safe choice has the focus
    assert kept == [False, True]  # cancelled: the dialog closed, the document still there
    assert status == f"Deleted {DOC}: 2 pages left the index."
    docs = (await http.get("/v1/documents", params={"limit": 1000}, headers=AUTH)).json()["documents"]
    assert doc_id not in {d["doc_id"] for d in docs}
