"""`mmrag bench --transfer`: what moving one page's image tokens from the vision service to the engine costs.

Three paths, per page of the bench corpus, tokens made once by the vision service:

- ``store``: the feature store the service writes and the in-process engine reads (serving/engine/features.py):
  a ``get`` = read the entry + decode it (disk; Redis too when MMRAG_REDIS_URL is set).
- ``binary_http``: the service's binary answer (``POST /v1/encode`` with ``Accept: application/octet-stream``,
  the key already stored): upload the page PNG, get the safetensors blob back, unpack it.
- ``base64_json``: what the remote engine sends a `vllm serve` replica (serving/engine/remote.py image_part):
  ``torch.save`` + base64 inside the chat JSON, and what the replica does to read it (JSON parse, base64
  decode, ``torch.load``).

Bytes are what crosses the wire (or the disk); times are medians over the pages, client and server work of
the path together. The remote engine keeps ``base64_json``: vLLM's OpenAI server takes precomputed embeddings
only inline in the request, so a replica cannot read the store nor fetch the binary answer.
"""

from __future__ import annotations

import base64
import io
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch
from PIL import Image

from mmrag.adapters.store import DiskFeatureStore, FeatureStore, RedisFeatureStore, encode_entry
from mmrag.adapters.vision_client import TOKENS_MEDIA_TYPE, png_bytes, unpack_tokens
from mmrag.core.keys import ImageKey
from serving.engine.remote import image_part
from serving.vision.launch import start_vision_service


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000, 3)


def _timed(run: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = run()
    return time.perf_counter() - t0, out


def _store_path(store: FeatureStore, keys: list[ImageKey]) -> dict[str, Any]:
    times, sizes = [], []
    for key in keys:
        seconds, value = _timed(lambda: store.get(key))
        times.append(seconds)
        sizes.append(len(encode_entry(key, value)))
    return {"ms_per_page": _median_ms(times), "bytes_per_page": int(statistics.median(sizes))}


def _base64_json_path(keys: list[ImageKey], store: FeatureStore) -> dict[str, Any]:
    send, receive, sizes = [], [], []
    for key in keys:
        value = store.get(key)
        seconds, body = _timed(lambda: json.dumps({"content": [image_part(str(key), value)]}))
        send.append(seconds)
        sizes.append(len(body))

        def read() -> torch.Tensor:  # what the replica does with the part (vLLM's embeds loader)
            part = json.loads(body)["content"][0]["image_embeds"]
            return torch.load(io.BytesIO(base64.b64decode(part["image_embeds"])), weights_only=True)

        seconds, tokens = _timed(read)
        receive.append(seconds)
        assert torch.equal(tokens, value.image_tokens)
    return {"ms_per_page": _median_ms([a + b for a, b in zip(send, receive)]), "send_ms": _median_ms(send),
            "receive_ms": _median_ms(receive), "bytes_per_page": int(statistics.median(sizes))}


def _binary_http_path(url: str, pngs: list[bytes], keys: list[ImageKey], store: FeatureStore) -> dict[str, Any]:
    times, sizes = [], []
    with httpx.Client(base_url=url, timeout=120) as http:
        for png, key in zip(pngs, keys):
            def call() -> list:
                answer = http.post("/v1/encode", files=[("images", ("p.png", png, "image/png"))],
                                   headers={"Accept": TOKENS_MEDIA_TYPE})
                answer.raise_for_status()
                sizes.append(len(answer.content))
                return unpack_tokens(answer.content)

            seconds, (entry,) = _timed(call)
            times.append(seconds)
            assert entry.key == key and entry.source == "store" and torch.equal(entry.value.image_tokens,
                                                                                 store.get(key).image_tokens)
    return {"ms_per_page": _median_ms(times), "bytes_per_page": int(statistics.median(sizes)),
            "upload_png_bytes_per_page": int(statistics.median(len(p) for p in pngs))}


def run_transfer(model_path: Path, pages: list[Image.Image], *, redis_url: str, port: int,
                 log: Callable[[str], None]) -> dict[str, Any]:
    """Encode ``pages`` once through a fresh vision service process, then time each path on every page."""
    with tempfile.TemporaryDirectory(prefix="mmrag-transfer-") as tmp:
        data = Path(tmp)
        proc = start_vision_service(model_path, data, port, data / "vision.log")
        try:
            url = f"http://127.0.0.1:{port}"
            pngs = [png_bytes(p) for p in pages]
            with httpx.Client(base_url=url, timeout=300) as http:
                answer = http.post("/v1/encode", files=[("images", (f"{i}.png", b, "image/png"))
                                                        for i, b in enumerate(pngs)])
                answer.raise_for_status()
                body = answer.json()
            keys = [ImageKey.parse(item["key"]) for item in body["images"]]
            log(f"transfer: {len(keys)} pages encoded by the vision service")
            disk = DiskFeatureStore(data / "features")
            out: dict[str, Any] = {"pages": len(keys), "tokens_per_page": disk.get(keys[0]).num_tokens,
                                   "token_width": int(disk.get(keys[0]).image_tokens.shape[1]),
                                   "token_dtype": str(disk.get(keys[0]).image_tokens.dtype).removeprefix("torch.")}
            out["store_disk"] = _store_path(disk, keys)
            if redis_url:
                redis = RedisFeatureStore(redis_url, prefix="mmrag:transfer-bench:")
                try:
                    for key in keys:
                        redis.put(key, disk.get(key))
                    out["store_redis"] = _store_path(redis, keys)
                finally:
                    for key in keys:
                        redis.delete(key)
            out["binary_http"] = _binary_http_path(url, pngs, keys, disk)
            out["base64_json"] = _base64_json_path(keys, disk)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return out


def transfer_table(result: dict[str, Any]) -> str:
    rows = ["| path | ms per page | bytes per page |", "|---|---|---|"]
    for name in ("store_disk", "store_redis", "binary_http", "base64_json"):
        if name in result:
            r = result[name]
            rows.append(f"| {name} | {r['ms_per_page']} | {r['bytes_per_page']:,} |")
    rows.append(f"\n{result['pages']} pages, {result['tokens_per_page']} tokens x {result['token_width']} "
                f"({result['token_dtype']}) each")
    return "\n".join(rows)
