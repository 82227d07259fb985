"""Prompt layout: ``[fixed system prompt][images in the plan's order][text]`` through the model's chat template.

The same plan always renders the same bytes, so the KV of a shared prefix (system prompt + leading images)
is reusable across requests. The image token spans of the rendered prompt are computed here too: they turn
vLLM's "cached prompt tokens" into "cached image tokens".

The plan's text is untrusted (questions, page text, sub-answers, model-written sub-questions), and vLLM
tokenises the rendered prompt with special tokens parsed, in process and in `vllm serve` alike. So every
special-token string in it is broken with a zero-width space before it reaches the template: the model
reads the same characters, but as text, never as a turn boundary or an image placeholder.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from mmrag.core.engine import Layout, PromptPlan

SYSTEM_PROMPTS: dict[str, str] = {
    "default": (
        "You are mmrag, an assistant that answers questions about document pages. Use only the pages "
        "shown. Be brief, and cite pages as [document, page]."
    ),
    "synthesize": (
        "Combine the answers to the sub-questions below into one brief answer to the question. Keep their "
        "page citations."
    ),
    # rag/decompose.py; the JSON schema sent as guided decoding fixes the reply's shape and item limits.
    "decompose": (
        "You split a question about documents into short, self-contained sub-questions, each answerable from "
        "one page. Reuse the question's own words and add no topic it does not mention. If it asks one thing, "
        "return it unchanged as the only sub-question. Add \"together\": true when the parts must be answered "
        "with their pages seen side by side (a comparison, a relationship, a trend across them). Reply with JSON "
        'only: {"sub_questions": ["..."], "together": false}.'
    ),
}


@dataclass(slots=True, frozen=True)
class PromptTokens:
    prompt_tokens: int
    image_spans: tuple[tuple[int, int], ...]  # (start, length) of each image's tokens, in prompt order

    @property
    def image_tokens(self) -> int:
        return sum(n for _, n in self.image_spans)

    def cached_image_tokens(self, cached_tokens: int) -> int:
        """Image tokens inside the cached prefix ``[0, cached_tokens)``."""
        return sum(max(0, min(start + n, cached_tokens) - start) for start, n in self.image_spans)


# Inserted after a special token's first character. Not a character of any token (checked per tokenizer).
_BREAK = "\u200b"


class TextGuard:
    """Turns untrusted text into text that tokenises without any of the tokenizer's special or added tokens.

    The token strings come from the tokenizer itself (its special tokens and every added token), so a model
    with other control tokens is covered too. Text without them passes unchanged, byte for byte: ordinary
    prompts, and with them the prefix cache, are as before.
    """

    def __init__(self, tokenizer: Any) -> None:
        tokens = set(tokenizer.all_special_tokens) | {t.content for t in tokenizer.added_tokens_decoder.values()}
        tokens.discard("")
        unbreakable = sorted(t for t in tokens if len(t) < 2 or _BREAK in t)
        if unbreakable:
            raise ValueError(f"cannot keep user text from forming the tokens {unbreakable} (single characters, "
                             "or holding U+200B): this tokenizer needs another guard in serving/engine/prompt.py")
        self.pattern = re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))
        # Proof against this tokenizer (its normaliser could drop U+200B): the broken forms are plain text.
        ids = set(tokenizer.convert_tokens_to_ids(sorted(tokens)))
        leaked = [t for t in sorted(tokens) if ids & set(tokenizer.encode(self(t), add_special_tokens=False))]
        if leaked:
            raise ValueError(f"{leaked} still tokenise as special tokens once broken with U+200B; this tokenizer "
                             "needs another guard in serving/engine/prompt.py")

    def __call__(self, text: str) -> str:
        # Breaking one occurrence cannot form another (every new one would hold U+200B), and a pass may skip
        # occurrences overlapping the ones it broke: repeat until none is left. Each pass breaks at least one.
        while (broken := self.pattern.sub(lambda m: m[0][0] + _BREAK + m[0][1:], text)) != text:
            text = broken
        return text


class PromptRenderer:
    def __init__(self, tokenizer: Any, *, image_pad_token: str = "<|image_pad|>") -> None:
        self.tokenizer = tokenizer
        self.image_pad_id = tokenizer.convert_tokens_to_ids(image_pad_token)
        self.guard = TextGuard(tokenizer)

    def messages(self, plan: PromptPlan, image_parts: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """OpenAI-style chat messages; ``image_parts`` replaces the bare image placeholders (remote engines).

        Both engines send these (the remote one to `vllm serve`, which applies the same template), so the
        plan's text is guarded here, once for both.
        """
        parts = image_parts if image_parts is not None else [{"type": "image"} for _ in plan.images]
        text = [{"type": "text", "text": self.guard(plan.text)}]
        # Images first in every layout but the naive baseline: prompts sharing leading images share KV.
        content = text + parts if plan.layout is Layout.NAIVE else parts + text
        return [
            {"role": "system", "content": system_prompt(plan.system_prompt_id)},
            {"role": "user", "content": content},
        ]

    def render(self, plan: PromptPlan) -> str:
        return self.tokenizer.apply_chat_template(self.messages(plan), tokenize=False, add_generation_prompt=True)

    def tokens(self, prompt: str, image_token_counts: list[int]) -> PromptTokens:
        """Where each image's tokens land once vLLM expands its single placeholder to ``n`` tokens.

        The placeholder count check is a second line behind the text guard: a mismatch is refused here,
        never sent.
        """
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        pads = [i for i, t in enumerate(ids) if t == self.image_pad_id]
        if len(pads) != len(image_token_counts):
            raise ValueError(f"prompt has {len(pads)} image placeholders for {len(image_token_counts)} images")
        spans, shift = [], 0
        for pos, n in zip(pads, image_token_counts):
            spans.append((pos + shift, n))
            shift += n - 1
        return PromptTokens(len(ids) + shift, tuple(spans))


def system_prompt(prompt_id: str) -> str:
    try:
        return SYSTEM_PROMPTS[prompt_id]
    except KeyError:
        raise ValueError(f"unknown system prompt {prompt_id!r}; known: {sorted(SYSTEM_PROMPTS)}") from None
