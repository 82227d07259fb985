"""Request dependencies as `Annotated` aliases."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from serving.api.services import Services
from serving.http.errors import ApiError


def get_services(request: Request) -> Services:
    return request.app.state.services


ServicesDep = Annotated[Services, Depends(get_services)]

# Security schemes, so /openapi.json says which routes need the key and how to send it (one of the two), and
# /docs can send it. auto_error=False: a missing or wrong key is refused below, in the service's error shape.
# HTTPBearer reads the scheme case-insensitively (RFC 9110 §11.1): "bearer", "Bearer" and "BEARER" are one.
_bearer = HTTPBearer(auto_error=False, description="`Authorization: Bearer <key>`: MMRAG_API_KEY, or with tenants "
                     "(MMRAG_TENANTS_FILE) a key `mmrag tenant add` made, which picks the tenant")
_key_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="`X-API-Key: <key>` (as for Bearer)")


def require_api_key(services: ServicesDep,
                    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
                    key_header: Annotated[str | None, Depends(_key_header)]) -> str:
    """The tenant the request's key belongs to (serving/api/tenants.py: hashed keys, constant-time compare)."""
    given = bearer.credentials if bearer else key_header or ""
    tenant = services.keys.tenant_of(given)
    if tenant is None:
        fix = ("send your tenant's key as `Authorization: Bearer <key>` (or the X-API-Key header); an operator "
               "makes one with `mmrag tenant add <tenant>`" if services.settings.tenants_file else
               "send `Authorization: Bearer <MMRAG_API_KEY>` (or the X-API-Key header)")
        raise ApiError(401, "unauthorized", "missing or wrong API key", fix,
                       headers={"WWW-Authenticate": "Bearer"})  # a 401 names its scheme (RFC 9110 §11.6.1)
    services.rates.take(tenant)  # 429 past the tenant's requests_per_s, before any work
    return tenant


AuthDep = Depends(require_api_key)


def tenant_services(services: ServicesDep, tenant: Annotated[str, Depends(require_api_key)]) -> Services:
    """The services of the request's tenant: its collection, jobs and conversations only."""
    return services.tenants[tenant]


TenantDep = Annotated[Services, Depends(tenant_services)]
