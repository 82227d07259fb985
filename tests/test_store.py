"""FeatureStore on local disk and in a real redis-server: round trips, stats, atomicity, key safety."""

import hashlib
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from mmrag.core.keys import ContentHash, EncoderVersion, ImageKey, ResolutionPolicy
from mmrag.core.pages import EncodedImage
from mmrag.adapters.store import DiskFeatureStore, FeatureStoreError, RedisFeatureStore, encode_entry
from tests.waiting import eventually_sync

POLICY = ResolutionPolicy(3136, 200704)


def key(i: int) -> ImageKey:
    return ImageKey(ContentHash(hashlib.sha256(str(i).encode()).hexdigest()), EncoderVersion("ab" * 8), POLICY)


def value(seed: int, n: int = 16) -> EncodedImage:
    g = torch.Generator().manual_seed(seed)
    return EncodedImage(torch.randn(n, 32, generator=g), torch.tensor([[1, 8, 8]], dtype=torch.int64))


@pytest.fixture(params=["disk", pytest.param("redis", marks=pytest.mark.server)])
def store(request, tmp_path):
    if request.param == "disk":
        return DiskFeatureStore(tmp_path / "features")
    url = request.getfixturevalue("redis_url")
    s = RedisFeatureStore(url, prefix=f"test:{request.node.name}:")
    s.client.flushdb()
    return s


def test_round_trip_is_exact_and_counted(store):
    v = value(1)
    assert store.get(key(1)) is None
    store.put(key(1), v)
    got = store.get(key(1))
    assert torch.equal(got.image_tokens, v.image_tokens) and torch.equal(got.grid_thw, v.grid_thw)
    assert got.image_tokens.dtype == torch.float32
    s = store.stats
    assert (s.lookups, s.hits, s.writes) == (2, 1, 1)
    assert s.bytes_written > 16 * 32 * 4 and s.bytes_read == s.bytes_written


def test_contains_and_keys_list_what_was_written(store):
    for i in range(3):
        store.put(key(i), value(i))
    assert store.contains(key(2)) and not store.contains(key(9))
    assert sorted(store.keys()) == sorted(key(i) for i in range(3))


def test_has_pixels_reads_whether_an_entry_keeps_its_pixels_from_its_header(store):
    """The pixels form's check (`mmrag reencode` with MMRAG_IMAGE_INPUT=pixels) without reading any tokens."""
    import dataclasses

    assert store.has_pixels(key(1)) is None  # no entry
    store.put(key(1), value(1))
    store.put(key(2), dataclasses.replace(value(2), pixels_png=b"\x89PNG not really"))
    reads = store.stats.bytes_read
    assert store.has_pixels(key(1)) is False and store.has_pixels(key(2)) is True
    assert store.stats.bytes_read == reads  # the header only: no entry was read through get
    assert store.get(key(2)).pixels_png == b"\x89PNG not really"


def test_an_entry_read_under_another_key_is_refused(store, tmp_path):
    # Simulate a swapped/renamed entry: the bytes of key(1) stored under key(2).
    blob = encode_entry(key(1), value(1))
    if isinstance(store, DiskFeatureStore):
        path = store.path_for(key(2))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(blob)
    else:
        store.client.set(store._name(key(2)), blob)
    with pytest.raises(FeatureStoreError, match="refusing to serve"):
        store.get(key(2))


