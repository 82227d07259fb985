"""The sample corpus's manifest: what mmrag/devkit/corpus.py wrote (documents, pages, facts, labelled questions), as
the rest of the system reads it back (`mmrag retrieval eval`, `mmrag eval answers`, the tests). Standard library
only: reading a manifest needs none of the drawing libraries that build the corpus (matplotlib, the `bench`
extra)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Kind = Literal["pdf", "png"]

# --------------------------------------------------------------------------------------------------
# Manifest: what was written, as the rest of the system (and the retrieval eval) reads it back.
# --------------------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True, order=True)
class AnswerRef:
    file: str
    page: int  # 1-based

    def __str__(self) -> str:
        return f"{self.file}#{self.page}"

    @classmethod
    def parse(cls, text: str) -> AnswerRef:
        """Inverse of ``str()``, for ``PageEntry.duplicate_of``."""
        file, sep, page = text.rpartition("#")
        if not sep or not page.isdigit():
            raise ValueError(f"not a page reference: {text!r} (expected <file>#<1-based page>)")
        return cls(file, int(page))


@dataclass(slots=True, frozen=True)
class PageEntry:
    page: int
    title: str
    facts: tuple[str, ...]
    figure: str
    text_layer: bool
    duplicate_of: str | None  # "<file>#<page>" of the first copy of a verbatim page


@dataclass(slots=True, frozen=True)
class DocumentEntry:
    file: str
    kind: Kind
    pages: tuple[PageEntry, ...]


@dataclass(slots=True, frozen=True)
class Question:
    question: str
    answers: tuple[AnswerRef, ...]  # every copy of the answer page
    fact: str  # the printed fact that answers it


@dataclass(slots=True, frozen=True)
class CorpusManifest:
    documents: tuple[DocumentEntry, ...]
    questions: tuple[Question, ...]

    def pages(self) -> Iterator[tuple[DocumentEntry, PageEntry]]:
        for doc in self.documents:
            for page in doc.pages:
                yield doc, page

    def duplicate_groups(self) -> list[frozenset[AnswerRef]]:
        """Sets of pages that render pixel-identical (each group has two or more copies)."""
        groups: dict[str, set[AnswerRef]] = {}
        for doc, page in self.pages():
            if page.duplicate_of is not None:
                groups.setdefault(page.duplicate_of, {AnswerRef.parse(page.duplicate_of)}).add(
                    AnswerRef(doc.file, page.page)
                )
        return [frozenset(g) for g in groups.values()]

    def to_json(self) -> str:
        docs = [
            {"file": d.file, "kind": d.kind, "pages": [_page_json(p) for p in d.pages]} for d in self.documents
        ]
        questions = [
            {"question": q.question, "answers": [{"file": a.file, "page": a.page} for a in q.answers], "fact": q.fact}
            for q in self.questions
        ]
        return json.dumps({"documents": docs, "questions": questions}, indent=2, ensure_ascii=False) + "\n"

    @classmethod
    def load(cls, path: Path) -> CorpusManifest:
        """Read ``manifest.json`` (or the corpus folder that holds it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "manifest.json"
        raw = json.loads(path.read_text(encoding="utf-8"))
        documents = tuple(
            DocumentEntry(d["file"], d["kind"], tuple(_page_from_json(p) for p in d["pages"]))
            for d in raw["documents"]
        )
        questions = tuple(
            Question(q["question"], tuple(AnswerRef(a["file"], a["page"]) for a in q["answers"]), q.get("fact", ""))
            for q in raw["questions"]
        )
        return cls(documents, questions)


def _page_json(p: PageEntry) -> dict[str, object]:
    return {
        "page": p.page,
        "title": p.title,
        "facts": list(p.facts),
        "figure": p.figure,
        "text_layer": p.text_layer,
        "duplicate_of": p.duplicate_of,
    }


def _page_from_json(p: dict) -> PageEntry:
    return PageEntry(p["page"], p["title"], tuple(p["facts"]), p["figure"], p["text_layer"], p["duplicate_of"])
