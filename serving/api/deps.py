"""Request dependencies as `Annotated` aliases."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from serving.api.errors import ApiError
from serving.api.services import Services


def get_services(request: Request) -> Services:
    return request.app.state.services


ServicesDep = Annotated[Services, Depends(get_services)]

# Security schemes, so /openapi.json says which routes need the key and how to send it (one of the two), and
# /docs can send it. auto_error=False: a missing or wrong key is refused below, in the service's error shape.
# HTTPBearer reads the scheme case-insensitively (RFC 9110 §11.1): "bearer", "Bearer" and "BEARER" are one.
_bearer = HTTPBearer(auto_error=False, description="`Authorization: Bearer <MMRAG_API_KEY>`")
_key_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="`X-API-Key: <MMRAG_API_KEY>`")


def require_api_key(services: ServicesDep,
                    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
                    key_header: Annotated[str | None, Depends(_key_header)]) -> None:
    expected = services.settings.api_key
    if not expected:
        return
    given = bearer.credentials if bearer else key_header or ""
    if not secrets.compare_digest(given.encode(), expected.encode()):
        raise ApiError(401, "unauthorized", "missing or wrong API key",
                       "send `Authorization: Bearer <MMRAG_API_KEY>` (or the X-API-Key header)",
                       headers={"WWW-Authenticate": "Bearer"})  # a 401 names its scheme (RFC 9110 §11.6.1)


AuthDep = Depends(require_api_key)