@pytest.mark.slow
def test_disk_store_never_leaves_a_torn_entry_when_killed_mid_write(tmp_path):
    # A child process writes large entries in a loop and is SIGKILLed; every entry left must decode whole.
    root = tmp_path / "features"
    code = textwrap.dedent(f"""
        import hashlib, torch
        from mmrag.core.keys import *
        from mmrag.core.pages import EncodedImage
        from mmrag.adapters.store import DiskFeatureStore
        s = DiskFeatureStore({str(root)!r})
        print("ready", flush=True)
        for i in range(10_000):
            k = ImageKey(ContentHash(hashlib.sha256(str(i).encode()).hexdigest()), EncoderVersion("ab" * 8),
                         ResolutionPolicy(3136, 200704))
            s.put(k, EncodedImage(torch.full((4096, 256), float(i)), torch.tensor([[1, 128, 128]])))
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=os.getcwd())
    assert proc.stdout.readline().strip() == b"ready"

    def three_written() -> bool:
        if len(list(root.glob("??/*.safetensors"))) >= 3:
            return True
        if proc.poll() is not None:
            pytest.fail(f"the writer died or wrote nothing (exit {proc.returncode})")
        return False

    eventually_sync(three_written, timeout=120, what="three entries written")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    store = DiskFeatureStore(root)
    assert list(root.glob("??/.tmp-*")) == [], "a killed writer's temp file must be removed on open"
    keys = list(store.keys())
    assert keys, "the writer was killed before writing anything"
    for k in keys:
        v = store.get(k)
        assert v.image_tokens.shape == (4096, 256)
        assert torch.all(v.image_tokens == v.image_tokens[0, 0])


def test_redis_store_names_the_fix_when_redis_is_down():
    with pytest.raises(FeatureStoreError, match="MMRAG_REDIS_URL"):
        RedisFeatureStore("redis://127.0.0.1:1/0")


def test_a_leased_entry_outlives_delete_until_its_last_lease_ends(store):
    """Leases are kept where the entries are: another process's store (here a second instance) sees them."""
    store.put(key(1), value(1))
    other = (DiskFeatureStore(store.root) if isinstance(store, DiskFeatureStore)
             else RedisFeatureStore(store.where, prefix=store.prefix))
    store.lease([key(1), key(2)], "answer-a", ttl_s=60)  # key(2) is not stored: leasing it is allowed
    other.lease([key(1)], "conversation-b", ttl_s=60)
    assert other.leased(key(1)) and store.leased(key(2)) and not store.leased(key(3))
    assert other.delete(key(1)) == 0 and store.contains(key(1)), "a leased entry must stay"
    store.release([key(1), key(2)], "answer-a")
    assert store.leased(key(1)) and not store.leased(key(2)), "b's lease still holds key(1)"
    assert store.delete(key(1)) == 0
    other.release([key(1)], "conversation-b")
    other.release([key(1)], "never-held")  # ignored
    assert not store.leased(key(1))
    assert store.delete(key(1)) > 0 and not store.contains(key(1))


@pytest.mark.parametrize("race", ["folder gone before the touch", "folder gone inside mkdir"])
def test_a_lease_taken_while_another_holders_release_removes_the_folder_is_taken(tmp_path, monkeypatch, race):
    """The last lease's release removes the key's lease folder (rmdir), at any moment of another holder's lease:
    between its mkdir and its touch, or inside mkdir after it found the folder there (pathlib then re-raises
    FileExistsError: CI saw an answer fail with 503 "File exists" so). The lease is taken all the same."""
    import pathlib

    store = DiskFeatureStore(tmp_path)
    store.lease([key(1)], "answer-a", ttl_s=60)
    folder = store._lease_dir(key(1))
    real_touch, real_mkdir = pathlib.Path.touch, os.mkdir
    raced = []

    def release_then(real):
        def racing(*args, **kwargs):
            if not raced:
                raced.append(True)
                store.release([key(1)], "answer-a")  # the folder goes with the last lease
                assert not folder.exists()
                if real is real_mkdir:
                    raise FileExistsError(17, "File exists", str(args[0]))  # it was there when mkdir looked
            return real(*args, **kwargs)
        return racing

    if race == "folder gone before the touch":
        monkeypatch.setattr(pathlib.Path, "touch", release_then(real_touch))
    else:
        monkeypatch.setattr(os, "mkdir", release_then(real_mkdir))
    store.lease([key(1)], "answer-b", ttl_s=60)
    assert raced and store.leased(key(1)) and (folder / "answer-b").exists()


def test_an_expired_lease_holds_nothing(store):
    """A holder killed before it released: its lease ends by itself (here one that ended 1 s ago)."""
    store.put(key(1), value(1))
    store.lease([key(1)], "killed-holder", ttl_s=-1)
    assert not store.leased(key(1))
    store.lease([key(1)], "live-holder", ttl_s=60)
    store.lease([key(1)], "live-holder", ttl_s=-1)  # renewed to an end in the past: ended
    assert not store.leased(key(1)) and store.delete(key(1)) > 0
