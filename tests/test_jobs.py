"""Durable ingest jobs: `mmrag serve` killed with `kill -9` mid-job takes its engine processes with it, resumes
the job at its next start, and the job ends done with the index and store an uninterrupted ingest makes; jobs are
listed (paginated) and a queued one is cancelled, which survives the restart too.

One kill and one restart prove both the process side (tests/test_faults_process.py: no engine process outlives
the killed server) and the job side: each start of `mmrag serve` is a vLLM start-up, so the two are one test."""

from __future__ import annotations

import sqlite3

import pytest

from serving.ingest_jobs import UNFINISHED, JobStore
from tests.test_faults_process import (  # noqa: F401 - reap is a fixture
    engine_processes, gone_after, mmrag_serve, reap, serve_env, wait_for_half_the_features)
from tests.test_ingest import assert_same_features, snapshot
from tests.waiting import eventually_sync

pytestmark = pytest.mark.server


def _wait(client, job_id: str) -> dict:
    def finished() -> dict:
        job = client.get(f"/v1/ingest/{job_id}").json()
        assert job["status"] not in ("queued", "running", "cancelling"), job
        return job

    return eventually_sync(finished, timeout=900, what=f"ingest job {job_id} finished")  # a hang guard


def test_kill_9_of_mmrag_serve_mid_job_leaves_no_engine_process_and_the_job_resumes_to_the_uninterrupted_index(
        tmp_path, sample_corpus, tiny_model, reap, reference_store):  # noqa: F811
    expected = reference_store

    data = tmp_path / "data"
    env = serve_env(data, tiny_model, sample_corpus)
    log = tmp_path / "serve.log"
    features = data / "features"
    with mmrag_serve(env, log) as (proc, client):
        # Ready: start-up is done, and its heap is out of the collector's walks (serving/api/startup.freeze_heap).
        assert "objects frozen out of the garbage collector's walks" in log.read_text()
        tree = engine_processes(proc, reap)
        rss = sum(p.memory_info().rss for p in tree)
        job = client.post("/v1/ingest", json={"paths": ["."]}).json()
        wait_for_half_the_features(features, expected)
        proc.kill()
        seconds, left = gone_after(tree)
    assert left == [], f"engine processes outlived `mmrag serve`: {left}"
    print(f"\nkill -9 of mmrag serve: {len(tree)} descendants ({', '.join(sorted({p.name() for p in tree}))}; "
          f"{rss / 2**20:.0f} MiB RSS) gone after {seconds:.2f} s")
    db = sqlite3.connect(data / "jobs.sqlite3")
    (state,), = db.execute("SELECT json_extract(state, '$.status') FROM jobs WHERE id = ?", (job["id"],))
    db.close()
    assert state == "running"  # what the killed server left
    partial = snapshot(data)
    assert 0 < len(partial[0]) < len(expected[0])

    with mmrag_serve(env, log) as (proc, client):
        tree = engine_processes(proc, reap)
        # Queued behind the resumed job, which re-encodes half the corpus: cancelled before it runs.
        second = client.post("/v1/ingest", json={"paths": ["."]}).json()
        cancelled = client.post(f"/v1/ingest/{second['id']}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled", cancelled.text
        resumed = _wait(client, job["id"])
        assert resumed["status"] == "done" and resumed["resumed"] == 1 and resumed["report"]["failed"] == [], resumed
        assert client.get(f"/v1/ingest/{second['id']}").json()["status"] == "cancelled"
        listed = client.get("/v1/ingest", params={"limit": 1}).json()
        assert (listed["total"], listed["next_offset"], [j["id"] for j in listed["jobs"]]) == (2, 1, [second["id"]])
        rest = client.get("/v1/ingest", params={"limit": 1, "offset": 1}).json()
        assert ([j["id"] for j in rest["jobs"]], rest["next_offset"]) == ([job["id"]], None)
        unknown = client.post("/v1/ingest/job-nope/cancel")
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "unknown_job"
        answer = client.post("/v1/ask", json={"question": "What was the Q3 revenue?"})
        assert answer.status_code == 200 and answer.json()["answer"], answer.text
    assert gone_after(tree)[1] == [], "engine processes outlived a stopped `mmrag serve`"

    features_now, points_now = snapshot(data)
    assert_same_features(features_now, expected[0], kept=partial[0])
    assert points_now == expected[1]

    # Finished jobs stay finished: what a next start reads (IngestJobs resumes only UNFINISHED jobs, as the
    # restart above did) is done and cancelled. Read from the job store itself: a third server start (~30 s of
    # vLLM start-up) would show the same rows.
    store = JobStore(data / "jobs.sqlite3")
    try:
        states = {j.id: (j.status, j.resumed) for j in store.load()}
    finally:
        store.close()
    assert states == {job["id"]: ("done", 1), second["id"]: ("cancelled", 0)}
    assert not any(status in UNFINISHED for status, _ in states.values())
