# syntax=docker/dockerfile:1
# The mmrag image: the API (service `api` in docker-compose.yml: `mmrag serve`, plus the CLI for ingestion,
# `docker compose exec api mmrag ingest /data/corpus`) and the vision service (`vision`: `mmrag vision serve`).
#
# It installs the CUDA build of vLLM (`.[gpu]`), never constraints.txt: that file pins the CPU torch of the
# development machines. In the compose stack the engine runs in the vLLM image and this process only talks
# to it over HTTP (MMRAG_ENGINE_URLS).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENIZERS_PARALLELISM=false

# tesseract: the OCR fallback for pages without a text layer (ingestion/ocr.py).
RUN apt-get update \
    && apt-get install -y --no-install-recommends tesseract-ocr tesseract-ocr-eng \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
# Every package pyproject.toml installs (mmrag holds the contracts, adapters and kits); tests/test_deploy.py checks.
COPY ingestion/ ingestion/
COPY retrieval/ retrieval/
COPY rag/ rag/
COPY serving/ serving/
COPY mmrag/ mmrag/
RUN --mount=type=cache,target=/root/.cache/pip pip install ".[gpu]"

RUN useradd --create-home --uid 1000 mmrag && mkdir -p /data && chown mmrag /data
USER mmrag
ENV MMRAG_DATA_DIR=/data
VOLUME ["/data"]

EXPOSE 8080
CMD ["mmrag", "serve", "--host", "0.0.0.0", "--port", "8080"]
