"""One owner of image keys: only encoders mint them, a store scoped to an encoder refuses to write or serve any
other's, and the stale-index fix names the command built for it first.

Pure Python over the disk store and hand-made keys: what is tested here is who may make and use a key, not what
the tokens are (tests/test_tiers.py, tests/test_vision.py and tests/test_upgrade.py run the real tower).
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import re
from pathlib import Path

import pytest
import torch

import mmrag.adapters.store as stores
from mmrag.adapters.store import DiskFeatureStore, ScopedFeatureStore, StaleFeaturesError
from mmrag.core.keys import ContentHash, EncoderVersion, ImageKey, ResolutionPolicy, Tiers
from mmrag.core.pages import EncodedImage
from mmrag.core.payload import STALE_PAGES_FIX, EncoderScope
from serving.engine.features import FeatureProvider

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("mmrag", "ingestion", "retrieval", "rag", "serving")  # mmrag: its core, adapters and bench too

# Where ``ImageKey(...)`` may be called, and why: the encoders mint (their ``key_for``), mmrag/core/keys.py reads the
# string form back (``parse``). A key made anywhere else names tokens that no encoder vouched for.
MINTERS = {
    "mmrag/core/keys.py": "ImageKey.parse: reading a stored key back, not minting one",
    "mmrag/adapters/vision.py": "VisionEncoder.key_for: the in-process encoder",
    "mmrag/adapters/vision_client.py": "RemoteVisionEncoder.key_for: the vision service's encoder",
    "mmrag/retrieval_cmd.py": "`mmrag retrieval latency`: one placeholder key for synthetic pages in an in-memory "
                              "index, timing search only; no tokens are ever stored or fed under it",
}

STANDARD = ResolutionPolicy(3136, 200704)
LOW = ResolutionPolicy(3136, 50176, pool=2)
OURS, THEIRS = EncoderVersion("ab" * 8), EncoderVersion("cd" * 8)


def key(i: int, version: EncoderVersion = OURS, policy: ResolutionPolicy = STANDARD) -> ImageKey:
    return ImageKey(ContentHash(hashlib.sha256(str(i).encode()).hexdigest()), version, policy)


def tokens(n: int = 4) -> EncodedImage:
    return EncodedImage(torch.zeros(n, 8), torch.tensor([[1, 2, 2 * n]]))


def _key_constructions(path: Path) -> list[int]:
    """Lines of ``path`` that call ``ImageKey(...)`` (by name or as an attribute) or ``cls(...)`` inside ImageKey."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and (
        (isinstance(n.func, ast.Name) and n.func.id == "ImageKey")
        or (isinstance(n.func, ast.Attribute) and n.func.attr == "ImageKey"))]


def test_only_encoders_mint_image_keys():
    found = {str(p.relative_to(REPO)): lines for pkg in PRODUCT for p in sorted((REPO / pkg).rglob("*.py"))
             if not p.is_relative_to(REPO / "mmrag" / "devkit")
             if (lines := _key_constructions(p))}
    offenders = {path: lines for path, lines in found.items() if path not in MINTERS}
    assert not offenders, (f"ImageKey(...) built outside the encoders at {offenders}: mint keys with the encoder "
                           "that makes the tokens (`encoder.key_for(content_hash)`), read stored ones with "
                           "ImageKey.parse")
    # The exemptions stay true: each still constructs a key (a stale entry would hide a new offender's path).
    assert set(MINTERS) <= set(found) | {"mmrag/core/keys.py"}


def test_the_minting_rule_sees_a_key_built_outside_the_encoders(tmp_path):
    offender = tmp_path / "offender.py"
    offender.write_text("from core import keys\nfrom mmrag.core.keys import ImageKey\n"
                        "a = ImageKey(h, v, p)\nb = keys.ImageKey(h, v, p)\nc = other(h)\n")
    assert _key_constructions(offender) == [3, 4]


# --- a store scoped to an encoder --------------------------------------------------------------------------


@pytest.fixture
def disk(tmp_path) -> DiskFeatureStore:
    return DiskFeatureStore(tmp_path / "features")


