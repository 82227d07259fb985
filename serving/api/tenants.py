"""Tenants: API keys map to tenants, each with its own collection, jobs, conversations and prefix-cache salt.

The tenants file (MMRAG_TENANTS_FILE) is JSON, ``{"acme": ["sha256:<hex>", ...], ...}``: each tenant's keys as
SHA-256 digests, never the keys themselves (`mmrag tenant add` prints a new key once and stores its digest). A
tenant with a share or quotas is an object instead, ``{"acme": {"keys": [...], "weight": 2,
"questions_in_flight": 8, "requests_per_s": 5, "documents": 100, "pages": 5000, "bytes": 1000000000}}``
(:class:`TenantQuota`; every field but ``keys`` optional, `mmrag tenant quota` sets them). A
plain digest, not a password hash (bcrypt, scrypt): the keys are 256 random bits that `secrets` drew, so there is
no dictionary to try and nothing for a slow hash to slow down. A presented key is hashed and compared with every
stored digest by ``hmac.compare_digest``, all of them whatever matched, so the time taken says neither whether a
key is right nor which tenant's it is.

Without a tenants file there is one tenant, ``default``, whose key is MMRAG_API_KEY (or none).

What tenants share, and why it tells none of them about another's documents:
- the engine and its KV cache, but not its prefixes: every plan of a tenant carries the tenant's ``cache_salt``
  (vLLM folds it into the first block's hash), so a tenant never reuses, and so never detects through
  ``cached_tokens`` or a faster first token, another tenant's prefill;
- the feature store, by content key: an entry is named only by the hash of a page's pixels (with the encoder and
  the resolution policy), the API never lists the store or returns tokens, and retrieval, citations, page reads
  and deletions read the tenant's own collection only. To reach another tenant's entry a tenant must already hold
  the exact pixels, and then learns at most that someone encoded them before (a question image that costs no
  vision forward): one bit about content it already has, never a document, name or page it does not. A
  deployment that cannot accept even that runs one feature store per tenant (MMRAG_REDIS_URL per deployment).
  Deleting a document removes only the entries no page of any tenant references.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass
from pathlib import Path

from mmrag.adapters.files import write_atomically
from mmrag.core.settings import DEFAULT_TENANT, ApiSettings, check_tenant

_PREFIX = "sha256:"


class TenantsFileError(ValueError):
    """The tenants file cannot be read or is not of the shape `mmrag tenant add` writes."""


def key_digest(key: str) -> str:
    return _PREFIX + hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    """A new API key: 256 random bits, URL-safe, with a prefix that says what it is (secret scanners key on it)."""
    return "mmrag-" + secrets.token_urlsafe(32)


@dataclass(slots=True, frozen=True)
class TenantQuota:
    """One tenant's share of what the tenants share, and its bounds (the tenants file; None: no bound of its
    own). ``weight``: its share of the questions in flight against the other active tenants' (a tenant of
    weight 2 gets twice one of weight 1 when both want more than there is; serving/api/admission.py).
    ``questions_in_flight``: at most this many at once, whatever is free. ``requests_per_s``: its API requests
    a second, bursts of up to one second's worth (429 beyond). ``documents``, ``pages``, ``bytes``: what it may
    keep indexed and stored (413 for an upload too large for what is left, 403 at the count)."""

    weight: float = 1.0
    questions_in_flight: int | None = None
    requests_per_s: float | None = None
    documents: int | None = None
    pages: int | None = None
    bytes: int | None = None

    @classmethod
    def parse(cls, tenant: str, data: dict, where: str) -> TenantQuota:
        fields = {"weight": float, "questions_in_flight": int, "requests_per_s": float, "documents": int,
                  "pages": int, "bytes": int}
        unknown = set(data) - set(fields) - {"keys"}
        if unknown:
            raise TenantsFileError(f"{where}: tenant {tenant!r} has unknown fields {sorted(unknown)}; the fields "
                                   f"are keys, {', '.join(fields)}")
        values = {}
        for name, kind in fields.items():
            value = data.get(name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or (
                    kind is int and value != int(value)):
                raise TenantsFileError(f"{where}: tenant {tenant!r}: {name} must be a positive "
                                       f"{'whole number' if kind is int else 'number'}, not {value!r}")
            values[name] = kind(value)
        return cls(**values)

    def as_json(self) -> dict:
        default = TenantQuota()
        return {name: getattr(self, name) for name in self.__slots__ if getattr(self, name) != getattr(default, name)}


@dataclass(slots=True, frozen=True)
class TenantKeys:
    """Digest → tenant, for every key of every tenant; ``open`` when no key is required (no tenants file and
    no MMRAG_API_KEY: every caller is the default tenant). ``quotas``: the tenants file's shares and bounds, by
    tenant (none: weight 1, no bounds)."""

    digests: tuple[tuple[str, str], ...]
    open: bool = False
    quotas: tuple[tuple[str, TenantQuota], ...] = ()

    @classmethod
    def from_settings(cls, settings: ApiSettings) -> TenantKeys:
        if settings.tenants_file is None:
            if not settings.api_key:
                return cls((), open=True)
            return cls(((key_digest(settings.api_key), DEFAULT_TENANT),))
        entries = read_tenants_file(settings.tenants_file)
        return cls(tuple((digest, tenant) for tenant, (digests, _) in entries.items() for digest in digests),
                   quotas=tuple((tenant, quota) for tenant, (_, quota) in entries.items()))

    def quota(self, tenant: str) -> TenantQuota:
        return dict(self.quotas).get(tenant, TenantQuota())

    @property
    def tenants(self) -> list[str]:
        return [DEFAULT_TENANT] if self.open else sorted({tenant for _, tenant in self.digests})

    def tenant_of(self, key: str) -> str | None:
        """The tenant whose key this is, or None. Constant in time over the stored digests (module docstring)."""
        if self.open:
            return DEFAULT_TENANT
        given = key_digest(key).encode()
        found = None
        for digest, tenant in self.digests:
            if hmac.compare_digest(given, digest.encode()):
                found = tenant
        return found


def read_tenants(path: Path) -> dict[str, list[str]]:
    """The tenants file's keys, checked: tenant name → list of ``sha256:<64 hex>`` digests."""
    return {tenant: digests for tenant, (digests, _) in read_tenants_file(path).items()}


