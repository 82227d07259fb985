"""A tenant's scope: everything that is one tenant's own, as one value.

The wiring builds it once per tenant (mmrag/wiring/ ``tenant_scope``) and hands the same value to whatever
acts for the tenant: the pipeline (its collection, the salt on every plan and decomposition request), the
scheduler and routing (they key prefixes by ``routing.prefix_path``, which starts with the plan's salt),
warm-up (it prefills under the salt), server-side ingest (its root and uploads folder), conversations (their
ids are the tenant's own), and every CLI command that takes ``--tenant``. Before, each of those derived its
part from the tenant name itself, and the ones that forgot (the CLI's ``ask`` and ``ingest --warm``) put a
tenant's pages into the default tenant's cache namespace.

Contracts only: no I/O.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mmrag.core.engine import PromptPlan
from mmrag.core.settings import DEFAULT_TENANT, check_tenant

if TYPE_CHECKING:
    from mmrag.core.settings import Settings


def cache_salt(tenant: str) -> str:
    """The prefix-cache salt of a tenant's plans. The default tenant's is empty: a single-tenant server keeps
    the KV that warm-up and every earlier version stored unsalted."""
    return "" if check_tenant(tenant) == DEFAULT_TENANT else f"tenant-{tenant}"


@dataclass(frozen=True, slots=True)
class TenantScope:
    """One tenant's collection, prefix-cache salt, server-side ingest root (None: server-side ingest is off) and
    uploads folder."""

    tenant: str
    collection: str
    cache_salt: str
    root: Path | None
    uploads: Path

    @classmethod
    def of(cls, settings: Settings, tenant: str) -> TenantScope:
        """The rules, in one place. The default tenant keeps what a single-tenant deployment always had (the
        configured collection, no salt, the ingest root and uploads folder themselves); any other gets its own
        beside them."""
        default = tenant == DEFAULT_TENANT
        root = settings.api.ingest_root.resolve() if settings.api.ingest_root else None
        uploads = (settings.storage.data_dir / "uploads").resolve()
        return cls(tenant=tenant, collection=settings.storage.tenant_collection(tenant), cache_salt=cache_salt(tenant),
                   root=root if default or root is None else root / tenant,
                   uploads=uploads if default else uploads / "tenants" / tenant)

    def salted(self, plan: PromptPlan) -> PromptPlan:
        """``plan`` with this tenant's salt: its KV is shared with this tenant's plans only."""
        return plan if plan.cache_salt == self.cache_salt else dataclasses.replace(plan, cache_salt=self.cache_salt)
