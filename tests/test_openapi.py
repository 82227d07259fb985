"""The API contract is in /openapi.json: every route declares its response body, every field says what it is,
and what a real answer returns is exactly what the schema documents."""

from __future__ import annotations

import httpx
import pytest
from fastapi.routing import APIRoute
from pydantic import ValidationError

from serving.api.schemas import AskResponse
from tests.conftest import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture
async def spec(api_server) -> dict:
    async with httpx.AsyncClient(base_url=api_server["url"], timeout=120) as client:
        return (await client.get("/openapi.json")).json()


def _resolve(spec: dict, schema: dict) -> dict:
    """The schema a value is checked against: follow `$ref`, and take the non-null branch of an Optional."""
    if "$ref" in schema:
        name = schema["$ref"].removeprefix("#/components/schemas/")
        return _resolve(spec, spec["components"]["schemas"][name])
    branches = [b for b in schema.get("anyOf", []) if b.get("type") != "null"]
    return _resolve(spec, branches[0]) if len(branches) == 1 else schema


def _undocumented(spec: dict, schema: dict, value, where: str) -> list[str]:
    """Every key of ``value`` (recursively) that ``schema`` lacks or leaves without a description."""
    schema = _resolve(spec, schema)
    if isinstance(value, list):
        return [m for i, item in enumerate(value) for m in _undocumented(spec, schema["items"], item, f"{where}[{i}]")]
    if not isinstance(value, dict) or "properties" not in schema:
        return []
    missing = []
    for key, item in value.items():
        prop = schema["properties"].get(key)
        if prop is None or not prop.get("description"):
            missing.append(f"{where}.{key}")
        else:
            missing += _undocumented(spec, prop, item, f"{where}.{key}")
    return missing


def _operation(spec: dict, route: APIRoute, method: str) -> dict:
    return spec["paths"][route.path][method.lower()]


def _schema_routes(app) -> list[APIRoute]:
    return [r for r in app.routes if isinstance(r, APIRoute) and r.include_in_schema]


async def test_openapi_documents_every_field_of_a_real_answer(api_server, spec):
    async with httpx.AsyncClient(base_url=api_server["url"], timeout=120) as client:
        bodies = [(await client.post("/v1/ask", headers=AUTH, json={
            "question": "What was the Q3 revenue of the Nordic division and what is the retry limit?",
            "answer_mode": mode})) for mode in ("joint", "split")]
    assert all(r.status_code == 200 for r in bodies), bodies[-1].text
    one, per = (r.json() for r in bodies)
    assert one["answer_mode"] == "joint" and per["image_answers"]  # the nested lists are walked too
    ask = spec["paths"]["/v1/ask"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    for body in (one, per):
        assert _undocumented(spec, ask, body, "answer") == []
    assert _resolve(spec, ask)["title"] == "AskResponse"


def test_an_undocumented_answer_key_is_refused_not_silently_dropped():
    # What makes the walk above meaningful: FastAPI filters responses through the model, so a key that
    # Answer.to_json() added without a schema field would otherwise vanish from answers unnoticed.
    with pytest.raises(ValidationError, match="new_key"):
        AskResponse.model_validate({"answer": "a", "sub_questions": [], "sub_question_source": "rules",
                                    "citations": [], "usage": {k: 0 for k in (
                                        "prompt_tokens", "cached_tokens", "image_tokens", "cached_image_tokens",
                                        "vision_encodes", "completion_tokens", "ttft_s", "latency_s")},
                                    "model": {"name": "m", "random_weights": False, "note": ""}, "new_key": 1})


async def test_every_route_declares_its_success_response(api_server, spec):
    routes = _schema_routes(api_server["app"])
    assert {r.path for r in routes} >= {"/healthz", "/readyz", "/v1/ask", "/v1/documents", "/v1/pages/{page_id}",
                                        "/v1/pages/{page_id}/image", "/v1/ingest", "/v1/ingest/{job_id}"}
    for route in routes:
        for method in route.methods:
            ok = _operation(spec, route, method)["responses"][str(route.status_code or 200)]
            content = ok.get("content")
            assert content and all(c.get("schema") for c in content.values()), f"{method} {route.path}: {ok}"
            if "application/json" in content:  # a named model, not FastAPI's "any object" for `-> dict`
                assert route.response_model is not None, f"{method} {route.path} has no response model"
                assert "$ref" in content["application/json"]["schema"], f"{method} {route.path}"


async def test_every_error_status_is_documented_with_the_error_body(api_server, spec):
    for route in _schema_routes(api_server["app"]):
        for method in route.methods:
            for status, response in _operation(spec, route, method)["responses"].items():
                if int(status) < 400 or route.path == "/readyz":  # /readyz's 503 is its readiness report
                    continue
                schema = response["content"]["application/json"]["schema"]
                assert schema["$ref"].endswith("/ErrorResponse"), f"{method} {route.path} {status}: {schema}"
    # errors.py rewrites validation errors into the error body: FastAPI's own 422 shape must not be promised.
    assert "HTTPValidationError" not in spec["components"]["schemas"]


async def test_readyz_documents_its_503(spec):
    responses = spec["paths"]["/readyz"]["get"]["responses"]
    assert responses["503"]["content"]["application/json"]["schema"]["$ref"].endswith("/Readiness")


async def test_every_field_of_every_schema_has_a_description(spec):
    bare = [f"{name}.{field}" for name, schema in spec["components"]["schemas"].items()
            for field, prop in schema.get("properties", {}).items() if not prop.get("description")]
    assert bare == []