def read_tenants_file(path: Path) -> dict[str, tuple[list[str], TenantQuota]]:
    """The tenants file, checked: tenant name → (its key digests, its :class:`TenantQuota`). A tenant is a list
    of ``sha256:<64 hex>`` digests, or an object with them as ``keys`` and its share and bounds."""
    fix = f"rewrite it with `mmrag tenant add <name>` (MMRAG_TENANTS_FILE={path})"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise TenantsFileError(f"the tenants file {path} does not exist: create it with `mmrag tenant add <name>` "
                               "or unset MMRAG_TENANTS_FILE") from None
    except (OSError, ValueError) as exc:
        raise TenantsFileError(f"cannot read the tenants file {path}: {exc}; {fix}") from exc
    if not isinstance(data, dict):
        raise TenantsFileError(f"the tenants file {path} is not a JSON object of tenant → key digests; {fix}")
    entries = {}
    for tenant, entry in data.items():
        try:
            check_tenant(tenant)
        except ValueError as exc:
            raise TenantsFileError(f"{path}: {exc}") from None
        quota = TenantQuota.parse(tenant, entry, str(path)) if isinstance(entry, dict) else TenantQuota()
        digests = entry.get("keys", []) if isinstance(entry, dict) else entry
        if not isinstance(digests, list) or not all(_is_digest(d) for d in digests):
            raise TenantsFileError(f"{path}: tenant {tenant!r} must map to a list of 'sha256:<64 hex>' key digests "
                                   f"(never plain keys), or to an object with them as \"keys\"; {fix}")
        entries[tenant] = (digests, quota)
    return entries


def add_key(path: Path, tenant: str) -> str:
    """A new key for ``tenant`` (added if new), its digest written to the tenants file; the key, shown once."""
    check_tenant(tenant)
    data = read_tenants_file(path) if path.exists() else {}
    key = new_key()
    digests, quota = data.get(tenant, ([], TenantQuota()))
    data[tenant] = ([*digests, key_digest(key)], quota)
    _write(path, data)
    return key


def set_quota(path: Path, tenant: str, changes: dict[str, float | int], *, clear: bool = False) -> TenantQuota:
    """``tenant``'s share and bounds with ``changes`` (on none of its old ones if ``clear``), checked and
    written back."""
    data = read_tenants_file(path)
    if tenant not in data:
        raise TenantsFileError(f"no tenant {tenant!r} in {path}: add it with `mmrag tenant add {tenant}`")
    digests, quota = data[tenant]
    quota = TenantQuota.parse(tenant, {**({} if clear else quota.as_json()), **changes}, str(path))
    data[tenant] = (digests, quota)
    _write(path, data)
    return quota


def remove_tenant(path: Path, tenant: str) -> bool:
    """Drop a tenant's keys (its collection stays: `mmrag index reset --tenant` empties it)."""
    data = read_tenants_file(path)
    if data.pop(tenant, None) is None:
        return False
    _write(path, data)
    return True


def _write(path: Path, data: dict[str, tuple[list[str], TenantQuota]]) -> None:
    """Atomically and durably (a key printed once must not be lost), readable by its owner only: the digests
    are not secrets, but nobody else needs them. A tenant without a share or bounds of its own stays a list."""
    plain = {tenant: {"keys": digests, **quota.as_json()} if quota.as_json() else digests
             for tenant, (digests, quota) in data.items()}
    write_atomically(path, json.dumps(plain, indent=2, sort_keys=True), prefix=".tenants-", mode=0o600)


def _is_digest(value: object) -> bool:
    return (isinstance(value, str) and value.startswith(_PREFIX) and len(value) == len(_PREFIX) + 64
            and all(c in "0123456789abcdef" for c in value[len(_PREFIX):]))
