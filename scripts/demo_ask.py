"""Part of `make demo`: ask the running server a few questions, print cited answers and cache hit rates."""

from __future__ import annotations

import os
import sys

import httpx
from rich.console import Console
from rich.markup import escape

from serving.metrics import parse_samples, sample_total

QUESTIONS = [
    "What is the retry limit and the timeout of the ingest service?",
    "What was the Q3 revenue of the Nordic division, and how did the operating margin develop?",
    "Which components appear in the system architecture, and how long are backups retained?",
]
# Asked through the OpenAI-compatible route with the `openai` client, streamed, as any OpenAI client would.
CHAT_QUESTION = "How long are backups retained?"
out = Console()
# The server's key when one is set (MMRAG_API_KEY in the demo's environment, as `mmrag serve` reads it).
KEY = os.environ.get("MMRAG_API_KEY", "")
AUTH = {"Authorization": f"Bearer {KEY}"} if KEY else {}


def totals(url: str) -> dict[str, float]:
    samples = parse_samples(httpx.get(f"{url}/metrics", timeout=30).text)
    return {name: sample_total(samples, name) for name in samples}


def rate(num: float, den: float) -> str:
    return f"{num / den:.1%}" if den else "n/a"


def main(url: str) -> None:
    for q in QUESTIONS:
        r = httpx.post(f"{url}/v1/ask", json={"question": q}, headers=AUTH, timeout=600)
        r.raise_for_status()
        a = r.json()
        out.rule(escape(q))
        if a["model"]["random_weights"]:
            out.print(f"[yellow]{escape(a['model']['note'])}[/]")
        out.print(f"sub-questions ({a['sub_question_source']}): " + escape("; ".join(a["sub_questions"])))
        out.print(f"[bold]answer:[/] {escape(a['answer'].strip())}")
        out.print("citations: " + escape(", ".join(f"[{c['doc']}, p.{c['page']}] {c['score']:.2f}"
                                                   for c in a["citations"])))
        u = a["usage"]
        out.print(f"cache: {u['cached_image_tokens']}/{u['image_tokens']} image tokens and {u['cached_tokens']}/"
                  f"{u['prompt_tokens']} prompt tokens from the prefix cache; vision encodes {u['vision_encodes']}")
    chat(url)
    m = totals(url)
    out.rule("hit rates since the server started (warm-up included)")
    out.print(f"image-prefix hit rate (image tokens served from KV): "
              f"{rate(m.get('mmrag_image_tokens_cached_total', 0), m.get('mmrag_image_tokens_total', 0))}")
    out.print(f"prompt-token hit rate: "
              f"{rate(m.get('mmrag_prompt_tokens_cached_total', 0), m.get('mmrag_prompt_tokens_total', 0))}")
    out.print(f"vision-token cache (feature store) hit rate: "
              f"{rate(m.get('mmrag_feature_store_hits_total', 0), m.get('mmrag_feature_store_lookups_total', 0))}")
    out.print(f"vLLM's own prefix-cache hit rate: "
              f"{rate(m.get('vllm:prefix_cache_hits_total', 0), m.get('vllm:prefix_cache_queries_total', 0))}")
    out.print(f"vision forwards while answering: {m.get('mmrag_vision_forwards_total', 0):.0f}")


def chat(url: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key=KEY or "none")  # the openai client wants one: any without
    out.rule(escape(f"{CHAT_QUESTION}  (POST /v1/chat/completions, openai client, stream=True)"))
    text, usage = [], None
    for chunk in client.chat.completions.create(model="mmrag", stream=True, stream_options={"include_usage": True},
                                                messages=[{"role": "user", "content": CHAT_QUESTION}]):
        text += [c.delta.content or "" for c in chunk.choices]
        usage = chunk.usage or usage
    out.print(f"[bold]answer (with footnotes):[/] {escape(''.join(text).strip())}")
    if usage is not None:
        out.print(f"cache: {usage.prompt_tokens_details.cached_tokens}/{usage.prompt_tokens} prompt tokens from the "
                  "prefix cache")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080")
