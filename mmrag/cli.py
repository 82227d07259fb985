"""The `mmrag` command line. Each command builds Settings from MMRAG_* variables at entry, never at import.

Importing this module (all `--help` needs) imports no torch, vLLM, transformers, Qdrant or plotting: the
command modules import those inside the commands, and tests/test_cli.py checks it. Option and argument
annotations are read by Typer at import time, so they stay plain types.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from mmrag.bench_cmd import bench
from mmrag.config_cmd import config_app
from mmrag.engine_cmd import engine_app
from mmrag.eval_cmd import eval_app
from mmrag.errors import describe, is_user_error
from mmrag.reencode_cmd import reencode
from mmrag.retrieval_cmd import retrieval_app
from mmrag.tenant_cmd import TenantOption, tenant_app
from mmrag.vision_cmd import vision_app

# MMRAG_ANSWER_MODE (mmrag/core/settings.py): the strategies, then the names deprecated for one release
ANSWER_MODES = ("auto", "split", "joint", "one_prompt", "per_image", "per_sub_question")


def _one_of(choices: tuple[str, ...]):
    """An option callback that takes one of ``choices`` (or nothing), naming them when it is another."""

    def check(value: str | None) -> str | None:
        if value is not None and value not in choices:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(choices)}")
        return value

    return check

app = typer.Typer(
    help="mmrag: ask questions over figure-heavy documents with a VLM, reusing image-prefix KV on purpose.\n\n"
    "Start with `mmrag corpus sample --out corpus/` and `mmrag ingest corpus/`. Configuration comes from "
    "MMRAG_* environment variables: `mmrag config show` prints them, docs/configuration.md says what each does.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
model_app = typer.Typer(help="Build or inspect VLM checkpoints.", no_args_is_help=True)
corpus_app = typer.Typer(help="Sample documents for demos and tests.", no_args_is_help=True)
index_app = typer.Typer(help="Inspect or reset the Qdrant page index.", no_args_is_help=True)
store_app = typer.Typer(help="Maintain the feature store (image tokens on disk or in Redis).", no_args_is_help=True)
app.add_typer(model_app, name="model")
app.add_typer(corpus_app, name="corpus")
app.add_typer(index_app, name="index")
app.add_typer(store_app, name="store")
app.add_typer(engine_app, name="engine")
app.add_typer(retrieval_app, name="retrieval")
app.add_typer(eval_app, name="eval")
app.add_typer(vision_app, name="vision")
app.add_typer(tenant_app, name="tenant")
app.add_typer(config_app, name="config")
app.command("bench")(bench)
app.command("reencode")(reencode)

err = Console(stderr=True)

# Our top-level packages: their loggers print INFO milestones; every other library's only WARNING and up.
OUR_PACKAGES = ("mmrag", "ingestion", "retrieval", "rag", "serving")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time: while rich's live progress bar runs it redirects
    stderr, and log lines then print above the bar instead of through it."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def configure_logging() -> None:
    """Log lines to stderr (stdout carries the results, e.g. ``--json``): MMRAG_LOG_LEVEL (INFO unless set; DEBUG
    adds, for instance, the traceback of a file that failed in an unforeseen way) from our packages, WARNING from
    the rest. Once per process; vLLM, transformers and uvicorn keep their own handlers."""
    logging.basicConfig(level=logging.WARNING, handlers=[_StderrHandler()],
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from mmrag.core.settings import ObservabilitySection

    level = ObservabilitySection().log_level.upper()
    for name in OUR_PACKAGES:
        logging.getLogger(name).setLevel(level if level in logging.getLevelNamesMapping() else logging.INFO)


@model_app.command("tiny")
def model_tiny(
    out: Annotated[Path, typer.Option(help="Folder to write the checkpoint to.")] = Path(".mmrag/models/tiny"),
    seed: Annotated[int, typer.Option(help="Weight seed; the same seed gives the same weights.")] = 0,
    family: Annotated[str, typer.Option(help="The checkpoint's model_type: qwen2_vl, qwen2_5_vl or qwen3_vl.")
                      ] = "qwen2_vl",
) -> None:
    """Build a tiny random-weight VLM of one family offline (a few seconds). Its answers are not meaningful."""
    from mmrag.devkit.tiny_model import MODEL_NAMES, build_tiny_model

    if family not in MODEL_NAMES:
        raise typer.BadParameter(f"{family!r} has no tiny model; use one of {', '.join(MODEL_NAMES)}",
                                 param_hint="--family")
    path = build_tiny_model(out, seed=seed, family=family)
    err.print(f"tiny random-weight {family} model written to [bold]{path}[/] (set MMRAG_MODEL={path} to use it)")


@corpus_app.command("sample")
def corpus_sample(
    out: Annotated[Path, typer.Option(help="Folder to write PDFs, PNG slides and manifest.json to.")] = Path("corpus"),
    seed: Annotated[int, typer.Option(help="Generator seed; the same seed gives the same files.")] = 0,
) -> None:
    """Generate the sample corpus: PDFs with a text layer, PNG slides, figures that recur across documents."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        err.print("[red]error:[/] the sample corpus is drawn with matplotlib, which comes with the `bench` extra: "
                  "pip install -e '.\\[bench]' (make setup installs it)")
        raise typer.Exit(2) from None
    from mmrag.devkit.corpus import build_sample_corpus

    manifest = build_sample_corpus(out, seed=seed)
    pages = sum(len(d.pages) for d in manifest.documents)
    err.print(f"sample corpus: {len(manifest.documents)} files, {pages} pages, "
              f"{len(manifest.questions)} labelled questions in [bold]{out}[/]")


