"""Which VLM checkpoint a component loads: one resolution rule for every caller, and its random-weight marker.

``MMRAG_MODEL`` names a local folder or a hub id already in the local Hugging Face cache; mmrag never
downloads at run time. Which checkpoint to use when none is configured (the tiny test model) is decided by
the composition root (``mmrag/wiring/``), not here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Written by the tiny-model builder (mmrag/devkit/tiny_model.py) into every random-weight checkpoint it makes.
MARKER_FILE = "mmrag_model.json"

# The files whose bytes decide what a checkpoint computes: its config and its weights. Tokenizer and chat
# template are left out: a replica serving another one is caught on its first answer, whose prompt length
# then differs from the local render (serving/engine/remote.py).
_CONFIG_FILE = "config.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin")
# A `vllm serve` replica announces the fingerprint of the checkpoint it loaded as a second served name
# (`mmrag engine serve` adds it; vLLM lists one /v1/models card per served name and answers to any of them).
FINGERPRINT_NAME_PREFIX = "mmrag-checkpoint-"
# The hub names each blob of its cache by the sha256 of its content (LFS files: the weights); git blobs
# (small files) by a 40-digit SHA-1, which is not a content sha256 and is hashed like any other file.
_SHA256_NAME = re.compile(r"[0-9a-f]{64}")


@dataclass(slots=True, frozen=True)
class ModelSource:
    path: Path
    name: str
    random_weights: bool  # a test model: its answers are not meaningful, and every answer says so

    def describe(self) -> str:
        if self.random_weights:
            return f"{self.name} (random-weight test model at {self.path}: answers are not meaningful)"
        return f"{self.name} ({self.path})"


class ModelNotFoundError(RuntimeError):
    pass


def configured_model(model: str) -> ModelSource:
    """The checkpoint MMRAG_MODEL names, as a :class:`ModelSource`."""
    path = local_checkpoint(model)
    # A folder is named by its last part: answers and metrics must not show the server's filesystem.
    name = path.name if Path(model).expanduser().is_dir() else model
    return ModelSource(path, name, is_random_weight_model(path))


def local_checkpoint(model: str | Path) -> Path:
    """A local folder as is (it must hold config.json); a hub id to its snapshot in the local cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"MMRAG_MODEL={model} has no config.json; point it at a Qwen2-VL, Qwen2.5-VL or Qwen3-VL checkpoint folder")
        return path.resolve()
    if path.is_absolute() or str(model).startswith((".", "~")):  # meant as a folder, not a hub id
        raise ModelNotFoundError(
            f"model folder {path} does not exist; set MMRAG_MODEL to a local checkpoint folder or a hub id "
            "(leave it empty for the tiny random-weight test model)"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(model), local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError) as exc:
        raise ModelNotFoundError(
            f"MMRAG_MODEL={model} is neither a local folder nor in the local Hugging Face cache, and mmrag never "
            f"downloads at run time. Download it where the hub is reachable (`hf download {model}`), or point "
            "MMRAG_MODEL at a local checkpoint folder (leave it empty for the tiny random-weight test model)."
        ) from exc


def read_marker(path: str | Path) -> dict[str, Any] | None:
    """The parsed random-weight marker of a model folder, or None when there is none (a real model)."""
    marker = Path(path) / MARKER_FILE
    if not marker.is_file():
        return None
    return json.loads(marker.read_text(encoding="utf-8"))


def is_random_weight_model(path: str | Path) -> bool:
    """True when ``path`` holds a checkpoint built by the tiny-model builder (its answers are meaningless)."""
    marker = read_marker(path)
    return marker is not None and marker.get("random_weights") is True


def checkpoint_fingerprint(path: str | Path) -> str:
    """sha256 over the names and content digests of a checkpoint's config.json and weight files.

    Two folders holding the same files have the same fingerprint wherever they are (a hub snapshot and a copy
    of it too); a fine-tune, even with the same config and tensor shapes, has another. It is what replicas are
    compared by (serving/engine/remote.py): a name says nothing about the weights behind it.
    """
    root = Path(path)
    files = [root / _CONFIG_FILE, *sorted(p for p in root.iterdir() if p.name.endswith(_WEIGHT_SUFFIXES))]
    h = hashlib.sha256(b"mmrag-checkpoint-v1\n")
    for file in files:
        h.update(f"{file.name}\0{file_sha256(file)}\n".encode())
    return h.hexdigest()


def fingerprint_name(fingerprint: str) -> str:
    """The served name under which a replica announces ``fingerprint``."""
    return f"{FINGERPRINT_NAME_PREFIX}{fingerprint}"


_digests: dict[tuple[str, int, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """The sha256 of a file's content. A hub cache blob is named by it, so a snapshot's weights are not read;
    another file is read once per process while its size, mtime and inode stay the same (a 7B checkpoint's
    weights take seconds to hash, and every replica check asks again)."""
    real = Path(os.path.realpath(path))
    if path.is_symlink() and _SHA256_NAME.fullmatch(real.name) and real.parent.name == "blobs":
        return real.name
    st = real.stat()
    key = (str(real), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _digests:
        with real.open("rb") as f:
            _digests[key] = hashlib.file_digest(f, "sha256").hexdigest()
    return _digests[key]
