#!/usr/bin/env bash
# `make demo`: sample corpus + (tiny) model → ingest. Uses MMRAG_MODEL when set, else builds the tiny
# random-weight Qwen2-VL offline and says so. State lives in $MMRAG_DATA_DIR (default .mmrag/demo).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export MMRAG_DATA_DIR=${MMRAG_DATA_DIR:-.mmrag/demo}
MMRAG=.venv/bin/mmrag
CORPUS=demo-data/corpus

if [ -z "${MMRAG_MODEL:-}" ]; then
    echo "[demo] MMRAG_MODEL is not set: using the tiny random-weight Qwen2-VL (answers are not meaningful)"
fi
[ -f "$CORPUS/manifest.json" ] || $MMRAG corpus sample --out "$CORPUS"

echo "[demo] ingesting $CORPUS"
$MMRAG ingest "$CORPUS" || echo "[demo] some files failed (see above); continuing with the rest"
echo "[demo] ingesting again: an unchanged corpus encodes nothing"
$MMRAG ingest "$CORPUS" --json