@app.command()
def ingest(
    paths: Annotated[list[Path], typer.Argument(help="Files or folders: PDF, PNG, JPEG, WebP, TIFF.")],
    recursive: Annotated[bool, typer.Option("--recursive", "-r", help="Walk folders recursively.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the table.")] = False,
    warm_after: Annotated[bool, typer.Option("--warm", help="Then warm the running engine replicas "
                                             "(MMRAG_ENGINE_URLS) with the most recurring pages.")] = False,
    tier: Annotated[list[str] | None, typer.Option("--tier", help="Also encode the pages in this resolution "
                                                   "tier (MMRAG_TIERS; repeatable), beside MMRAG_INGEST_TIERS.")] = None,
    tenant: TenantOption = "default",
) -> None:
    """Render pages, pre-encode them to image tokens, and index them in Qdrant.

    Re-running on an unchanged corpus encodes nothing; a killed run can simply be run again.
    Exit code 1 if any file failed (the others are still ingested).
    """
    from mmrag import ingest_cmd

    if warm_after:
        from mmrag.core.settings import Settings
        from mmrag.wiring import require_engine_urls

        require_engine_urls(Settings())  # fail before the work, not after it
    report = ingest_cmd.run(paths, recursive=recursive, console=err, show_progress=not as_json or sys.stderr.isatty(),
                            tiers=tier or [], tenant=tenant)
    out = report.to_json()
    if warm_after:
        from mmrag import ask_cmd

        out["warm"] = ask_cmd.warm_pages(top=None, pages_spec=None, share=0.5, tenant=tenant).to_json()
    if as_json:
        typer.echo(json.dumps(out))
    else:
        ingest_cmd.print_report(report, err)
        if warm_after:
            w = out["warm"]
            err.print(f"warmed {len(w['warmed'])} pages in {w['seconds']}s; did not fit: {len(w['did_not_fit'])}")
    raise typer.Exit(1 if report.failed else 0)


