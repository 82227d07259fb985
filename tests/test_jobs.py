"""Durable ingest jobs: `mmrag serve` killed with `kill -9` mid-job resumes the job at its next start, and
it ends done with the index and store an uninterrupted ingest makes; jobs are listed (paginated) and a
queued one is cancelled, which survives the restart too."""

from __future__ import annotations

import sqlite3
import time

from serving.ingest_jobs import UNFINISHED, JobStore
from tests.test_faults_process import (  # noqa: F401 - reap is a fixture
    engine_processes, gone_after, mmrag_serve, reap, serve_env, wait_for_half_the_features)
from tests.test_ingest import assert_same_features, snapshot


def _wait(client, job_id: str) -> dict:
    deadline = time.monotonic() + 900  # a hang guard, not a speed check
    while (job := client.get(f"/v1/ingest/{job_id}").json())["status"] in ("queued", "running", "cancelling"):
        assert time.monotonic() < deadline, job
        time.sleep(0.2)
    return job


def test_a_job_cut_by_kill_9_resumes_after_a_restart_and_ends_with_the_uninterrupted_index(
        tmp_path, sample_corpus, tiny_model, reap, reference_store):  # noqa: F811
    expected = reference_store

    data = tmp_path / "data"
    env = serve_env(data, tiny_model, sample_corpus)
    log = tmp_path / "serve.log"
    features = data / "features"
    with mmrag_serve(env, log) as (proc, client):
        tree = engine_processes(proc, reap)
        job = client.post("/v1/ingest", json={"paths": ["."]}).json()
        wait_for_half_the_features(features, expected)
        proc.kill()
        assert gone_after(tree)[1] == []
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
    assert gone_after(tree)[1] == []

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
