"""A remote replica is served our image tokens only when it serves the configured checkpoint, compared by
fingerprint (config and weights), never by the name it serves under.

The refusal of a fine-tune served under the configured name runs against the session's real `vllm serve`
replica (tests/conftest.py), mmrag being configured with another checkpoint under that replica's name. A plain
`vllm serve` (started without `mmrag engine serve`, so announcing no fingerprint) is stood for by its
/v1/models answer, built in vLLM's ModelCard shape: starting a second vLLM for each case would cost minutes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from mmrag.adapters.checkpoint import ModelSource, checkpoint_fingerprint, fingerprint_name
from serving.engine.remote import EngineRequestError, RemoteEngine, ReplicaIdentityError, identify_replica

SERVED = "Qwen/Qwen2-VL-2B-Instruct"  # the name both checkpoints are served under
URL = "http://replica:8000"


@pytest.fixture(scope="module")
def fine_tune(tmp_path_factory) -> Path:
    """Another checkpoint with the tiny model's config and tensor shapes, other weights: a fine-tune's case."""
    from mmrag.devkit.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("fine-tune") / "tiny", seed=1)


def models_answer(*cards: tuple[str, str]) -> httpx.Response:
    """GET /v1/models as `vllm serve` answers it: one card per served name, ``root`` the path it loaded."""
    return httpx.Response(200, json={"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "vllm", "root": root, "parent": None,
         "max_model_len": 4096, "permission": []} for name, root in cards]})


# --- the fingerprint ----------------------------------------------------------------------------------------


def test_a_copy_of_a_checkpoint_has_its_fingerprint_and_a_fine_tune_another(tiny_model, fine_tune, tmp_path):
    copy = shutil.copytree(tiny_model, tmp_path / "copy")
    assert checkpoint_fingerprint(copy) == checkpoint_fingerprint(tiny_model)
    assert checkpoint_fingerprint(fine_tune) != checkpoint_fingerprint(tiny_model)
    assert (fine_tune / "config.json").read_bytes() == (tiny_model / "config.json").read_bytes()


def test_a_hub_snapshot_is_fingerprinted_by_its_blob_names_like_a_plain_folder(tiny_model, tmp_path):
    """The hub names a cache blob by its content's sha256: a snapshot's weights need not be read again."""
    import hashlib

    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for f in tiny_model.iterdir():
        if f.is_file():
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            shutil.copy(f, blobs / digest)
            os.symlink(blobs / digest, snapshot / f.name)
    assert checkpoint_fingerprint(snapshot) == checkpoint_fingerprint(tiny_model)


def test_mmrag_engine_serve_announces_the_fingerprint_of_what_it_loads_as_a_second_served_name(tiny_model):
    from serving.engine.config import EngineConfig
    from serving.vllm_launch import serve_command

    config = EngineConfig(block_size=32, kv_cache_gib=1, max_model_len=2048, max_images_per_prompt=2,
                          enforce_eager=True, dtype="float32", max_num_seqs=4)
    argv = serve_command(tiny_model, config, host="127.0.0.1", port=8100)
    at = argv.index("--served-model-name")
    # The first name stays the path (what vLLM answers and labels its metrics with when none is given).
    assert argv[at + 1: at + 3] == [str(tiny_model), fingerprint_name(checkpoint_fingerprint(tiny_model))]


# --- a plain `vllm serve` (no fingerprint announced): the checkpoint its root names, read here -----------------


def test_a_replica_whose_root_holds_another_checkpoint_under_our_name_is_refused_with_the_fix(tiny_model, fine_tune):
    ours = ModelSource(tiny_model, SERVED, True)
    with pytest.raises(ReplicaIdentityError) as caught:
        identify_replica(URL, models_answer((SERVED, str(fine_tune))), ours)
    message = str(caught.value)
    assert checkpoint_fingerprint(fine_tune) in message and checkpoint_fingerprint(tiny_model) in message
    assert "mmrag engine serve" in message and "MMRAG_MODEL" in message


def test_a_replica_whose_root_holds_our_checkpoint_is_served_under_its_name(tiny_model, tmp_path):
    copy = shutil.copytree(tiny_model, tmp_path / "elsewhere")  # the same files at another path
    assert identify_replica(URL, models_answer((SERVED, str(copy))), ModelSource(tiny_model, SERVED, True)) == SERVED


def test_a_replica_whose_checkpoint_this_host_cannot_read_is_refused_with_the_flag_that_announces_it(tiny_model):
    ours = ModelSource(tiny_model, SERVED, True)
    with pytest.raises(ReplicaIdentityError) as caught:
        identify_replica(URL, models_answer((SERVED, "/models/on-another-host")), ours)
    flag = f"--served-model-name {SERVED} {fingerprint_name(checkpoint_fingerprint(tiny_model))}"
    assert flag in str(caught.value) and "mmrag engine serve" in str(caught.value)
    # Started with that flag, it announces the fingerprint, which is then what it is checked by.
    announced = models_answer((SERVED, "/models/on-another-host"),
                              (fingerprint_name(checkpoint_fingerprint(tiny_model)), "/models/on-another-host"))
    assert identify_replica(URL, announced, ours) == SERVED


def test_a_replica_announcing_our_fingerprint_is_ours_whatever_it_is_called_there(tiny_model):
    """It loaded the configured checkpoint's files on its own host, at its own path, under its own name."""
    fingerprint = fingerprint_name(checkpoint_fingerprint(tiny_model))
    answer = models_answer(("/mnt/replica/models/qwen", "/mnt/replica/models/qwen"),
                           (fingerprint, "/mnt/replica/models/qwen"))
    assert identify_replica(URL, answer, ModelSource(tiny_model, SERVED, True)) == "/mnt/replica/models/qwen"