@app.command()
def ask(
    question: Annotated[str, typer.Argument(help="The question, in quotes.")],
    pages: Annotated[str | None, typer.Option("--pages", help="Skip retrieval and ask over these pages: "
                                              "DOC:PAGE[,DOC:PAGE...], DOC being the file name.")] = None,
    doc: Annotated[list[str] | None, typer.Option("--doc", help="Only search this document (repeatable).")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="Answer length cap (MMRAG_ANSWER_MAX_TOKENS).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    tier: Annotated[str | None, typer.Option("--tier", help="Show the pages in this resolution tier (MMRAG_TIERS, "
                                             "e.g. low: pooled, a quarter of the image tokens); default: standard.")
                    ] = None,
    tenant: TenantOption = "default",
    answer_mode: Annotated[str | None, typer.Option(
        "--answer-mode", callback=_one_of(ANSWER_MODES),
        help="split: each page (or figure crop) leads a prompt of its own with the parts of the question that "
             "found it, the parts one answer; joint: one prompt over the pages, seen together; auto: joint when "
             "the question compares or relates pages, else split (default: MMRAG_ANSWER_MODE, auto). "
             "Deprecated: one_prompt (joint), per_image (split), per_sub_question (joint).")] = None,
) -> None:
    """Ask a question: split it into sub-questions, retrieve pages for each, answer with page citations.

    Uses the MMRAG_ENGINE_URLS replicas, else starts vLLM in this process (tens of seconds on CPU).
    """
    from mmrag import ask_cmd

    answer = ask_cmd.ask(question, pages, docs=doc, max_tokens=max_tokens, console=err, tier=tier,
                         tenant=tenant, answer_mode=answer_mode)
    if as_json:
        typer.echo(json.dumps(answer.to_json()))
    else:
        ask_cmd.print_answer(answer, err)


@app.command()
def warm(
    top: Annotated[int | None, typer.Option(help="Warm the N most recurring pages (default: all that fit).")] = None,
    pages: Annotated[str | None, typer.Option("--pages", help="Warm these pages: DOC:PAGE[,DOC:PAGE...].")] = None,
    share: Annotated[float, typer.Option(help="Share of each replica's KV cache warm-up may fill.")] = 0.5,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    tenant: TenantOption = "default",
) -> None:
    """Prefill the running engine's prefix cache with the pages most likely to be asked about.

    Targets the replicas in MMRAG_ENGINE_URLS (see `mmrag engine serve`); pages that do not fit in the
    KV budget are reported. With MMRAG_FIGURE_CROPS=true the pages' figure crops are warmed too (a question about
    a figure is shown its crop), ranked with the pages by how many pages show them. With --tenant, that tenant's pages under its cache salt (only its questions hit them).
    """
    from mmrag import ask_cmd

    report = ask_cmd.warm_pages(top=top, pages_spec=pages, share=share, tenant=tenant)
    if as_json:
        typer.echo(json.dumps(report.to_json()))
    else:
        err.print(f"warmed {len(report.warmed)} pages ({report.warmed_tokens} image tokens) in "
                  f"{report.seconds:.1f}s, {report.pages_per_s:.1f} pages/s; did not fit: {len(report.did_not_fit)} "
                  f"(budget {report.budget_tokens} tokens)")


def open_to_all(settings, host: str) -> str | None:
    """Why serving on ``host`` with these settings lets anyone in (None when it does not): no API key, no tenants
    file, and an address other machines reach."""
    from mmrag.vision_cmd import loopback

    if settings.api.key or settings.tenants.file is not None or loopback(host):
        return None
    return (f"mmrag serve listens on {host} without MMRAG_API_KEY (or MMRAG_TENANTS_FILE): anyone who reaches the "
            "port can ask, upload and delete documents; set MMRAG_API_KEY, or listen on 127.0.0.1 (--host)")


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Address to listen on (MMRAG_HOST).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (MMRAG_PORT).")] = None,
    ray: Annotated[bool, typer.Option("--ray", help="Engine replicas and the vision service on Ray Serve: joins "
                                      "MMRAG_RAY_ADDRESS, else starts a local cluster; MMRAG_RAY_REPLICAS "
                                      "replicas, routed by image-prefix affinity.")] = False,
) -> None:
    """Serve the REST API (POST /v1/ask, /v1/documents, /v1/ingest, /metrics; docs at /docs).

    Starts the engine in this process unless MMRAG_ENGINE_URLS names replicas (or --ray deploys them on Ray
    Serve), then warms it with the most recurring pages (MMRAG_WARM_TOP: -1 all that fit, 0 none).
    """
    import uvicorn

    from mmrag.core.settings import Settings
    from mmrag.wiring import create_app, ray_app
    from serving.api.slow_clients import header_timeout_protocol

    settings = Settings()
    if ray and settings.engine.urls:
        raise typer.BadParameter("--ray deploys its own engine replicas: unset MMRAG_ENGINE_URLS, or drop --ray")
    host = host or settings.api.host
    if warning := open_to_all(settings, host):
        logging.getLogger(__name__).warning("%s", warning)
    app = ray_app(settings) if ray else create_app(settings, freeze=True)
    uvicorn.run(app, host=host, port=port or settings.api.port, log_level="info",
                http=header_timeout_protocol(settings.api.http_header_timeout_s))


