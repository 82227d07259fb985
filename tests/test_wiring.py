"""One wiring module: configs built from default Settings equal each component's documented defaults, so no
component default can disagree with Settings; and what the wiring builds follows the settings it is given."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mmrag.core.settings import DevelopmentKnobs, Settings
from mmrag import wiring

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def defaults(monkeypatch) -> Settings:
    import os

    for name in list(os.environ):
        if name.startswith("MMRAG_"):
            monkeypatch.delenv(name)
    return Settings()


def test_the_scheduler_config_defaults_are_the_settings_defaults(defaults):
    from serving.scheduler import SchedulerConfig

    assert wiring.scheduler_config(defaults) == SchedulerConfig()


def test_the_pipeline_config_defaults_are_the_settings_defaults(defaults):
    from rag.pipeline import PipelineConfig

    assert wiring.pipeline_config(defaults) == PipelineConfig()


def test_the_decomposer_and_searcher_defaults_are_the_settings_defaults(defaults):
    import inspect

    from rag.decompose import Decomposer, check_question
    from retrieval.search import PageSearcher

    decomposer = inspect.signature(Decomposer).parameters
    assert decomposer["max_n"].default == defaults.answer.max_sub_questions
    assert decomposer["max_question_chars"].default == defaults.answer.max_question_chars
    assert decomposer["max_tokens"].default == defaults.answer.decompose_max_tokens
    assert decomposer["fixed_tokens"].default == DevelopmentKnobs().decompose_fixed_tokens
    assert inspect.signature(check_question).parameters["limit"].default == defaults.answer.max_question_chars
    assert inspect.signature(PageSearcher).parameters["top_k"].default == defaults.retrieval.top_k


def test_the_engine_config_carries_every_engine_setting(defaults):
    custom = defaults.replace(**{
        "kv_block_size": 64, "kv_cache_gib": 3, "max_model_len": 1024, "max_images_per_prompt": 2,
        "enforce_eager": True, "engine_dtype": "float32", "max_num_seqs": 7,
    })
    config = wiring.engine_config(custom)
    assert (config.block_size, config.kv_cache_gib, config.max_model_len, config.max_images_per_prompt,
            config.enforce_eager, config.dtype, config.max_num_seqs) == (64, 3, 1024, 2, True, "float32", 7)
    assert wiring.engine_config(defaults).block_size is None  # 0 means vLLM's platform default


def test_the_engine_processes_poll_10_ms_on_a_cpu_host_unless_set_and_never_zero(defaults, monkeypatch):
    import dataclasses

    import torch

    from serving.engine.config import CPU_SPIN_S, EngineConfig, resolve_spin_s
    from serving.engine.lifeline import SPIN_VAR
    from serving.vllm_launch import serve_env

    assert not torch.cuda.is_available()  # these hosts: the CPU default
    assert wiring.engine_config(defaults).spin_s == CPU_SPIN_S == 0.01
    def built_by_hand() -> EngineConfig:  # as a benchmark or a test builds one: spin_s left out
        return EngineConfig(block_size=32, kv_cache_gib=1, max_model_len=1024, max_images_per_prompt=1,
                            enforce_eager=True, dtype="float32", max_num_seqs=1)

    by_hand = built_by_hand()
    assert by_hand.spin_s == CPU_SPIN_S  # it takes the host's default
    custom = wiring.engine_config(defaults.replace(engine_spin_ms=250))
    assert custom.spin_s == 0.25
    assert serve_env(custom)[SPIN_VAR] == "0.25"  # a `vllm serve` replica's engine core reads it
    assert SPIN_VAR not in serve_env(dataclasses.replace(custom, spin_s=None))  # None: vLLM's own second
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_spin_s(-1) is None  # a GPU host keeps vLLM's second
    assert dataclasses.replace(by_hand).spin_s == CPU_SPIN_S  # a copy keeps the value it was built with
    assert built_by_hand().spin_s is None  # built on a GPU host: vLLM's second
    with pytest.raises(ValueError, match="MMRAG_ENGINE_SPIN_MS is -1 .* or above 0"):
        defaults.replace(engine_spin_ms=0)


@pytest.mark.slow  # imports vLLM (seconds)
def test_an_engine_core_s_queue_readers_poll_for_the_window_it_was_given(monkeypatch):
    """serving/engine/lifeline.limit_queue_spin, as run in an engine core: vLLM's shared-memory queue readers made
    after it poll for SPIN_VAR seconds, not vLLM's 1; without the variable vLLM's own stays."""
    import zmq
    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.utils.network_utils import get_open_zmq_ipc_path

    from serving.engine.lifeline import SPIN_VAR, limit_queue_spin, spin_env

    monkeypatch.setattr(shm_broadcast.SpinCondition, "__init__", shm_broadcast.SpinCondition.__init__)
    context = zmq.Context()
    try:
        def reader():
            shm_broadcast.SpinCondition(is_reader=False, context=context, notify_address=address)
            return shm_broadcast.SpinCondition(is_reader=True, context=context, notify_address=address)

        address = get_open_zmq_ipc_path()
        monkeypatch.delenv(SPIN_VAR, raising=False)
        assert limit_queue_spin() is None and reader().busy_loop_s == 1  # vLLM's own
        env: dict[str, str] = {}
        spin_env(0.01, env)
        monkeypatch.setenv(SPIN_VAR, env[SPIN_VAR])
        assert limit_queue_spin() == limit_queue_spin() == 0.01  # idempotent: wrapped once
        address = get_open_zmq_ipc_path()
        assert reader().busy_loop_s == 0.01
    finally:
        context.destroy(linger=0)


def test_auto_dtype_is_what_the_cpu_runs_natively():
    from mmrag.adapters.hardware import native_cpu_dtype

    assert native_cpu_dtype({"avx2", "avx512f", "avx512_bf16"}) == "bfloat16"
    assert native_cpu_dtype({"avx2", "amx_bf16"}) == "bfloat16"
    # AVX2-only (e.g. AMD EPYC Zen 3): bf16 is emulated there, ~5x slower than fp32.
    assert native_cpu_dtype({"avx2", "fma"}) == "float32"


EMULATED_PROBE = """
import json, torch
from mmrag.adapters.hardware import cpu_flags
from mmrag.bench.runner import machine_info
from serving.engine.config import resolve_dtype
from vllm.platforms import current_platform
current_platform.import_kernels()
libs = sorted({l.split()[-1].rsplit("/", 1)[-1] for l in open("/proc/self/maps") if "vllm/_C" in l})
print(json.dumps({"aten": torch.backends.cpu.get_cpu_capability(), "avx512": torch.cpu._is_avx512_supported(),
                  "flags": sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx"))),
                  "auto": resolve_dtype("auto"), "vllm": libs, "machine": machine_info()["emulated_isa"]}))
