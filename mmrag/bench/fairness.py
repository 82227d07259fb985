"""`mmrag bench --fairness`: what one tenant's load and bad inputs cost another (issue 41), in one run.

One `mmrag serve` (a child process, its settings at their defaults but for the model and the answer length) on
one `vllm serve` replica, with two tenants in its tenants file: **A**, who asks one question every
``a_every_s`` seconds, as a person does, and **B**, who does what the issue's hostile tenant did. Each phase
measures A beside B against A alone, on the same server:

- **questions**: A alone, then A while B runs ``b_loops`` concurrent question loops for ``flood_s`` seconds (a
  loop asks again as soon as it is answered, and after the Retry-After of a 429). A's latency p50 (target: within
  3x of alone), A's admission wait from each answer's ``timings.admission_s`` (target: p99 <= 0.1 s) and A's
  refusals (target: none).
- **ingest**: B uploads a PDF of ``pdf_pages`` pages sharing one content stream of ``pdf_paths`` tiny paths
  (the issue's 741 KB file); once B's job runs, A uploads a one-page document: seconds until A's is indexed
  (target: 10 s); then B's job is cancelled: seconds until it stops.
- **renders**: B requests ``render_loops`` page images at once, again and again, each a new box of a page whose
  ``slow_render_paths`` overlapping filled triangles take seconds to render; A's own page image, a new box each
  time (target: within 1 s), against A's alone.
- **memory**: the API process's peak resident memory (VmHWM, reset between phases through
  ``/proc/PID/clear_refs``) over its idle size, per phase and per bad input kind (an image past the processor's
  aspect ratio, a multi-frame TIFF, tiny files declaring huge sizes), asked about and ingested; the bound the
  docs state, ``MEMORY_BOUND_MIB``, checked for each.

The files are made here (:func:`pathological_pdf`, :func:`slow_render_pdf`, :func:`bad_inputs`); nothing is
downloaded. A tesseract run is a process of its own: its memory is not the API process's.
"""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from PIL import Image

from mmrag.bench.corpus import BenchCorpus
from mmrag.bench.e2e import E2EError, delta, scrape, start_mmrag_serve
from mmrag.devkit.ports import free_port
from serving.api.tenants import add_key
from serving.engine.config import EngineConfig
from serving.vllm_launch import start_dev_replica as start_replica

# The API process's peak resident memory over its idle size, for any one input or phase below: the decoded
# pixels in flight (MMRAG_MAX_PIXELS_IN_FLIGHT, 200M pixels ~ 600 MB of RGB) and one ingest batch's pages (at most
# MMRAG_MAX_IMAGE_PIXELS), with room for the allocator. docs/benchmarks.md and README state it; the run checks each peak.
MEMORY_BOUND_MIB = 1536
TARGETS = {"a_latency_ratio": 3.0, "a_admission_wait_p99_s": 0.1, "a_refused": 0, "a_upload_indexed_s": 10.0,
           "a_render_s": 1.0, "memory_over_idle_mib": MEMORY_BOUND_MIB}


@dataclass(slots=True, frozen=True)
class FairnessSpec:
    b_loops: int = 200
    flood_s: float = 45.0
    a_every_s: float = 2.0
    a_alone: int = 8  # A's questions alone, at its own pace
    answer_tokens: int = 32
    pdf_pages: int = 500
    pdf_paths: int = 200_000
    slow_render_paths: int = 20_000
    render_loops: int = 8
    a_renders: int = 6
    tiff_frames: int = 8  # of 7000x7000 1-bit: the issue's 60 took minutes of OCR, the memory is one frame's
    seed: int = 0


QUICK = FairnessSpec(b_loops=40, flood_s=12.0, a_alone=4, answer_tokens=8, pdf_pages=40, pdf_paths=40_000,
                     slow_render_paths=6_000, render_loops=6, a_renders=3, tiff_frames=2)


