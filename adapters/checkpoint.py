"""Which VLM checkpoint a component loads: one resolution rule for every caller, and its random-weight marker.

``MMRAG_MODEL`` names a local folder or a hub id already in the local Hugging Face cache; mmrag never
downloads at run time. Which checkpoint to use when none is configured (the tiny test model) is decided by
the composition root (``mmrag/wiring.py``), not here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Written by the tiny-model builder (devkit/tiny_model.py) into every random-weight checkpoint it makes.
MARKER_FILE = "mmrag_model.json"


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