@index_app.command("reset")
def index_reset(yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation.")] = False,
                tenant: TenantOption = "default") -> None:
    """Delete and re-create the page collection (needed after changing embedders)."""
    from mmrag import ingest_cmd

    if not yes:
        typer.confirm(f"Delete every indexed page of tenant {tenant}?", abort=True)
    ingest_cmd.reset_index(err, tenant)


@index_app.command("stats")
def index_stats(tenant: TenantOption = "default") -> None:
    """Pages and documents in the index, and feature-store entries."""
    from mmrag import ingest_cmd

    typer.echo(json.dumps(ingest_cmd.stats(tenant)))


@index_app.command("check")
def index_check(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the table.")] = False,
    tenant: TenantOption = "default",
) -> None:
    """Pages per encoder version and resolution policy, and which of them the configured model can serve.

    Pages of another encoder (after a model upgrade or a changed MMRAG_ENCODER_SALT) are never served.
    Exit code 1 if there are any.
    """
    from mmrag import index_cmd, wiring

    settings, scope = wiring.for_tenant(tenant)
    result = index_cmd.check(settings, collection=scope.collection)
    if as_json:
        typer.echo(json.dumps(result.to_json()))
    else:
        index_cmd.print_check(result, err)
    raise typer.Exit(1 if result.stale_pages else 0)


@store_app.command("gc")
def store_gc(
    dry_run: Annotated[bool, typer.Option("--dry-run/--apply", help="--dry-run (the default) only lists what "
                                          "would go; --apply removes it.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Remove feature entries that no indexed page references (left by upgrades and re-ingests).

    A dry run unless --apply: lists what would go and its bytes. Entries a running answer, a live conversation
    or an ingest holds a lease on are kept and counted as leased; a later gc removes them once released.
    """
    from mmrag.core.settings import Settings
    from mmrag import store_cmd

    report = store_cmd.gc(Settings(), dry_run=dry_run)
    if as_json:
        typer.echo(json.dumps(report.to_json()))
    else:
        store_cmd.print_gc(report, err)


def reexec_under_emulated_isa() -> None:
    """Under MMRAG_EMULATE_ISA, start this command again with that ISA's kernel caps in its environment (they act
    at interpreter start, and so reach every process the command starts: vLLM's engine core, `vllm serve`); a
    no-op where the caps are already in place, or nothing is emulated."""
    from mmrag.adapters.hardware import emulated_isa, emulation_env, exec_emulating

    isa = emulated_isa()
    if isa is None or all(os.environ.get(k) == v for k, v in emulation_env(dict(os.environ), isa).items()):
        return
    exec_emulating(isa, [sys.executable, "-c", "from mmrag.cli import main; main()", *sys.argv[1:]])


def main() -> None:
    from mmrag.adapters.hardware import reproducible_numerics
    from serving.engine.lifeline import exit_promptly

    exit_promptly()  # the command's output is written: exit without seconds of garbage collection
    reproducible_numerics()  # before any matmul: MKL reads it once
    try:
        reexec_under_emulated_isa()
    except ValueError as exc:  # an ISA mmrag cannot emulate: the message names the choices
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Our own progress bars say what is happening; transformers' per-load bars would only add noise. Set before
    # any command imports transformers, which reads it once at import (nothing heavy is imported until then).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # vLLM logs to stdout by default, which would corrupt `--json` output; keep stdout for results.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    configure_logging()
    try:
        app()
    except Exception as exc:
        if not is_user_error(exc):
            raise
        # Configuration and environment problems: one line that names the fix, no traceback.
        err.print(f"[red]error:[/] {escape(describe(exc))}")
        sys.exit(2)