"""


@pytest.mark.slow
def test_an_emulated_avx2_run_caps_every_kernel_and_auto_picks_fp32(tmp_path):
    """`mmrag bench --emulate-avx2` (MMRAG_EMULATE_ISA=avx2) on this host: the kernels an AVX2-only EPYC runs."""
    import json
    import subprocess
    import sys

    from mmrag.adapters.hardware import emulation_env

    env = emulation_env({**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}, "avx2")
    out = subprocess.run([sys.executable, "-c", EMULATED_PROBE], env=env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe == {"aten": "AVX2", "avx512": False, "flags": [], "auto": "float32", "vllm": ["_C_AVX2.abi3.so"],
                     "machine": "avx2"}, probe

    bad = subprocess.run([sys.executable, "-m", "mmrag", "--help"], env={**os.environ, "MMRAG_EMULATE_ISA": "sse2"},
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "MMRAG_EMULATE_ISA='sse2'" in bad.stderr and "avx2" in bad.stderr, bad.stderr
    # From an environment without the caps (this suite may itself run under them: make test-avx2).
    capped = set(emulation_env({}, "avx2"))
    plain = {k: v for k, v in os.environ.items() if k not in capped}
    again = subprocess.run([sys.executable, "-m", "mmrag", "--help"], env={**plain, "MMRAG_EMULATE_ISA": "avx2"},
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert again.returncode == 0 and "re-executing under AVX2" in again.stderr, again.stderr
    assert "ingest" in again.stdout  # the re-executed command is the one asked for


THREADS_PROBE = """
import hashlib, sys, torch
from PIL import Image, ImageDraw
from mmrag.adapters.vision import VisionEncoder
from mmrag.core.keys import ResolutionPolicy
encoder = VisionEncoder(sys.argv[1], ResolutionPolicy(3136, 200704))
page = Image.new("RGB", (1123, 794), "white")
ImageDraw.Draw(page).rectangle((100, 100, 800, 600), outline="black", width=5)
for threads in (2, 1):
    torch.set_num_threads(threads)
    print(hashlib.sha256(encoder.encode([page])[0].image_tokens.numpy().tobytes()).hexdigest())
