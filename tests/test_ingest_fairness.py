"""Ingest jobs are served fairly between tenants, and a deletion waits for no other tenant (issue 24, items 3
and 5): jobs queue per tenant and are taken round-robin; DELETE runs apart from the ingest workers, which lease
each page's feature keys until the page is indexed, so the deletion cannot take tokens an ingest still needs;
entries a deletion kept because a lease held them go once no lease holds them and no page references them.

The server is the session engine's (nothing here asks a question) over a data dir, index and feature store of
its own, with OCR on: tenant b's long job is a 2000x2000 page of text, which tesseract reads for several
seconds (the probe's 7000x7000 pages took 18 s each)."""

from __future__ import annotations

import io
import random
import threading
import uuid

import httpx
import pytest
from hypothesis import given
from hypothesis import settings as examples
from hypothesis import strategies as st
from PIL import Image, ImageDraw, ImageFont

from mmrag.adapters.store import StoreLease
from mmrag.core.keys import ImageKey, Tiers
from mmrag.core.scope import TenantScope
from ingestion.pipeline import IngestReport
from serving.api.tenants import add_key
from serving.ingest_jobs import FairQueue, IngestJobs, Job, JobStore
from tests.conftest import serving
from tests.waiting import eventually, ingest_finished

FINISHED = ("done", "failed", "cancelled")