@dataclass(slots=True)
class FairnessInputs:
    model_path: Path
    corpus: BenchCorpus
    engine_config: EngineConfig
    spec: FairnessSpec
    root: Path  # emptied first: data/, logs/, tenants.json
    log: Callable[[str], None]


# --- the inputs ------------------------------------------------------------------------------------------------


def _pdf(contents: list[bytes], page_contents: list[int], size: tuple[int, int] = (612, 792)) -> bytes:
    """A PDF whose page i draws content stream ``page_contents[i]`` (Flate-compressed): pages may share one."""
    n_streams, n_pages = len(contents), len(page_contents)
    first_page = 3 + n_streams
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               b"<< /Type /Pages /Kids [%s] /Count %d >>" % (
                   b" ".join(b"%d 0 R" % (first_page + i) for i in range(n_pages)), n_pages)]
    for ops in contents:
        packed = zlib.compress(ops, 6)
        objects.append(b"<< /Length %d /Filter /FlateDecode >>\nstream\n%s\nendstream" % (len(packed), packed))
    for c in page_contents:
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 %d %d] /Resources << >> /Contents %d 0 R >>"
                       % (*size, 3 + c))
    out = io.BytesIO()
    out.write(b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for i, body in enumerate(objects, 1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n%s\nendobj\n" % (i, body))
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    out.write(b"".join(b"%010d 00000 n \n" % o for o in offsets))
    out.write(b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref))
    return out.getvalue()


def pathological_pdf(pages: int, paths: int) -> bytes:
    """The issue's PDF: ``pages`` pages sharing one content stream of ``paths`` tiny filled squares (200,000
    and 500 pages: ~0.8 MB). Cheap to render, millions of drawing objects to walk."""
    ops = "\n".join(f"{20 + k * 7919 % 560} {20 + k * 104729 % 750} 0.6 0.6 re f" for k in range(paths))
    return _pdf([ops.encode()], [0] * pages)


def slow_render_pdf(pages: int, paths: int) -> bytes:
    """Pages of ``paths`` large overlapping grey triangles each (a stream per page): seconds to rasterise."""
    streams = []
    for p in range(pages):
        ops = (f"q 0.{(k + p) % 9} g {20 + k * 7919 % 540} {20 + k * 104729 % 730} m {100 + k % 400} "
               f"{700 - k % 600} l 300 {k % 700} l f Q" for k in range(paths))
        streams.append("\n".join(ops).encode())
    return _pdf(streams, list(range(pages)))


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def bad_inputs(tiff_frames: int) -> dict[str, tuple[str, bytes]]:
    """The issue's inputs the processor cannot take as they are, or that declare far more than their bytes:
    name -> (file name, bytes)."""
    def tiff(frames: int) -> bytes:
        buf = io.BytesIO()
        first = Image.new("1", (7000, 7000), 1)
        first.save(buf, format="TIFF", compression="group4", save_all=True,
                   append_images=[Image.new("1", (7000, 7000), 1) for _ in range(frames - 1)])
        return buf.getvalue()

    webp = io.BytesIO()
    Image.new("RGB", (16383, 3000), "white").save(webp, format="WEBP", lossless=True)
    return {"aspect 1x10000 png": ("tall.png", _png(Image.new("RGB", (1, 10000), "black"))),
            "aspect 20000x2 png": ("wide.png", _png(Image.new("RGB", (20000, 2), "black"))),
            "tiff 7000x7000 1-bit": ("blank.tif", tiff(1)),
            f"tiff {tiff_frames} frames 7000x7000 1-bit": ("frames.tif", tiff(tiff_frames)),
            "webp 16383x3000": ("wide.webp", webp.getvalue())}


# --- the API process's memory ----------------------------------------------------------------------------------


def memory_mib(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM (the peak since start or the last reset) of ``pid``, in MiB."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) / 1024
    return values


def reset_peak(pid: int) -> bool:
    """VmHWM back to the current VmRSS (Linux: ``5`` to /proc/PID/clear_refs); False where that is refused."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class PeakWatch:
    """The peak over a phase: VmHWM after a reset, or (where resets are refused) VmRSS sampled every 0.2 s."""

    def __init__(self, pid: int) -> None:
        self.pid, self.resets = pid, False  # reset as the phase begins (__aenter__)
        self.sampled = 0.0
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> PeakWatch:
        self.resets = reset_peak(self.pid)
        self.start = self.sampled = memory_mib(self.pid)["VmRSS"]

        async def sample() -> None:
            while True:
                self.sampled = max(self.sampled, memory_mib(self.pid)["VmRSS"])
                await asyncio.sleep(0.2)

        self._task = asyncio.create_task(sample())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        now = memory_mib(self.pid)
        self.peak = max(self.sampled, now["VmHWM"] if self.resets else now["VmRSS"])


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of ``pid`` and every process below it (a replica's EngineCore is its child)."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry.name)] = fields
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        if p in stats:
            total += (int(stats[p][11]) + int(stats[p][12])) / tick  # utime, stime
        todo.extend(children.get(p, []))
    return total


# What the replica did in a phase: its requests' mean queue, prefill and decode time and time per output token
# (vLLM's own histograms), the tokens it took and made, and where the two cores went (the API process, the
# replica and its EngineCore).
_PROFILED = ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
             "vllm:request_decode_time_seconds", "vllm:time_per_output_token_seconds")
_COUNTED = ("vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total")
# ... and what mmrag's scheduler did in front of it: plans sent, their wait there, and how often a plan was held
# back to keep slots free for the other tenant (serving/scheduler.py TenantSlots).
_SCHEDULED = ("mmrag_queue_wait_seconds", "mmrag_scheduler_dispatched_total", "mmrag_scheduler_kept_held_total")


class Profile:
    def __init__(self, s: Server) -> None:
        self.s = s

    async def __aenter__(self) -> Profile:
        self.before = await scrape(self.s.control, self.s.replica_url)
        self.before_api = await scrape(self.s.control, self.s.url)
        self.cpu = (cpu_seconds(self.s.pid), cpu_seconds(self.s.replica_pid))
        self.t = time.perf_counter()
        return self

    async def __aexit__(self, *exc) -> None:
        wall = time.perf_counter() - self.t
        api, replica = cpu_seconds(self.s.pid) - self.cpu[0], cpu_seconds(self.s.replica_pid) - self.cpu[1]
        d = delta(self.before, await scrape(self.s.control, self.s.replica_url), _PROFILED + _COUNTED)
        d |= delta(self.before_api, await scrape(self.s.control, self.s.url), _SCHEDULED)

        def mean(name: str, scale: float = 1.0) -> float | None:
            n = d[f"{name}_count"]
            return round(d[f"{name}_sum"] / n * scale, 4) if n else None

        self.result = {
            "wall_s": round(wall, 1), "engine_requests": int(d["vllm:request_success_total"]),
            "queue_mean_s": mean("vllm:request_queue_time_seconds"),
            "prefill_mean_s": mean("vllm:request_prefill_time_seconds"),
            "decode_mean_s": mean("vllm:request_decode_time_seconds"),
            "time_per_output_token_ms": mean("vllm:time_per_output_token_seconds", 1000),
            "prompt_tokens_per_s": round(d["vllm:prompt_tokens_total"] / wall, 1),
            "generated_tokens_per_s": round(d["vllm:generation_tokens_total"] / wall, 1),
            "scheduler": {"plans": int(d["mmrag_scheduler_dispatched_total"]),
                          "wait_mean_s": mean("mmrag_queue_wait_seconds"),
                          "held_for_another_tenant": int(d["mmrag_scheduler_kept_held_total"])},
            "cores_used": {"api_process": round(api / wall, 2), "replica": round(replica / wall, 2)}}


# --- the two tenants -------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Asked:
    status: int
    seconds: float
    admission_s: float | None = None
    error: str | None = None
    stages: dict[str, float] = field(default_factory=dict)  # the answer's timings: where its time went
    retry_after_s: float = 0.0  # a 429's Retry-After (at most 5 s: B's loops retry then)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


def summarize_asks(asked: list[Asked]) -> dict[str, Any]:
    ok = [a for a in asked if a.status == 200]
    waits = [a.admission_s for a in ok if a.admission_s is not None]
    return {"asked": len(asked), "answered": len(ok), "refused": sum(a.status == 429 for a in asked),
            "errors": sum(a.status not in (200, 429) for a in asked),
            "latency_p50_s": _percentile([a.seconds for a in ok], 0.5),
            "latency_max_s": _percentile([a.seconds for a in ok], 1.0),
            "admission_wait_p50_s": _percentile(waits, 0.5), "admission_wait_p99_s": _percentile(waits, 0.99),
            "stages_p50_s": {stage: _percentile([a.stages[stage] for a in ok if stage in a.stages], 0.5)
                             for stage in dict.fromkeys(k for a in ok for k in a.stages)},
            "first_errors": [a.error for a in asked if a.error][:3]}


async def ask(http: httpx.AsyncClient, question: str) -> Asked:
    t = time.perf_counter()
    try:
        r = await http.post("/v1/ask", json={"question": question})
    except httpx.TransportError as exc:  # counted, as a user would see it
        return Asked(0, time.perf_counter() - t, error=f"{type(exc).__name__}: {exc}")
    took = time.perf_counter() - t
    if r.status_code != 200:
        return Asked(r.status_code, took, error=r.text[:300],
                     retry_after_s=min(float(r.headers.get("Retry-After", 1)), 5.0))
    timings = r.json().get("timings") or {}
    return Asked(200, took, timings.get("admission_s"), stages=timings)


async def paced(n: int | None, every_s: float, until: float | None, act: Callable[[int], Awaitable[Asked]]
                ) -> list[Asked]:
    """A person's pace: ``act(i)`` one at a time, the next ``every_s`` after the previous began (at once when it
    took longer), ``n`` times or until ``until`` (perf_counter)."""
    done, i = [], 0
    while (n is None or i < n) and (until is None or time.perf_counter() < until):
        began = time.perf_counter()
        done.append(await act(i))
        i += 1
        await asyncio.sleep(max(0.0, every_s - (time.perf_counter() - began)))
    return done


async def upload(http: httpx.AsyncClient, name: str, body: bytes) -> dict:
    r = await http.post("/v1/documents", files={"file": (name, body)})
    if r.status_code != 202:
        raise E2EError(f"uploading {name} answered {r.status_code}: {r.text[:300]}")
    return r.json()


async def until_status(http: httpx.AsyncClient, job_id: str, statuses: tuple[str, ...], within_s: float,
                       every_s: float = 0.05) -> dict:
    deadline = time.perf_counter() + within_s
    while True:
        job = (await http.get(f"/v1/ingest/{job_id}")).json()
        if job["status"] in statuses:
            return job
        if time.perf_counter() > deadline:
            raise E2EError(f"ingest job {job_id} still {job['status']} after {within_s:.0f} s: {job}")
        await asyncio.sleep(every_s)


async def ingested(http: httpx.AsyncClient, name: str, body: bytes, within_s: float = 1800) -> dict:
    """Uploaded and indexed (or failed, for a bad input: its report says why); the job as the API reports it."""
    job = await until_status(http, (await upload(http, name, body))["job"]["id"], ("done", "failed", "cancelled"),
                             within_s, every_s=0.25)
    return job


async def page_ids(http: httpx.AsyncClient) -> dict[str, list[str]]:
    docs = (await http.get("/v1/documents", params={"limit": 1000})).json()["documents"]
    return {d["doc"]: [p["page_id"] for p in d["pages"]] for d in docs}


# --- the run ---------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Server:
    url: str
    pid: int
    a: httpx.AsyncClient
    b: httpx.AsyncClient
    control: httpx.AsyncClient  # the replica's metrics
    replica_url: str
    replica_pid: int
    idle_mib: float = 0.0
    phases: dict[str, dict] = field(default_factory=dict)


def _env(inputs: FairnessInputs, replica_url: str, tenants_file: Path) -> dict[str, str]:
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("MMRAG_") or k == "MMRAG_EMULATE_ISA"}
    config = inputs.engine_config
    return {**inherited, "MMRAG_DATA_DIR": str(inputs.root / "data"), "MMRAG_MODEL": str(inputs.model_path),
            "MMRAG_ENGINE_URLS": replica_url, "MMRAG_TENANTS_FILE": str(tenants_file), "MMRAG_API_KEY": "",
            "MMRAG_MAX_MODEL_LEN": str(config.max_model_len),
            "MMRAG_MAX_IMAGES_PER_PROMPT": str(config.max_images_per_prompt),
            # mmrag's scheduler sends the replica as many plans as it runs at once, no more: the rest wait in the
            # scheduler's fair queue (the tenant with the fewest plans in flight first), not in vLLM's FIFO one.
            "MMRAG_MAX_NUM_SEQS": str(config.max_num_seqs), "MMRAG_MAX_CONCURRENCY": str(config.max_num_seqs),
            "MMRAG_ANSWER_MAX_TOKENS": str(inputs.spec.answer_tokens), "MMRAG_ANSWER_FIXED_LENGTH": "true",
            "MMRAG_PROFILE": "development",  # where benchmark knobs are read (MMRAG_MODEL set: nothing else changes)
            "MMRAG_ANSWER_CACHE": "false",  # every question costs what it costs
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


async def run_fairness(inputs: FairnessInputs) -> dict:
    spec, log = inputs.spec, inputs.log
    shutil.rmtree(inputs.root, ignore_errors=True)
    (inputs.root / "logs").mkdir(parents=True)
    tenants_file = inputs.root / "tenants.json"
    keys = {t: add_key(tenants_file, t) for t in ("a", "b")}
    t = time.perf_counter()
    replica = start_replica(inputs.model_path, inputs.engine_config, inputs.root / "logs" / "vllm.log",
                            port=free_port())
    try:
        server = start_mmrag_serve(_env(inputs, replica.url, tenants_file), inputs.root / "logs" / "serve.log")
        try:
            log(f"fairness: replica and mmrag serve ready in {time.perf_counter() - t:.0f} s")
            # Idle connections dropped well before the server closes them (uvicorn: 5 s), or a reused one races
            # the server's close and fails.
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=spec.b_loops + 16,
                                  keepalive_expiry=1.0)
            async with (httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {keys['a']}"},
                                          timeout=600, limits=limits) as a,
                        httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {keys['b']}"},
                                          timeout=600, limits=limits) as b,
                        httpx.AsyncClient(timeout=60) as control):
                return await _phases(inputs, Server(server.url, server.proc.pid, a, b, control, replica.url,
                                                    replica.proc.pid))
        finally:
            server.stop()
    finally:
        replica.stop()


async def _phases(inputs: FairnessInputs, s: Server) -> dict:
    spec, log, corpus = inputs.spec, inputs.log, inputs.corpus
    t = time.perf_counter()
    half = len(corpus.pages) // 2
    own = {"a": corpus.pages[:half], "b": corpus.pages[half:]}
    for tenant, http in (("a", s.a), ("b", s.b)):
        for page in own[tenant]:
            job = await ingested(http, page.file, (corpus.root / page.file).read_bytes())
            if job["status"] != "done":
                raise E2EError(f"ingesting {page.file} for {tenant}: {job}")
    slow = await ingested(s.b, "slow.pdf", slow_render_pdf(2, spec.slow_render_paths))
    log(f"fairness: A {half} pages, B {len(own['b'])} pages and 2 slow-render pages ingested in "
        f"{time.perf_counter() - t:.0f} s ({slow['status']})")
    s.idle_mib = memory_mib(s.pid)["VmRSS"]
    questions = {tenant: [f"What does the {p.title} chart show?" for p in pages] for tenant, pages in own.items()}

    def a_asks(i: int) -> Awaitable[Asked]:
        return ask(s.a, questions["a"][i % len(questions["a"])])

    # Questions: A alone, then beside B's loops.
    async with PeakWatch(s.pid) as alone_mem, Profile(s) as alone_profile:
        alone = await paced(spec.a_alone, spec.a_every_s, None, a_asks)
    log(f"fairness: A alone {summarize_asks(alone)}")
    b_asked: list[Asked] = []
    stop_at = time.perf_counter() + spec.flood_s

    async def b_loop(k: int) -> None:
        i = k
        while time.perf_counter() < stop_at:
            r = await ask(s.b, questions["b"][i % len(questions["b"])])
            b_asked.append(r)
            i += spec.b_loops
            if r.status == 429:
                await asyncio.sleep(max(0.0, min(r.retry_after_s, stop_at - time.perf_counter())))

    async with PeakWatch(s.pid) as flood_mem, Profile(s) as flood_profile:
        loops = [asyncio.create_task(b_loop(k)) for k in range(spec.b_loops)]
        await asyncio.sleep(min(2.0, spec.flood_s / 4))  # B's loops arrive first and fill the server
        beside = await paced(None, spec.a_every_s, stop_at, a_asks)
        await asyncio.gather(*loops)
    a_alone, a_beside = summarize_asks(alone), summarize_asks(beside)
    ratio = (a_beside["latency_p50_s"] / a_alone["latency_p50_s"]
             if a_beside["latency_p50_s"] and a_alone["latency_p50_s"] else None)
    b_summary = {"loops": spec.b_loops, "seconds": spec.flood_s, "answered": sum(a.status == 200 for a in b_asked),
                 "refused": sum(a.status == 429 for a in b_asked),
                 "errors": sum(a.status not in (200, 429) for a in b_asked),
                 "first_errors": [a.error for a in b_asked if a.status not in (200, 429)][:3]}
    questions_phase = {"a_alone": a_alone, "a_beside_b": a_beside, "b": b_summary,
                       "a_latency_ratio": round(ratio, 2) if ratio else None,
                       "profile": {"a_alone": alone_profile.result, "b_flood": flood_profile.result}}
    log(f"fairness: A beside B {a_beside}; B {b_summary}; profile {questions_phase['profile']}")

    # Ingest: A's one page while B's pathological PDF runs; then B's job cancelled.
    pdf = pathological_pdf(spec.pdf_pages, spec.pdf_paths)
    async with PeakWatch(s.pid) as ingest_mem:
        b_job = (await upload(s.b, "paths.pdf", pdf))["job"]["id"]
        await until_status(s.b, b_job, ("running",), 600)
        t = time.perf_counter()
        a_job = await ingested(s.a, "one-page.png", _png(corpus.image(corpus.probes[0])), within_s=900)
        a_indexed_s = time.perf_counter() - t
        b_progress = (await s.b.get(f"/v1/ingest/{b_job}")).json()
        t = time.perf_counter()
        await s.b.post(f"/v1/ingest/{b_job}/cancel")
        b_final = await until_status(s.b, b_job, ("cancelled", "done", "failed"), 900)
        cancel_s = time.perf_counter() - t
    ingest_phase = {"b_pdf": {"pages": spec.pdf_pages, "paths": spec.pdf_paths, "bytes": len(pdf)},
                    "a_upload_indexed_s": round(a_indexed_s, 2), "a_status": a_job["status"],
                    "b_pages_done_when_a_was_indexed": (b_progress.get("progress") or {}).get("pages_done"),
                    "b_cancelled_in_s": round(cancel_s, 2), "b_final_status": b_final["status"]}
    log(f"fairness: ingest {ingest_phase}")

    # Renders: A's page image beside B's slow ones. Each request a new box: a render, never the cache.
    pages = await page_ids(s.a)
    a_page = pages["one-page.png"][0]
    b_pages = (await page_ids(s.b))["slow.pdf"]

    async def a_render(i: int) -> Asked:
        t = time.perf_counter()
        r = await s.a.get(f"/v1/pages/{a_page}/image", params={"bbox": f"{i},{i},{200 + i},{200 + i}"})
        return Asked(r.status_code, time.perf_counter() - t, error=None if r.status_code == 200 else r.text[:200])

    alone_renders = await paced(spec.a_renders, 0.0, None, lambda i: a_render(i))
    b_renders: list[Asked] = []
    rendering = asyncio.Event()
    stop = asyncio.Event()

    async def b_render(k: int) -> None:
        i = k
        while not stop.is_set():
            t = time.perf_counter()
            rendering.set()
            r = await s.b.get(f"/v1/pages/{b_pages[i % len(b_pages)]}/image",
                              params={"bbox": f"{i % 50},{i % 50},{560 - i % 50},{740 - i % 50}"})
            b_renders.append(Asked(r.status_code, time.perf_counter() - t))
            i += spec.render_loops

    async with PeakWatch(s.pid) as render_mem:
        loops = [asyncio.create_task(b_render(k)) for k in range(spec.render_loops)]
        await rendering.wait()
        await asyncio.sleep(0.5)  # B's renders hold their workers
        beside_renders = await paced(spec.a_renders, 0.5, None, lambda i: a_render(100 + i))
        stop.set()
        await asyncio.gather(*loops)
    render_phase = {"a_alone_p50_s": _percentile([r.seconds for r in alone_renders], 0.5),
                    "a_beside_b_p50_s": _percentile([r.seconds for r in beside_renders], 0.5),
                    "a_beside_b_max_s": _percentile([r.seconds for r in beside_renders], 1.0),
                    "a_errors": sum(r.status != 200 for r in alone_renders + beside_renders),
                    "b_renders": len(b_renders),
                    "b_render_p50_s": _percentile([r.seconds for r in b_renders if r.status == 200], 0.5)}
    log(f"fairness: renders {render_phase}")

    # Memory per bad input kind: asked about (the image with a question) and ingested.
    inputs_memory = {}
    for kind, (name, body) in bad_inputs(spec.tiff_frames).items():
        async with PeakWatch(s.pid) as asked_mem:
            r = await s.a.post("/v1/ask/upload", data={"question": "What does this image show?"},
                               files={"images": (name, body)})
        async with PeakWatch(s.pid) as ingest_mem_kind:
            job = await ingested(s.a, name, body)
        report = job.get("report") or {}
        inputs_memory[kind] = {
            "bytes": len(body), "ask_status": r.status_code,
            "ask_error": None if r.status_code == 200 else r.json().get("error", {}).get("type"),
            "ask_peak_over_idle_mib": round(asked_mem.peak - s.idle_mib),
            "ask_growth_mib": round(asked_mem.peak - asked_mem.start),
            "ingest_status": job["status"], "ingest_pages": report.get("pages"),
            "ingest_failed": [f["error"][:160] for f in report.get("failed", [])][:2],
            "ingest_peak_over_idle_mib": round(ingest_mem_kind.peak - s.idle_mib),
            "ingest_growth_mib": round(ingest_mem_kind.peak - ingest_mem_kind.start)}
        log(f"fairness: {kind}: {inputs_memory[kind]}")
    phases = {"a_alone": alone_mem, "b_flood": flood_mem, "b_pathological_pdf": ingest_mem,
              "b_slow_renders": render_mem}
    phases_memory = {name: round(w.peak - s.idle_mib) for name, w in phases.items()}
    phases_growth = {name: round(w.peak - w.start) for name, w in phases.items()}
    worst = max([*phases_memory.values(), *(max(v["ask_peak_over_idle_mib"], v["ingest_peak_over_idle_mib"])
                                            for v in inputs_memory.values())])
    a_beside = questions_phase["a_beside_b"]
    met = {"a_latency_ratio": ratio is not None and ratio <= TARGETS["a_latency_ratio"],
           "a_admission_wait_p99_s": a_beside["admission_wait_p99_s"] is not None
           and a_beside["admission_wait_p99_s"] <= TARGETS["a_admission_wait_p99_s"],
           "a_refused": a_beside["refused"] == 0 and a_beside["errors"] == 0,
           "a_upload_indexed_s": a_job["status"] == "done" and a_indexed_s <= TARGETS["a_upload_indexed_s"],
           "a_render_s": render_phase["a_beside_b_max_s"] is not None
           and render_phase["a_beside_b_max_s"] <= TARGETS["a_render_s"],
           "memory_over_idle_mib": worst <= MEMORY_BOUND_MIB}
    return {"spec": asdict(spec), "questions": questions_phase, "ingest": ingest_phase, "renders": render_phase,
            "memory": {"idle_mib": round(s.idle_mib), "bound_over_idle_mib": MEMORY_BOUND_MIB,
                       "worst_over_idle_mib": worst,
                       "peak_reset": alone_mem.resets, "phases_over_idle_mib": phases_memory,
                       "phases_growth_mib": phases_growth, "end_mib": round(memory_mib(s.pid)["VmRSS"]),
                       "inputs": inputs_memory},
            "targets": TARGETS, "met": met}


def fairness_table(result: dict) -> str:
    q, i, r, m = result["questions"], result["ingest"], result["renders"], result["memory"]
    met = result["met"]

    def mark(name: str) -> str:
        return "met" if met[name] else "MISSED"

    rows = [
        ("A's latency p50 beside B / alone", f"{q['a_beside_b']['latency_p50_s']} / {q['a_alone']['latency_p50_s']} s"
         f" = {q['a_latency_ratio']}x", f"<= {TARGETS['a_latency_ratio']}x", mark("a_latency_ratio")),
        ("A's admission wait p99 beside B", f"{q['a_beside_b']['admission_wait_p99_s']} s",
         f"<= {TARGETS['a_admission_wait_p99_s']} s", mark("a_admission_wait_p99_s")),
        ("A's questions refused / failed", f"{q['a_beside_b']['refused']} / {q['a_beside_b']['errors']} of "
         f"{q['a_beside_b']['asked']}", "0", mark("a_refused")),
        ("A's one-page upload indexed beside B's PDF", f"{i['a_upload_indexed_s']} s", f"<= {TARGETS['a_upload_indexed_s']} s",
         mark("a_upload_indexed_s")),
        ("A's page image beside B's renders (max; alone p50)",
         f"{r['a_beside_b_max_s']} s; {r['a_alone_p50_s']} s", f"<= {TARGETS['a_render_s']} s", mark("a_render_s")),
        ("API process peak over idle (worst phase or input)",
         f"{m['worst_over_idle_mib']} MiB (idle {m['idle_mib']} MiB)", f"<= {MEMORY_BOUND_MIB} MiB",
         mark("memory_over_idle_mib")),
    ]
    lines = ["| measure | measured | target | |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    lines.append(f"\nB: {q['b']['answered']} answers, {q['b']['refused']} refused (429) in {q['b']['seconds']:.0f} s "
                 f"of {q['b']['loops']} loops; B's PDF cancelled in {i['b_cancelled_in_s']} s; B's renders "
                 f"p50 {r['b_render_p50_s']} s")
    return "\n".join(lines)