"""


@pytest.mark.slow
@pytest.mark.parametrize("isa", [None, "avx2"])
def test_a_pages_tokens_do_not_depend_on_the_thread_count(tiny_model, isa):
    """MKL_CBWR=AUTO,STRICT (mmrag/adapters/hardware.reproducible_numerics): with AVX2 kernels a page's fp32 tokens
    differed at 1 and 2 threads without it, so two processes wrote different bytes under one key."""
    import subprocess
    import sys

    from mmrag.adapters.hardware import emulation_env

    env = emulation_env(dict(os.environ), isa) if isa else dict(os.environ)
    out = subprocess.run([sys.executable, "-c", THREADS_PROBE, str(tiny_model)], env=env, capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    two, one = out.stdout.split()[-2:]
    assert two == one


def test_the_feature_store_is_where_the_settings_say(defaults, tmp_path, redis_url):
    disk = wiring.feature_store(defaults.replace(**{"data_dir": tmp_path}))
    assert disk.backend == "disk" and str(tmp_path / "features") in str(disk.root)
    redis = wiring.feature_store(defaults.replace(**{"redis_url": redis_url}))
    assert redis.backend == "redis"


@pytest.mark.parametrize(("setting", "random_weights", "asks_model"), [
    ("auto", True, False), ("auto", False, True), ("model", True, True), ("rules", False, False),
])
def test_the_decomposer_asks_the_model_unless_its_weights_are_random(defaults, setting, random_weights, asks_model):
    from types import SimpleNamespace

    engine = SimpleNamespace(random_weights=random_weights)  # the one attribute the choice reads
    decomposer = wiring.decomposer(defaults.replace(**{"decomposer": setting}), engine)
    assert (decomposer.model is not None) is asks_model


def test_the_answer_modes_are_one_list_in_settings_the_api_and_the_cli():
    from typing import get_args

    from mmrag.cli import ANSWER_MODES
    from mmrag.core.settings import DEPRECATED_ANSWER_MODES, AnswerSection
    from rag.plans import AnswerMode
    from serving.api.schemas import AnswerModeName

    names = tuple(m.value for m in AnswerMode) + tuple(DEPRECATED_ANSWER_MODES)  # the old names, one release
    assert get_args(AnswerSection.model_fields["mode"].annotation) == names == ANSWER_MODES
    assert get_args(AnswerModeName) == names


def test_component_defaults_are_declared_once_in_the_settings():
    """SchedulerConfig, PipelineConfig, the Decomposer, the searcher, the ingest jobs and the Ray config take their
    defaults from Settings (mmrag/core/settings.default_of), not from numbers of their own that a test would have
    to keep in step."""
    import ast
    import inspect

    import rag.decompose
    import rag.pipeline
    import retrieval.search
    import serving.ingest_jobs
    import serving.ray.app
    import serving.scheduler

    def literal_defaults(module, cls: str) -> set[str]:
        """The fields (a dataclass) or keyword parameters (``__init__``) of ``cls`` whose default is a literal."""
        tree = ast.parse(inspect.getsource(module))
        (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
        pairs = [(s.target.id, s.value) for s in node.body if isinstance(s, ast.AnnAssign) and s.value]
        for init in (s for s in node.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"):
            pairs += [(a.arg, d) for a, d in zip(init.args.kwonlyargs, init.args.kw_defaults, strict=True) if d]
        return {field for field, value in pairs if isinstance(value, ast.Constant) and value.value is not None}

    assert literal_defaults(serving.scheduler, "SchedulerConfig") == set()
    assert literal_defaults(rag.pipeline, "PipelineConfig") == set()
    assert literal_defaults(retrieval.search, "PageSearcher") == set()
    assert literal_defaults(serving.ingest_jobs, "IngestJobs") == set()
    assert literal_defaults(serving.ray.app, "RayServeConfig") == set()
    # Not settings: the model decomposer's answer cap, the salt and the memory the wiring passes.
    assert literal_defaults(rag.decompose, "Decomposer") == {"max_len", "cache_salt", "remember"}


def test_a_copy_of_the_settings_is_what_it_is_given_and_not_read_again_from_the_environment(monkeypatch):
    monkeypatch.setenv("MMRAG_TIERS", '{"tiny": {"min_pixels": 3136, "max_pixels": 12544}}')
    settings = Settings()
    monkeypatch.setenv("MMRAG_TOP_K", "9")  # set after: the copy keeps the original's value
    copy = settings.replace(tiers={"wide": {"min_pixels": 3136, "max_pixels": 401408}})
    assert list(copy.vision.tiers) == ["wide"]  # the given map, not merged with the variable's (JSON) one
    assert copy.retrieval.top_k == settings.retrieval.top_k != 9


def test_the_documents_section_is_the_settings_own_values_and_defaults():
    """Settings.documents, what the loaders, the ingestor, the re-encoder and the tiers receive: each field is the
    setting of the same name, with its value and, built alone (a test, a tool), its default."""
    import dataclasses

    from mmrag.core.settings import DocumentSettings, default_of, flat_names

    names = [f.name for f in dataclasses.fields(DocumentSettings)]
    assert set(names) <= set(flat_names())
    assert DocumentSettings() == DocumentSettings(**{n: default_of(n) for n in names})
    given = Settings(pdf_dpi=150, ocr=False, ocr_lang="deu", figures=False, max_image_pixels=1234,
                     max_image_bytes=5678, max_pdf_pages=9).documents
    assert given == DocumentSettings(pdf_dpi=150, ocr=False, ocr_lang="deu", figures=False, max_image_pixels=1234,
                                     max_image_bytes=5678, max_pdf_pages=9)
    with pytest.raises(dataclasses.FrozenInstanceError):
        given.ocr = True  # type: ignore[misc]  # a reader's own variant is dataclasses.replace(...)


def test_the_rest_and_vision_services_sections_are_the_settings_own_values_and_defaults(tmp_path):
    """Settings.api (serving/api) and Settings.vision_service (serving/vision) carry each setting they name with
    its value, and, built alone, Settings' defaults; keys stay out of their reprs (a log line never shows one)."""
    import dataclasses

    from mmrag.core.keys import ResolutionPolicy
    from mmrag.core.settings import (SECTIONS, ApiSettings, ServedFolders, VisionServiceSettings, default_of,
                                     flat_names)

    own = [f.name for f in dataclasses.fields(ApiSettings) if f.name not in ("documents", "tiers", "folders")]
    assert set(own) <= set(flat_names()) | {"page_image_channel"}
    # every field at its declared default, no environment read
    defaults = Settings.model_construct(**{name: section.model_construct() for name, section in SECTIONS.items()})
    assert ApiSettings() == dataclasses.replace(
        defaults.api_service, page_image_channel=False, folders=ServedFolders(),
        tiers=ApiSettings().tiers)  # tiers: standard's policy only, as Settings declares it
    assert ApiSettings().tiers.policy("standard") == ResolutionPolicy(default_of("min_pixels"),
                                                                      default_of("max_pixels"))
    api = Settings(data_dir=tmp_path, max_upload_bytes=123, max_question_images=2, warm_top=0, api_key="sekrit",
                   http_body_timeout_s=7.5, figure_crops=False, pdf_dpi=150,
                   tiers={"low": ResolutionPolicy(3136, 50176)}).api_service
    assert (api.max_upload_bytes, api.max_question_images, api.warm_top, api.api_key) == (123, 2, 0, "sekrit")
    assert (api.http_body_timeout_s, api.figure_crops, api.documents.pdf_dpi) == (7.5, False, 150)
    assert api.tiers.policy("low") == ResolutionPolicy(3136, 50176) and api.folders.data_dir == tmp_path
    assert "sekrit" not in repr(api)

    vision = Settings(data_dir=tmp_path, vision_api_key="v-key", vision_queue_cap=9, max_request_pixels=10**6,
                      max_pixels_in_flight=2 * 10**6, max_image_bytes=4096).vision_service
    assert vision == VisionServiceSettings(
        documents=dataclasses.replace(Settings(max_image_bytes=4096).documents), folders=ServedFolders(tmp_path),
        api_key="v-key", queue_cap=9, max_request_pixels=10**6, max_pixels_in_flight=2 * 10**6)
    assert "v-key" not in repr(vision)
    assert VisionServiceSettings().queue_cap == default_of("vision_queue_cap")


def test_a_tenants_collection_reaches_the_builders_as_an_argument_not_as_a_patched_copy_of_the_settings(tmp_path):
    """`--tenant` and the server's tenant views: the settings stay as configured (what `mmrag config show` says)
    and the tenant's collection is passed to the index and searcher builders."""
    from mmrag import wiring

    settings = Settings(data_dir=tmp_path, qdrant_url="", qdrant_collection="pages")
    same, scope = wiring.for_tenant("acme", settings)
    assert same is settings and settings.storage.qdrant_collection == "pages" and not hasattr(Settings, "scoped")
    assert scope.collection == "pages--acme" and wiring.for_tenant("default", settings)[1].collection == "pages"
    index = wiring.page_index(settings, 8, collection=scope.collection)
    try:
        assert index.collection == "pages--acme" and index.client.collection_exists("pages--acme")
        assert not index.client.collection_exists("pages")
    finally:
        index.client.close()
    reader = wiring.read_index(settings)
    try:
        assert reader.collection == "pages" and reader.client.collection_exists("pages--acme")
    finally:
        reader.client.close()
