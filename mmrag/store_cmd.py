"""`mmrag store gc`: remove feature-store entries that no indexed page references (disk or Redis).

Entries are immutable and named by ImageKey, so an upgrade (a new encoder version) or a re-ingested document
leaves the old entries behind, unreferenced. A dry run (the default) says what would go and how many bytes.
Keys are listed before the index is read, so an entry a page references by then is kept; run it when no
ingest is writing (an ingest stores a page's tokens just before it indexes the page).

Leased entries are kept too, and counted apart (``leased``): an answer being generated holds its pages and
images, a conversation its images (mmrag/adapters/store.py ``lease``), in any process sharing the store. They are
unreferenced only for now: a later gc removes those whose lease has ended or lapsed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.console import Console

from mmrag.adapters.qdrant import IndexConfigError
from mmrag.core.keys import ImageKey
from mmrag.core.settings import Settings
from mmrag import wiring


@dataclass(slots=True)
class GcReport:
    backend: str
    dry_run: bool
    kept: int = 0  # referenced by an indexed page
    leased: int = 0  # unreferenced but leased (an answer or a conversation holds it): kept until a later gc
    unreferenced: list[tuple[ImageKey, int]] = field(default_factory=list)  # (key, bytes), sorted by key

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.unreferenced)

    def to_json(self) -> dict[str, Any]:
        return {"backend": self.backend, "dry_run": self.dry_run, "kept": self.kept, "leased": self.leased,
                "removed" if not self.dry_run else "would_remove": [
                    {"key": str(k), "bytes": n} for k, n in self.unreferenced],
                "bytes": self.bytes}


def gc(settings: Settings, *, dry_run: bool) -> GcReport:
    """Entries no page of any tenant's collection references; removed (each atomically) unless ``dry_run``, or
    leased (kept, and counted in ``leased``)."""
    store = wiring.feature_store(settings)
    stored = list(store.keys())  # first: anything indexed by the time the index is read below is kept
    index = wiring.read_index(settings)
    try:
        if not dry_run and not index.client.collection_exists(settings.storage.qdrant_collection):
            raise IndexConfigError(
                f"there is no Qdrant collection {settings.storage.qdrant_collection!r} here, so every entry would look "
                "unreferenced; refusing to remove them. Check MMRAG_QDRANT_URL / MMRAG_QDRANT_COLLECTION / "
                "MMRAG_DATA_DIR (an emptied index is fine: `mmrag index reset` keeps the collection)"
            )
        exists = index.client.collection_exists(settings.storage.qdrant_collection)
        referenced = index.referenced_keys(settings.storage.qdrant_collection) if exists else set()  # every tenant's
        # a page's entries in the other tiers live in the store only
        in_use = settings.vision.tier_table.in_use(referenced)
    finally:
        index.client.close()
    report = GcReport(store.backend, dry_run)
    for key in stored:
        if in_use(key):
            report.kept += 1
            continue
        if dry_run and store.leased(key):
            report.leased += 1
            continue
        nbytes = store.size(key) if dry_run else store.delete(key)
        if nbytes:
            report.unreferenced.append((key, nbytes))
        elif not dry_run and store.leased(key):  # delete keeps a leased entry (else it went meanwhile: another gc)
            report.leased += 1
    return report


def print_gc(report: GcReport, console: Console) -> None:
    verb = "would remove" if report.dry_run else "removed"
    for key, nbytes in report.unreferenced:
        console.print(f"  {verb} {key} ({nbytes} bytes)")
    console.print(f"{report.backend} store: {verb} {len(report.unreferenced)} unreferenced entries "
                  f"({report.bytes / 1e6:.2f} MB), kept {report.kept} referenced ones; leased: {report.leased} "
                  "(unreferenced, but an answer or a conversation holds them: kept until a later gc)")
    if report.dry_run and report.unreferenced:
        console.print("run `mmrag store gc --apply` to remove them")
