#!/usr/bin/env bash
# `make demo`: sample corpus + (tiny) model → ingest → serve → ask → answers with citations and hit rates.
# Uses MMRAG_MODEL when set, else builds the tiny random-weight Qwen2-VL offline and says so.
# State lives in $MMRAG_DATA_DIR (default .mmrag/demo).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export MMRAG_DATA_DIR=${MMRAG_DATA_DIR:-.mmrag/demo}
PORT=${MMRAG_PORT:-8080}
URL="http://127.0.0.1:$PORT"
MMRAG=.venv/bin/mmrag
CORPUS=demo-data/corpus
if [ -z "${MMRAG_MODEL:-}" ]; then
    echo "[demo] MMRAG_MODEL is not set: using the tiny random-weight Qwen2-VL (its answers are not meaningful)"
    export MMRAG_PROFILE=development  # say so: without a model, production refuses to start
    # CPU-friendly engine settings for the tiny model (a real deployment sizes these for its GPUs).
    export MMRAG_KV_BLOCK_SIZE=${MMRAG_KV_BLOCK_SIZE:-32} MMRAG_KV_CACHE_GIB=${MMRAG_KV_CACHE_GIB:-1}
    export MMRAG_ENFORCE_EAGER=${MMRAG_ENFORCE_EAGER:-true} MMRAG_ANSWER_MAX_TOKENS=${MMRAG_ANSWER_MAX_TOKENS:-24}
fi

[ -f "$CORPUS/manifest.json" ] || $MMRAG corpus sample --out "$CORPUS"
echo "[demo] ingesting $CORPUS"
$MMRAG ingest "$CORPUS" || echo "[demo] some files failed (see above); continuing with the rest"

echo "[demo] starting the server on $URL (vLLM start-up takes ~30 s on CPU; log: $MMRAG_DATA_DIR/serve.log)"
$MMRAG serve --port "$PORT" > "$MMRAG_DATA_DIR/serve.log" 2>&1 &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
    if curl -fs "$URL/readyz" > /dev/null 2>&1; then break; fi
    if ! kill -0 $SERVER 2>/dev/null; then echo "[demo] the server exited:"; tail -30 "$MMRAG_DATA_DIR/serve.log"; exit 1; fi
    sleep 1
done
curl -fs "$URL/readyz" > /dev/null || { echo "[demo] server not ready after 300 s"; tail -30 "$MMRAG_DATA_DIR/serve.log"; exit 1; }
echo "[demo] ready; asking questions"
.venv/bin/python scripts/demo_ask.py "$URL"
echo "[demo] done: the page is at $URL/ui and the API docs at $URL/docs while \`mmrag serve\` runs"
