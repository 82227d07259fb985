"""MMRAG_VISION_DEVICE and MMRAG_VISION_DTYPE: the encoder runs where they say, ``auto`` follows the host,
and the device kind and dtype are part of the encoder version, so tokens made on one never pass for another's.

This machine has no GPU, so the CUDA path is exercised as far as a CPU host allows: resolution and its errors,
and the version an API host computes for pages a GPU host encodes (no GPU needed). The encoder on a GPU
runs the same code with ``.to("cuda")`` (scripts/check_vision_gpu.py is the check a GPU host runs).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from mmrag.adapters.hardware import VisionPlacement, vision_placement
from mmrag.adapters.vision import VisionEncoder, encoder_version_of
from mmrag.core.settings import Settings
from mmrag import wiring
from mmrag.errors import describe
from tests.test_vision import POLICY, noise_images

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="these tests state what a GPU-less host does")


@pytest.fixture
def settings(tiny_model, tmp_path, monkeypatch) -> Settings:
    for name in list(os.environ):
        if name.startswith("MMRAG_"):
            monkeypatch.delenv(name)
    return Settings(model=str(tiny_model), data_dir=tmp_path)


def test_auto_is_the_cpu_in_float32_on_a_host_without_a_gpu():
    assert vision_placement("auto", "auto") == VisionPlacement("cpu", "float32")
    assert vision_placement("cpu", "bfloat16") == VisionPlacement("cpu", "bfloat16")


def test_cuda_without_a_gpu_names_the_fix():
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match=r"torch sees no GPU.*MMRAG_VISION_DEVICE=cpu"):
            vision_placement(device, "auto")


def test_the_version_of_gpu_encoded_pages_is_computable_without_a_gpu():
    placement = vision_placement("cuda:1", "auto", require_device=False)
    assert (placement.device, placement.kind, placement.dtype) == ("cuda:1", "cuda", "bfloat16")


def test_the_device_kind_is_part_of_the_version_and_the_gpu_index_is_not(tiny_model):
    def version(device: str, dtype: str = "float32") -> str:
        placement = vision_placement(device, dtype, require_device=False)
        return encoder_version_of(tiny_model, salt="", dtype=getattr(torch, placement.dtype),
                                  device_kind=placement.kind)

    cpu = VisionEncoder(tiny_model, POLICY)
    assert version("cpu") == cpu.version  # the CPU version is the one computed before devices were configurable
    assert version("cuda") != cpu.version  # a GPU's kernels give other tokens
    assert version("cuda:0") == version("cuda:1") == version("cuda")
    assert version("cuda", "bfloat16") not in {version("cuda"), version("cpu", "bfloat16")}


def test_the_encoder_runs_where_and_in_the_dtype_the_settings_say(settings):
    model = wiring.resolve_model(settings)
    default = wiring.vision_encoder(settings, model)
    assert {(p.device.type, p.dtype) for p in default.tower.parameters()} == {("cpu", torch.float32)}

    bf16_settings = settings.replace(**{"vision_device": "cpu", "vision_dtype": "bfloat16"})
    bf16 = wiring.vision_encoder(bf16_settings, model)
    assert {(p.device.type, p.dtype) for p in bf16.tower.parameters()} == {("cpu", torch.bfloat16)}
    (tokens,) = bf16.encode(noise_images()[:1])
    assert tokens.image_tokens.dtype == torch.bfloat16 and tokens.image_tokens.device.type == "cpu"
    # The scope serving computes (hashing only, no tower built) is the encoder's own.
    for s, encoder in ((settings, default), (bf16_settings, bf16)):
        assert wiring.encoder_scope(s, model).version == encoder.version
    assert bf16.version != default.version


@pytest.mark.parametrize(("variable", "value", "expected"), [
    ("MMRAG_VISION_DEVICE", "gpu", "MMRAG_VISION_DEVICE='gpu': use auto, cpu, cuda or cuda:N"),
    ("MMRAG_VISION_DTYPE", "float33", "MMRAG_VISION_DTYPE='float33': Input should be 'auto', 'float32'"),
])
def test_a_bad_value_names_the_variable_and_what_it_takes(monkeypatch, variable, value, expected):
    monkeypatch.setenv(variable, value)
    with pytest.raises(Exception) as raised:
        Settings()
    assert describe(raised.value).startswith(expected)
    # And the CLI says the same in one line, no traceback (exit code 2: a configuration error).
    done = subprocess.run([sys.executable, "-m", "mmrag", "index", "check"], capture_output=True, text=True,
                          env={**os.environ, variable: value, "COLUMNS": "400"}, timeout=120)
    assert done.returncode == 2 and expected in done.stderr and "Traceback" not in done.stderr
