"""README's REST examples, run as written with curl against the real app on the session engine (issue 41: they
lacked ``Content-Type: application/json`` and answered 422). Lines that need something of the reader's (a
``<page_id>``, a file to upload) are left out; every other curl line of the block must answer without error."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import API_KEY

README = Path(__file__).resolve().parents[1] / "README.md"


def rest_examples() -> tuple[str, list[str]]:
    """The REST block's first line (the variables) and its curl lines that run as they are."""
    text = README.read_text()
    block = re.search(r"```bash\n(URL=http://127\.0\.0\.1:8080;.*?)```", text, re.S)
    assert block, "README lost its REST examples block (```bash starting with URL=http://127.0.0.1:8080)"
    first, *lines = block.group(1).splitlines()
    return first, [line for line in lines if line.startswith("curl ") and "<" not in line and "@" not in line]


def test_the_rest_examples_send_json_as_json():
    _, lines = rest_examples()
    posts = [line for line in lines if " -d " in line]
    assert len(posts) >= 4 and all('-H "$JSON"' in line for line in posts), posts


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed: README's examples are curl commands "
                    "(Debian: apt-get install curl)")
async def test_every_runnable_rest_example_answers_as_written(api_server):
    first, lines = rest_examples()
    variables = first.replace("http://127.0.0.1:8080", api_server["url"])
    assert len(lines) >= 7, lines
    for line in lines:
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", f"KEY={API_KEY}; {variables}; {line} -w '\\n%{{http_code}}'",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), timeout=300)
        assert proc.returncode == 0, (line, err.decode())
        body, _, status = out.decode().rpartition("\n")
        assert status.startswith("2"), (line, status, body[-500:])
        if '"stream": true' in line:
            assert "event: done" in body and "event: error" not in body, (line, body[-500:])
        else:
            assert "error" not in json.loads(body), (line, body[-500:])


@pytest.mark.parametrize("header", ["", "Content-Type: text/plain"])
async def test_a_json_body_without_its_content_type_gets_a_4xx_that_names_the_header(api_server, header):
    """What a reader who drops the header meets: a refusal that says to send it, not a bare 422."""
    import httpx

    headers = {"Authorization": f"Bearer {API_KEY}", **(dict([header.split(": ")]) if header else {})}
    async with httpx.AsyncClient(base_url=api_server["url"], timeout=60) as client:
        r = await client.post("/v1/ask", content=b'{"question": "How long are backups retained?"}', headers=headers)
    assert 400 <= r.status_code < 500, r.text
    assert "Content-Type: application/json" in r.json()["error"]["fix"], r.text


async def test_the_demo_client_asks_with_the_servers_key(api_server, monkeypatch, capsys):
    """`make demo`'s client (scripts/demo_ask.py) against a server that wants a key: it sends MMRAG_API_KEY."""
    import importlib.util

    monkeypatch.setenv("MMRAG_API_KEY", API_KEY)
    path = README.parent / "scripts" / "demo_ask.py"
    spec = importlib.util.spec_from_file_location("demo_ask_under_test", path)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    await asyncio.to_thread(demo.main, api_server["url"])  # its client is synchronous: off the server's loop
    printed = capsys.readouterr().out
    assert printed.count("answer:") == len(demo.QUESTIONS) and "answer (with footnotes):" in printed, printed
    assert "image-prefix hit rate" in printed
