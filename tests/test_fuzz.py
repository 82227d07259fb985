"""Fuzzing: schemathesis sends requests generated from /openapi.json, valid and invalid, to every operation of the
real server with the API key: no 5xx, every response one the schema documents, and no response body (a 200's
as much as an error's) showing one of the server's folders (a check of our own, `no_server_paths`). The server
is `mmrag serve`'s app over its own copy of the session corpus (index AND feature store): the fuzzer deletes and
uploads documents, which must not reach what other tests read.

What it found is replayed below as plain requests, so each finding stays a named test once fixed.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import httpx
import pytest
from fastapi.routing import APIRoute

from tests.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_EXAMPLES = 25  # per operation: the whole run takes ~30 s on the 2-core machine

# All of schemathesis' checks (server errors, status codes, content types, headers, response bodies against the
# schema, invalid data refused, auth not ignored, links between operations) but one: positive_data_acceptance
# wants a 2xx for every schema-valid request, and this API refuses some on purpose with a 4xx the schema documents
# (an empty question is 400 bad_question, a NUL byte in a path 400, a path outside the ingest root 403).
# No operation is excluded: deletions and uploads act on the fuzzed app's own copy, and POST /v1/ingest only
# reaches its ingest root.
SCHEMATHESIS = [
    "run", "--checks", "all", "--exclude-checks", "positive_data_acceptance",
    "--max-examples", str(MAX_EXAMPLES),
    "--generation-deterministic",  # the same requests on every run (CI), and no example database
    "--no-shrink",  # a failure is reported as the request that failed, with its curl, not hundreds of re-sends
    "--workers", "1", "--request-timeout", "60", "--no-color",
]


@pytest.fixture(scope="module")
async def fuzzed_server(engine_settings, ingested, inprocess_engine, tmp_path_factory):
    """The api_server's app on a copy of the session corpus whose feature store is the copy's too (the session
    engine still reads the session store, which holds every page the copy's index can name)."""
    from mmrag import wiring
    from tests.conftest import copy_corpus, serving

    data = tmp_path_factory.mktemp("fuzz-data")
    copy_corpus(engine_settings, data)
    settings = engine_settings.replace(**{
        "data_dir": data, "api_key": API_KEY, "ingest_root": tmp_path_factory.mktemp("fuzz-ingest-root"),
        "answer_max_tokens": 8, "warm_top": 0,
    })
    app = wiring.create_app(settings, engine=inprocess_engine, store=wiring.feature_store(settings))
    async with serving(app) as url:
        yield {"url": url, "app": app, "settings": settings}


# Loaded by schemathesis (SCHEMATHESIS_HOOKS): a check run on every response of every phase.
NO_SERVER_PATHS_CHECK = """
import json, os
import schemathesis

FOLDERS = json.loads(os.environ["MMRAG_FUZZ_SERVER_FOLDERS"])
CHECKED = os.environ["MMRAG_FUZZ_CHECKED"]  # a file the check leaves, so the test knows it ran


@schemathesis.check
def no_server_paths(ctx, response, case):
    open(CHECKED, "a").close()
    shown = [folder for folder in FOLDERS if folder.encode() in response.content]
    if shown:
        raise AssertionError(f"{case.method} {case.path} ({response.status_code}) shows {shown[0]}")
"""


async def test_schemathesis_finds_no_server_error_and_nothing_undocumented(
        fuzzed_server, tmp_path, engine_settings, tiny_model, sample_corpus, tmp_path_factory):
    api_server = fuzzed_server
    report = tmp_path / "report.json"
    hooks = tmp_path / "no_server_paths.py"
    hooks.write_text(NO_SERVER_PATHS_CHECK)
    settings = api_server["settings"]
    folders = [settings.storage.data_dir, settings.api.ingest_root, engine_settings.storage.data_dir, tiny_model,
               sample_corpus,
               tmp_path_factory.getbasetemp()]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": str(hooks), "MMRAG_FUZZ_CHECKED": str(tmp_path / "checked"),
           "MMRAG_FUZZ_SERVER_FOLDERS": json.dumps(sorted({str(p) for p in folders} | {str(p.resolve())
                                                                                       for p in folders}))}
    # A separate process: the server runs on this test's event loop, which a blocking client here would stall.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "schemathesis.cli", *SCHEMATHESIS, "--report", "json", "--report-json-path", report,
        "-H", f"Authorization: Bearer {API_KEY}", f"{api_server['url']}/openapi.json",
        cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out = (await proc.communicate())[0].decode(errors="replace")
    assert report.exists(), out
    run = json.loads(report.read_text())
    cases, ops = run["test_cases"], run["operations"]
    print(f"\nschemathesis: {cases['generated']} test cases over {ops['tested']} operations in "
          f"{run['running_time']:.1f} s; phases {({k: v['status'] for k, v in run['phases'].items()})}")

    documented = [r for r in api_server["app"].routes if isinstance(r, APIRoute) and r.include_in_schema]
    assert ops["tested"] == ops["total"] == sum(len(r.methods) for r in documented), ops
    assert run["complete"] and not run["failures"] and not run["errors"] and proc.returncode == 0, (
        out[out.find("= FAILURES ="):])
    assert (tmp_path / "checked").exists(), "the no_server_paths check never ran: " + out[-2000:]


# --- the fuzzer's findings as plain requests: each gets a status its operation documents, in the error shape ----


@pytest.fixture
async def http(api_server):
    async with httpx.AsyncClient(base_url=api_server["url"], timeout=120, headers=AUTH) as client:
        yield client


@pytest.mark.parametrize("path, body, status", [  # status None: any 4xx that the operation documents
    # 500 "ValueError: embedded null byte" (found in the stateful phase, among many other generated paths)
    ("/v1/ingest", json.dumps({"paths": ["\u00e8", "", "x\u0000y", "u_C"], "recursive": False}).encode(), None),
    # A body that is not UTF-8: FastAPI's own 400 {"detail": "There was an error parsing the body"}
    ("/v1/ask", b"\xff", None),
    ("/v1/ingest", b"+\xff\x13", None),
    # Accepted (202) although the schema says `recursive` is a boolean: lax pydantic read 0 as false
    ("/v1/ingest", b'{"paths": [""], "recursive": 0}', 422),
])
async def test_what_the_fuzzer_found_gets_a_documented_4xx_in_the_error_shape(http, path, body, status):
    spec = (await http.get("/openapi.json")).json()
    r = await http.post(path, content=body, headers={"content-type": "application/json"})
    assert (r.status_code == status) if status else (400 <= r.status_code < 500), r.text
    assert str(r.status_code) in spec["paths"][path]["post"]["responses"], f"{r.status_code} is undocumented"
    assert set(r.json()) == {"error"} and set(r.json()["error"]) == {"type", "message", "fix"}, r.text
