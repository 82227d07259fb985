"""Which VLM checkpoint mmrag uses: MMRAG_MODEL, or the tiny random-weight test model built offline."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from core.settings import Settings


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


def resolve_model(settings: Settings, *, build_tiny: bool = True) -> ModelSource:
    """The configured checkpoint (local folder or a hub id already in the local HF cache), else the tiny model."""
    from ingestion.tiny_model import MODEL_NAME, ensure_tiny_model, is_random_weight_model

    if settings.model:
        path = _local_checkpoint(settings.model)
        return ModelSource(path, settings.model, is_random_weight_model(path))
    tiny = settings.tiny_model_dir
    if not build_tiny and not (tiny / "config.json").is_file():
        raise ModelNotFoundError(f"no MMRAG_MODEL configured and no tiny model at {tiny}; run `mmrag model tiny`")
    return ModelSource(ensure_tiny_model(tiny), MODEL_NAME, True)


def _local_checkpoint(model: str) -> Path:
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"MMRAG_MODEL={model} has no config.json; point it at a Qwen2-VL checkpoint folder")
        return path.resolve()
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(model, local_files_only=True))
    except LocalEntryNotFoundError as exc:
        raise ModelNotFoundError(
            f"MMRAG_MODEL={model} is neither a local folder nor in the local Hugging Face cache, and mmrag never "
            "downloads at run time. Download it where there is network (`huggingface-cli download "
            f"{model}`), or point MMRAG_MODEL at a local checkpoint folder."
        ) from exc