def test_a_scoped_store_refuses_to_write_another_encoders_key_and_names_the_fix(disk):
    scoped = ScopedFeatureStore(disk, EncoderScope(OURS, STANDARD))
    scoped.put(key(1), tokens())
    for foreign in (key(2, THEIRS), key(2, OURS, LOW)):  # another encoder; this encoder under a policy not in scope
        with pytest.raises(stores.OutOfScopeWriteError, match=r"encoder\.key_for"):
            scoped.put(foreign, tokens())
        assert not disk.contains(foreign)  # refused before anything was written
    assert list(disk.keys()) == [key(1)]


def test_a_scoped_store_with_tiers_covers_its_encoder_under_each_tier_and_nothing_else(disk):
    scoped = ScopedFeatureStore(disk, EncoderScope(OURS, STANDARD), tiers=[LOW])
    scoped.put(key(1, OURS, LOW), tokens())
    assert scoped.get(key(1, OURS, LOW)) is not None
    with pytest.raises(stores.OutOfScopeWriteError):
        scoped.put(key(1, THEIRS, LOW), tokens())
    disk.put(key(3, THEIRS), tokens())  # written by another encoder's process, straight to the store
    with pytest.raises(StaleFeaturesError, match="mmrag reencode"):
        scoped.get(key(3, THEIRS))
    assert not scoped.contains(key(3, THEIRS)) and set(scoped.keys()) == {key(1, OURS, LOW)}


def test_the_engines_feature_provider_needs_a_scope(disk):
    with pytest.raises(TypeError):
        FeatureProvider(disk)  # type: ignore[call-arg]  # no scope, no provider


def test_nothing_that_serves_questions_reads_features_unscoped():
    """FeatureProvider.unscoped is for engines fed several encoders' keys on purpose (tests, benchmarks)."""
    offenders = [str(p.relative_to(REPO)) for pkg in ("ingestion", "retrieval", "rag", "serving", "mmrag")
                 for p in sorted((REPO / pkg).rglob("*.py"))
                 if not p.is_relative_to(REPO / "mmrag" / "bench") and not p.is_relative_to(REPO / "mmrag" / "devkit")
                 if any(isinstance(n, ast.Attribute) and n.attr == "unscoped"
                        for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))))
                 and p != REPO / "serving/engine/features.py"]
    assert not offenders


def test_the_feature_provider_serves_its_encoder_in_every_tier_and_refuses_another_encoders_tokens(disk):
    for k in (key(1), key(1, OURS, LOW), key(2, THEIRS)):
        disk.put(k, tokens())
    provider = FeatureProvider.scoped(disk, EncoderScope(OURS, STANDARD), Tiers({"standard": STANDARD, "low": LOW}))
    assert len(asyncio.run(provider.load([key(1), key(1, OURS, LOW)]))) == 2
    with pytest.raises(StaleFeaturesError, match="mmrag reencode"):
        asyncio.run(provider.load([key(2, THEIRS)]))
    untiered = FeatureProvider(disk, EncoderScope(OURS, STANDARD))
    with pytest.raises(StaleFeaturesError):
        asyncio.run(untiered.load([key(1, OURS, LOW)]))  # a tier it was not given is another scope


# --- the stale-index fix -----------------------------------------------------------------------------------


def test_the_stale_pages_fix_names_mmrag_reencode_first_with_options_it_has():
    from typer.main import get_command

    from mmrag.cli import app

    commands = re.findall(r"`(mmrag [^`]*)`", STALE_PAGES_FIX)
    assert commands[0] == "mmrag reencode", STALE_PAGES_FIX
    options = {o for p in get_command(app).commands["reencode"].params for o in p.opts}
    named = set(re.findall(r"--[a-z-]+", STALE_PAGES_FIX.split("Or re-ingest")[0]))
    assert named and named <= options, (named, options)
    assert STALE_PAGES_FIX.index("mmrag reencode") < STALE_PAGES_FIX.index("mmrag ingest")