def _text_page(side: int) -> bytes:
    """A page of random words, new to every store: OCR takes ~1.6 s at 1400 px and ~3 s at 2000 px here."""
    image = Image.new("RGB", (side, side), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=28)
    rnd = random.Random(uuid.uuid4().int)
    for i in range((side - 40) // 36):
        words = " ".join(uuid.UUID(int=rnd.getrandbits(128)).hex[:rnd.randint(3, 9)] for _ in range(side // 120))
        draw.text((20, 20 + i * 36), words, fill="black", font=font)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
async def fair_server(engine_settings, ingested, inprocess_engine, tmp_path_factory):
    from mmrag import wiring

    data = tmp_path_factory.mktemp("fairness-data")
    tenants_file = data / "tenants.json"
    keys = {t: add_key(tenants_file, t) for t in ("a", "b")}
    settings = engine_settings.replace(**{
        "data_dir": data, "tenants_file": tenants_file, "api_key": "", "warm_top": 0, "ocr": True,
        "ingest_workers": 1, "delete_retry_s": 0.5,
    })
    store = wiring.feature_store(settings)  # its own: what deletions here remove is no other test's
    app = wiring.create_app(settings, engine=inprocess_engine, store=store)
    async with serving(app) as url:
        clients = {t: httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {k}"}, timeout=120)
                   for t, k in keys.items()}
        try:
            yield {"http": clients, "store": store, "app": app, "settings": settings}
        finally:
            for client in clients.values():
                await client.aclose()


async def _upload(http: httpx.AsyncClient, name: str, body: bytes) -> dict:
    r = await http.post("/v1/documents", files={"file": (name, body, "image/png")})
    assert r.status_code == 202, r.text
    return r.json()


async def _job(http: httpx.AsyncClient, job_id: str) -> dict:
    return (await http.get(f"/v1/ingest/{job_id}")).json()


async def _running(http: httpx.AsyncClient, job_id: str) -> dict:
    """The job once it runs (120 s: a hang guard, not a speed check)."""

    async def running() -> dict:
        job = await _job(http, job_id)
        assert job["status"] == "running", job
        return job

    return await eventually(running, timeout=120, what=f"ingest job {job_id} running")


async def _ingested(http: httpx.AsyncClient, name: str, body: bytes) -> dict:
    out = await _upload(http, name, body)
    job = await ingest_finished(http, out["job"]["id"], timeout=120)
    assert job["status"] == "done" and job["report"]["pages"] == 1, job
    doc = next(d for d in (await http.get("/v1/documents")).json()["documents"] if d["doc_id"] == out["doc_id"])
    page = (await http.get(f"/v1/pages/{doc['pages'][0]['page_id']}")).json()
    return {**out, "key": ImageKey.parse(page["image_key"])}


def _finished(jobs: IngestJobs, job_id: str, tenant: str = "default", *, timeout: float = 30) -> Job:
    """The job once finished: woken by the jobs' own condition, which each status change to a finished one
    notifies (``timeout`` is a hang guard only)."""
    with jobs._lock:
        assert jobs._lock.wait_for(lambda: jobs.get(job_id, tenant).status in FINISHED, timeout=timeout), \
            jobs.get(job_id, tenant)
    return jobs.get(job_id, tenant)


def _job_of(tenant: str, n: int) -> Job:
    return Job(id=f"{tenant}{n}", paths=[], recursive=False, tenant=tenant, submitted_at=float(n))


def test_queued_jobs_are_taken_round_robin_across_tenants_and_in_order_within_one():
    queue = FairQueue()
    for n in range(1, 5):
        queue.put(_job_of("b", n))
    assert queue.take().id == "b1"  # b's first job runs alone
    queue.put(_job_of("a", 5))  # a's one job arrives while b's other three wait
    assert [queue.take().id for _ in range(2)] == ["a5", "b2"]
    for job in (_job_of("c", 6), _job_of("a", 7), _job_of("a", 8)):
        queue.put(job)
    cancelled = _job_of("c", 9)
    queue.put(cancelled)
    queue.discard(cancelled)
    # c was never served, then a and b in the order they were last served; each tenant's own jobs in order.
    assert [queue.take().id for _ in range(5)] == ["c6", "a7", "b3", "a8", "b4"]
    assert queue.take() is None


@examples(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c", "take"]), max_size=60))
def test_no_tenant_is_served_twice_while_another_waits_and_each_tenants_jobs_keep_their_order(ops):
    queue, put, taken = FairQueue(), {}, {}
    served_since: dict[str, set[str]] = {}  # tenant waiting -> tenants served since it began waiting or was served
    for n, op in enumerate(ops):
        if op != "take":
            if put.get(op, 0) == taken.get(op, 0):
                served_since[op] = set()
            queue.put(_job_of(op, n))
            put[op] = put.get(op, 0) + 1
            continue
        job = queue.take()
        if job is None:
            assert put == taken
            continue
        u = job.tenant
        assert job.id == f"{u}{[i for i, o in enumerate(ops) if o == u][taken.get(u, 0)]}"  # FIFO within u
        taken[u] = taken.get(u, 0) + 1
        for t, since in served_since.items():
            if t != u and put.get(t, 0) > taken.get(t, 0):
                assert u not in since, (t, u, ops[:n + 1])  # u went twice while t waited
                since.add(u)
        served_since[u] = set()


async def test_a_delete_does_not_wait_for_another_tenants_ingest_and_a_new_tenants_job_goes_next(fair_server):
    """Issue 24's probe, cheaper: b queues a long OCR job and three more; a's DELETE answers while b's first job
    still runs (it waited for all four of b's jobs before), and a's one-page upload runs before b's other three
    (it ran after all of them): right after that job, or between two of its batches."""
    a, b = fair_server["http"]["a"], fair_server["http"]["b"]
    mine = await _ingested(a, "mine.png", _text_page(448))
    theirs = [await _upload(b, "long.png", _text_page(2000))]
    theirs += [await _upload(b, f"queued-{i}.png", _text_page(448)) for i in range(3)]
    await _running(b, theirs[0]["job"]["id"])

    deleted = await a.delete(f"/v1/documents/{mine['doc_id']}")
    assert deleted.status_code == 200 and deleted.json() == {"doc_id": mine["doc_id"], "doc": "mine.png", "pages": 1}
    assert (await _job(b, theirs[0]["job"]["id"]))["status"] == "running"  # not behind b's ingest
    upload = await _upload(a, "next.png", _text_page(448))
    assert [(await _job(b, t["job"]["id"]))["status"] for t in theirs[1:]] == ["queued"] * 3

    ours = await ingest_finished(a, upload["job"]["id"], timeout=120)
    jobs = [await ingest_finished(b, t["job"]["id"], timeout=120) for t in theirs]
    assert ours["status"] == "done" and all(j["status"] == "done" for j in jobs), (ours, jobs)
    # One worker: a's job runs before b's queued ones, and (issue 41) between two batches of b's running job when
    # it comes before that job's last batch ends, so it finishes before or right after b0.
    order = [name for name, _ in sorted([("a", ours["finished_at"])] + [(f"b{i}", j["finished_at"])
                                                                        for i, j in enumerate(jobs)],
                                        key=lambda x: x[1])]
    assert order in (["b0", "a", "b1", "b2", "b3"], ["a", "b0", "b1", "b2", "b3"]), order


async def test_a_delete_waits_for_its_own_tenants_job_on_that_document(fair_server):
    """Asked while its own upload is still being ingested, a DELETE runs after that job: the job cannot add the
    pages back after the deletion answered (without the wait it would answer 404, then the page would appear)."""
    a = fair_server["http"]["a"]
    out = await _upload(a, "fresh.png", _text_page(1400))
    deleted = await a.delete(f"/v1/documents/{out['doc_id']}")
    assert deleted.status_code == 200 and deleted.json()["pages"] == 1, deleted.text
    assert (await _job(a, out["job"]["id"]))["status"] == "done"
    assert out["doc_id"] not in {d["doc_id"] for d in (await a.get("/v1/documents")).json()["documents"]}


async def test_entries_kept_while_leased_go_once_the_lease_ends_unless_a_page_references_them_again(fair_server):
    a, b, store = fair_server["http"]["a"], fair_server["http"]["b"], fair_server["store"]
    jobs = fair_server["app"].state.services.jobs.jobs
    shown, alone = _text_page(448), _text_page(448)
    first, second = await _ingested(a, "shown.png", shown), await _ingested(a, "alone.png", alone)
    answer = StoreLease(store, "answer", 60)  # what a running answer over both pages holds
    assert answer.take({first["key"], second["key"]}) == set()
    for doc in (first, second):
        r = await a.delete(f"/v1/documents/{doc['doc_id']}")
        assert r.status_code == 200 and r.json()["pages"] == 1, r.text
    assert store.contains(first["key"]) and store.contains(second["key"]) and jobs.deferred == 2

    again = await _ingested(b, "shown.png", shown)  # another tenant indexes the first page meanwhile
    answer.end()
    # Retried on the timer (MMRAG_DELETE_RETRY_S, 0.5 s here); 10 s is a hang guard.
    await eventually(lambda: jobs.deferred == 0, timeout=10, what="no entry deferred")
    assert not store.contains(second["key"])  # nothing references it any more: gone
    assert store.contains(first["key"])  # b's page references it: kept, and no longer deferred
    r = await b.delete(f"/v1/documents/{again['doc_id']}")
    assert r.status_code == 200 and not store.contains(first["key"])


async def test_an_ingest_leases_its_pages_keys_until_the_pages_are_indexed(fair_server, tmp_path, tiny_model):
    """A deletion that runs between a page's tokens being stored and the page being indexed finds them leased
    and keeps them (before, only running deletions on the ingest thread prevented it); the lease ends with the
    file."""
    from mmrag.adapters.vision import VisionEncoder
    from mmrag import wiring

    settings = fair_server["settings"].replace(**{"data_dir": tmp_path, "tenants_file": None, "ocr": False})
    store = wiring.feature_store(settings)
    embedder = fair_server["app"].state.services.pipeline.searcher.text_embedder
    ingestor = wiring.ingestor(settings, store=store, text=embedder, image=None,
                               encoder=VisionEncoder(tiny_model, settings.vision.resolution_policy))
    page = tmp_path / "page.png"
    page.write_bytes(_text_page(448))
    seen: list[tuple[ImageKey, bool, int]] = []

    def between_batches(files_done: int, files_total: int, pages_done: int) -> None:
        if files_done == 0:  # after the batch: stored, not yet indexed
            seen.extend((k, store.leased(k), store.delete(k)) for k in store.keys())

    try:
        report = ingestor.run([page], progress=between_batches)
        assert report.failed == [] and report.pages == 1 and report.encoded == 1
        [(key, leased, freed)] = seen
        assert leased and freed == 0  # the deletion found it leased and kept it
        assert store.contains(key) and not store.leased(key)  # indexed now; the lease ended with the file
        assert [p.image_key for p in ingestor.index.pages()] == [key]
    finally:
        ingestor.index.client.close()


GATE_GUARD_S = 60.0  # a gated batch waits this long at most for the test to let it run: a hang guard


class _BatchedIngestor:
    """Stands in for the ingest pipeline (tested for real above): ``batches`` batches, calling ``progress``
    between them as Ingestor.run does. A ``gated`` one runs each batch only once the test lets it (:meth:`let`),
    so the test knows where the job is, on any machine: no batch takes time of its own."""

    def __init__(self, batches: int, *, gated: bool = False) -> None:
        self.batches = batches
        self.started, self.returned = threading.Event(), threading.Event()
        self.progressed = 0  # progress calls made
        self._gate = threading.Semaphore(0) if gated else None

    def let(self, batches: int) -> None:
        """Let ``batches`` more batches run."""
        self._gate.release(batches)

    def run(self, paths, *, recursive, root, progress) -> IngestReport:
        self.started.set()
        try:
            for i in range(self.batches):
                if self._gate is not None:
                    assert self._gate.acquire(timeout=GATE_GUARD_S), "the test never let the next batch run"
                self.progressed += 1
                progress(0, 1, i + 1)
            return IngestReport(files=1, pages=self.batches)
        finally:
            self.returned.set()


def test_a_job_running_at_shutdown_stops_at_its_next_batch_and_resumes_at_the_next_start(tmp_path):
    scope = TenantScope(tenant="default", collection="pages", cache_salt="", root=tmp_path, uploads=tmp_path / "up")
    state = tmp_path / "jobs.sqlite3"

    def start(ingestor: _BatchedIngestor) -> IngestJobs:
        return IngestJobs(lambda tenant: scope, lambda tenant, tiers: ingestor, state=state, make_index=None,
                          store=None, referenced=None, tiers=Tiers({}))

    (tmp_path / "doc.pdf").write_bytes(b"%PDF-")
    first = _BatchedIngestor(batches=1000, gated=True)
    jobs = start(first)
    job = jobs.submit(["doc.pdf"], recursive=False)
    assert first.started.wait(10)
    jobs.shutdown()
    first.let(1000)  # all of its batches may run now
    assert first.returned.wait(GATE_GUARD_S)
    assert first.progressed == 1  # it stopped at its next batch, not after its 1000 batches
    db = JobStore(state)
    [stored] = db.load()
    db.close()
    assert stored.status == "running"  # what the next start resumes

    second = _BatchedIngestor(batches=2)
    jobs = start(second)
    try:
        resumed = _finished(jobs, job.id, timeout=10)
        assert resumed.status == "done", resumed
        assert resumed.resumed == 1 and resumed.report["pages"] == 2
    finally:
        jobs.shutdown()


def test_finished_jobs_past_the_kept_count_are_forgotten_and_unfinished_ones_never(tmp_path):
    """Issue 41: the job list grew without bound. A tenant's finished jobs past MMRAG_INGEST_JOBS_KEPT are
    forgotten, oldest first, in memory and in the job store, at each finish and at start-up."""
    scope = TenantScope(tenant="default", collection="pages", cache_salt="", root=tmp_path, uploads=tmp_path / "up")
    state = tmp_path / "jobs.sqlite3"
    (tmp_path / "doc.pdf").write_bytes(b"%PDF-")

    def start(ingestor: _BatchedIngestor, keep: int) -> IngestJobs:
        return IngestJobs(lambda tenant: scope, lambda tenant, tiers: ingestor, state=state, make_index=None,
                          store=None, referenced=None, tiers=Tiers({}), keep=keep)

    jobs = start(_BatchedIngestor(batches=1), keep=2)
    try:
        submitted = [jobs.submit(["doc.pdf"], recursive=False) for _ in range(4)]
        _finished(jobs, submitted[-1].id)  # one worker: they finish in order
        listed, total = jobs.list(limit=10, offset=0)
        assert total == 2 and [j.id for j in listed] == [j.id for j in submitted[:1:-1]]
        assert jobs.get(submitted[0].id) is None and jobs.get(submitted[1].id) is None
    finally:
        jobs.shutdown()
    db = JobStore(state)
    assert [j.id for j in db.load()] == [j.id for j in submitted[2:]]
    db.close()

    long = _BatchedIngestor(batches=1000, gated=True)  # running until the end: no batch of it is let run
    jobs = start(long, keep=1)  # at start-up: the older of the two finished goes
    try:
        assert [j.id for j in jobs.list(limit=10, offset=0)[0]] == [submitted[-1].id]
        running = jobs.submit(["doc.pdf"], recursive=False)
        assert long.started.wait(10)
        queued = jobs.submit(["doc.pdf"], recursive=False)
        assert {j.id for j in jobs.list(limit=10, offset=0)[0]} == {submitted[-1].id, running.id, queued.id}
    finally:
        jobs.shutdown()
        long.let(1)  # its next batch: the shutdown stops it there


def test_another_tenants_job_runs_between_two_batches_of_a_long_one(tmp_path):
    """Issue 41: one worker, tenant b's job of 1000 batches running; a's one-batch job, submitted then, runs at
    b's next batch boundary and is done while b's is still running (it used to wait for all of b's 1000)."""
    scopes = {t: TenantScope(tenant=t, collection=f"pages-{t}", cache_salt=t, root=tmp_path, uploads=tmp_path / t)
              for t in ("a", "b", "default")}
    ingestors = {"a": _BatchedIngestor(batches=1), "b": _BatchedIngestor(batches=1000, gated=True)}
    (tmp_path / "doc.pdf").write_bytes(b"%PDF-")
    jobs = IngestJobs(scopes.__getitem__, lambda tenant, tiers: ingestors[tenant], state=tmp_path / "jobs.sqlite3",
                      make_index=None, store=None, referenced=None, tiers=Tiers({}))
    try:
        long = jobs.submit(["doc.pdf"], recursive=False, tenant="b")
        assert ingestors["b"].started.wait(10)
        short = jobs.submit(["doc.pdf"], recursive=False, tenant="a")
        ingestors["b"].let(1)  # b's next batch: at its end, before b's batch after it, a's job runs
        _finished(jobs, short.id, "a")
        assert jobs.get(short.id, "a").status == "done" and jobs.get(short.id, "a").report["pages"] == 1
        assert jobs.get(long.id, "b").status == "running" and not ingestors["b"].returned.is_set()
        assert jobs.get(long.id, "b").progress["pages_done"] < 1000
        assert ingestors["b"].progressed == 1  # at b's first batch boundary since a's job was queued
    finally:
        jobs.shutdown()
        ingestors["b"].let(1)  # its next batch: the shutdown stops it there
