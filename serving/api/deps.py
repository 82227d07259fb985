"""Request dependencies as `Annotated` aliases."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Request

from serving.api.errors import ApiError
from serving.api.services import Services


def get_services(request: Request) -> Services:
    return request.app.state.services


ServicesDep = Annotated[Services, Depends(get_services)]


def require_api_key(request: Request, services: ServicesDep) -> None:
    expected = services.settings.api_key
    if not expected:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # The auth scheme is case-insensitive (RFC 9110 §11.1): "bearer", "Bearer" and "BEARER" are one scheme.
    given = token.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
    if not secrets.compare_digest(given.encode(), expected.encode()):
        raise ApiError(401, "unauthorized", "missing or wrong API key",
                       "send `Authorization: Bearer <MMRAG_API_KEY>` (or the X-API-Key header)")


AuthDep = Depends(require_api_key)
