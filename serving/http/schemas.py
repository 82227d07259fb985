"""The bodies every mmrag HTTP service shares (the REST API, serving/api/, and the vision service,
serving/vision/): the error envelope its handlers write (serving/http/errors.py), the OpenAPI entries that
document it, and the liveness and dependency-check shapes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class ResponseBody(BaseModel):
    """A response body: unknown keys are refused, so an undocumented field fails loudly."""

    model_config = ConfigDict(extra="forbid")


# --- errors (serving/http/errors.py and serving/api/limits.py write this shape) ---------------------------


class ErrorDetail(ResponseBody):
    type: str = Field(description="Machine-readable error kind, e.g. `unknown_page`, `engine_unavailable`.")
    message: str = Field(description="What went wrong, for a person.")
    fix: str = Field(min_length=1, description="What to do about it; never empty.")
    param: str | None = Field(default=None, description="The request field at fault, where one is (as OpenAI's "
                              "error names it, e.g. `n` in `unsupported_parameter`); absent otherwise.")


class ErrorResponse(ResponseBody):
    error: ErrorDetail = Field(description="The one error of this request.")


def error_responses(described: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` for error statuses: each one documented with the error body and why it happens."""
    return {status: {"model": ErrorResponse, "description": why} for status, why in described.items()}


# Declared per route, so FastAPI does not document its own 422 shape: errors.py rewrites validation errors.
INVALID_REQUEST = {422: "The request does not match the schema (`invalid_request`)."}
UNAUTHORIZED = {401: "Missing or wrong API key (`unauthorized`)."}
TOO_LARGE = {413: "Request body over MMRAG_MAX_REQUEST_BYTES (`request_too_large`)."}


# --- health ----------------------------------------------------------------------------------------------


class Health(ResponseBody):
    status: Literal["ok"] = Field(description="Always `ok`: the process answers.")


class Check(ResponseBody):
    ok: bool = Field(description="Whether the dependency answered within 5 s.")
    detail: str | None = Field(default=None, description="What it answered (present when `ok`).")
    error: str | None = Field(default=None, description="Why it did not (present when not `ok`).")