def test_a_replica_serving_another_name_is_still_refused_by_name(tiny_model):
    with pytest.raises(EngineRequestError, match="--served-model-name"):
        identify_replica(URL, models_answer(("some-other-model", "/models/other")),
                         ModelSource(tiny_model, SERVED, True))


# --- the real replica ----------------------------------------------------------------------------------------


def served_names(url: str) -> list[str]:
    return [c["id"] for c in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]


async def test_a_replica_serving_another_checkpoint_under_the_configured_name_is_refused_at_start_up(
        engine_settings, vllm_server, fine_tune):
    from mmrag import wiring
    from serving.engine.features import FeatureProvider

    name = served_names(vllm_server)[0]  # the session replica serves the tiny model (seed 0) under this name
    configured = ModelSource(fine_tune, name, True)  # mmrag configured with another checkpoint of that name
    features = FeatureProvider.unscoped(wiring.feature_store(engine_settings))  # nothing is generated here
    with pytest.raises(ReplicaIdentityError) as caught:
        RemoteEngine.connect([vllm_server], configured, features)
    message = str(caught.value)
    assert checkpoint_fingerprint(fine_tune) in message and "mmrag engine serve" in message

    ours = wiring.resolve_model(engine_settings)
    engine = RemoteEngine.connect([vllm_server], ours, features)
    try:
        assert engine._served_names == {vllm_server: name}  # checked at start-up, not at the first question
    finally:
        await engine.close()


def test_the_wiring_refuses_a_replica_of_another_checkpoint_before_serving(engine_settings, vllm_server, fine_tune):
    """MMRAG_ENGINE_URLS through the composition root, where `mmrag serve`, `ask` and `warm` build their engine."""
    from mmrag import wiring

    settings = engine_settings.replace(**{"engine_urls": [vllm_server]})
    with pytest.raises(ReplicaIdentityError, match="MMRAG_MODEL"):
        wiring.engine(settings, ModelSource(fine_tune, served_names(vllm_server)[0], True))
