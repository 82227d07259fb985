"""The alerting rules compose's Prometheus loads (deploy/prometheus/alerts.yml).

promtool checks them and runs their unit tests (alerts_test.yml: each alert firing, and silent in steady
traffic, with no traffic and below the traffic floor). Then a real Prometheus, loading the shipped rules,
scrapes two real mmrag APIs over copies of the session index: one whose MMRAG_ENCODER_SALT changed after
ingestion, whose every page another encoder made, and one still configured as at ingestion. The mismatch
alert fires for the first, with the encoders in its labels and the fix in its description, and not for the
second.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import yaml

from mmrag.core.payload import EncoderScope
from mmrag import wiring
from tests.conftest import copy_corpus, free_port, serving
from tests.waiting import eventually

PROMETHEUS_DIR = Path(__file__).resolve().parents[1] / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "alerts.yml"
MISMATCH = "MmragIndexEncoderMismatch"
CHANGED_SALT = "salt-changed-after-ingest"
NOWHERE = "http://127.0.0.1:9"  # a remote engine that is never asked: only /metrics is scraped

PROMETHEUS_CONFIG = """\
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files: ["{rules}"]
scrape_configs:
  - job_name: salt-changed
    static_configs: [{{targets: ["{changed}"]}}]
  - job_name: salt-kept
    static_configs: [{{targets: ["{kept}"]}}]
"""


def promtool(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("promtool is not installed: apt-get install prometheus, which ships it (make test does it "
                    "as root)")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)


def test_promtool_accepts_the_rules():
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_rules_pass_their_promtool_unit_tests():
    result = promtool("test", "rules", str(PROMETHEUS_DIR / "alerts_test.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_waits_has_a_severity_and_says_the_fix():
    alerts = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]
    assert {a["alert"] for a in alerts} == {MISMATCH, "MmragImagePrefixHitRateDropped",
                                           "MmragVisionTokenCacheHitRateDropped", "MmragTtftP99Rising"}
    for alert in alerts:
        assert alert["for"] and alert["labels"]["severity"] in {"warning", "critical"}, alert["alert"]
        assert alert["annotations"]["summary"], alert["alert"]
        assert "Fix: " in alert["annotations"]["description"], alert["alert"]


def shipped_rules_firing_after_1s(path: Path) -> None:
    """The shipped rules with every `for:` cut to 1 s, so a test sees `firing` in seconds; the expressions,
    labels and annotations are the shipped ones."""
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "1s"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))


@contextlib.asynccontextmanager
async def api(engine_settings, data_dir: Path, salt: str) -> AsyncIterator[tuple[str, EncoderScope]]:
    """A real mmrag REST app over a copy of the session index, configured with ``salt``; yields its host:port
    and its serving encoder scope. Its engine is remote and never asked (no vLLM starts)."""
    copy_corpus(engine_settings, data_dir)
    settings = engine_settings.replace(**{"data_dir": data_dir, "encoder_salt": salt, "warm_top": 0})
    model = wiring.resolve_model(settings)
    engine = wiring.engine(settings.replace(**{"engine_urls": [NOWHERE]}), model)
    try:
        async with serving(wiring.create_app(settings, engine=engine)) as url:
            yield url.removeprefix("http://"), wiring.encoder_scope(settings, model)
    finally:
        await engine.close()


@contextlib.asynccontextmanager
async def prometheus(config: str, workdir: Path) -> AsyncIterator[httpx.AsyncClient]:
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.skip("prometheus is not installed: apt-get install prometheus (make test does it as root)")
    (workdir / "prometheus.yml").write_text(config)
    log, port = workdir / "prometheus.log", free_port()
    proc = subprocess.Popen(
        [exe, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=log.open("wb"),
    )
    client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10)

    async def ready() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"prometheus exited with {proc.returncode}: {log.read_text()[-2000:]}")
        return (await client.get("/-/ready")).status_code == 200

    try:
        await eventually(ready, timeout=30, what=f"prometheus ready ({log})", ignoring=(httpx.TransportError,))
        yield client
    finally:
        await client.aclose()
        proc.terminate()
        proc.wait(timeout=30)


async def query(prom: httpx.AsyncClient, expr: str) -> list[dict]:
    body = (await prom.get("/api/v1/query", params={"query": expr})).json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


async def last_scrape(prom: httpx.AsyncClient, job: str) -> float | None:
    """When Prometheus last stored the job's mmrag_indexed_pages (Unix seconds); None before its first scrape."""
    seen = await query(prom, f'timestamp(mmrag_indexed_pages{{job="{job}"}})')
    return float(seen[0]["value"][1]) if seen else None


async def mismatch_rule(prom: httpx.AsyncClient) -> dict:
    body = (await prom.get("/api/v1/rules", params={"type": "alert"})).json()
    (rule,) = [r for g in body["data"]["groups"] for r in g["rules"] if r["name"] == MISMATCH]
    return rule


@pytest.mark.server
async def test_a_real_prometheus_fires_the_mismatch_alert_after_a_salt_change(engine_settings, ingested, tmp_path):
    rules = tmp_path / "alerts.yml"
    shipped_rules_firing_after_1s(rules)
    async with (api(engine_settings, tmp_path / "changed", CHANGED_SALT) as (changed, new_encoder),
                api(engine_settings, tmp_path / "kept", engine_settings.vision.encoder_salt)
                 as (kept, indexed_encoder)):
        assert new_encoder.version != indexed_encoder.version
        config = PROMETHEUS_CONFIG.format(rules=rules, changed=changed, kept=kept)
        async with prometheus(config, tmp_path) as prom:
            # Until the alert fires for the changed API and the rule has been evaluated since the kept API's
            # first scrape (a rule evaluated at T sees the samples scraped up to T).
            kept_since = None

            async def fired() -> tuple[dict, list[dict]]:
                nonlocal kept_since
                rule = await mismatch_rule(prom)
                firing = [a for a in rule["alerts"] if a["state"] == "firing"]
                kept_since = kept_since or await last_scrape(prom, "salt-kept")
                assert firing and kept_since, rule
                assert datetime.fromisoformat(rule["lastEvaluation"]).timestamp() > kept_since, (kept_since, rule)
                return rule, firing

            rule, firing = await eventually(fired, timeout=60, what=f"{MISMATCH} firing")
            (served,) = await query(prom, 'mmrag_indexed_pages{job="salt-kept"}')

    assert [a["labels"]["job"] for a in rule["alerts"]] == ["salt-changed"]  # nothing pending for the kept API
    (alert,) = firing
    assert alert["labels"] == {
        "alertname": MISMATCH, "severity": "critical", "job": "salt-changed", "instance": changed,
        "servable": "false", "encoder_version": indexed_encoder.version, "policy": str(indexed_encoder.policy),
        "version": new_encoder.version, "family": "qwen2_vl",
    }
    # Every page the kept API serves is one the changed API cannot.
    assert served["metric"]["servable"] == "true" and float(alert["value"]) == float(served["value"][1]) > 0
    pages = int(float(served["value"][1]))
    summary = f"salt-changed: {pages} indexed pages were encoded by another vision encoder"
    assert alert["annotations"]["summary"] == summary
    description = alert["annotations"]["description"]
    assert f"serves encoder {new_encoder.version} (qwen2_vl), but {pages} indexed pages" in description
    assert "Fix: `mmrag reencode`" in description and "`mmrag index check`" in description
