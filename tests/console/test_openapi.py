"""The REST surface as documented: the OpenAPI schema lists each endpoint's refusals (409, 422, 423) and the 202 a
switch answers with, the README's switch body is what the schema takes, and HEAD /healthz answers like GET."""

from __future__ import annotations

import json
import re

import pytest

from tests.support import ROOT

DOCUMENTED = {
    ("put", "/api/route/production"): {"202", "200", "409", "422", "423"},
    ("post", "/api/route/rollback"): {"202", "200", "409", "422", "423"},
    ("post", "/api/profiles/{name}/decisions"): {"201", "409", "422", "423"},
    ("post", "/api/profiles/{name}/qualifications"): {"202", "409", "423"},
    ("post", "/api/engine/start"): {"202", "409", "423"},
    ("post", "/api/engine/stop"): {"200", "409", "423"},
    ("post", "/api/engine/restart"): {"202", "409", "423"},
    ("post", "/api/profiles"): {"201", "409", "422"},
    ("post", "/api/profiles/{name}/children"): {"201", "409", "422"},
    ("patch", "/api/profiles/{name}"): {"200", "409", "422"},
    ("post", "/api/profiles/{name}/retire"): {"200", "409"},
}


@pytest.fixture
def schema(client) -> dict:
    return client.get("/schema/openapi.json").json()


def test_the_schema_lists_each_endpoints_refusals(schema):
    for (method, path), codes in DOCUMENTED.items():
        responses = schema["paths"][path][method]["responses"]
        assert codes <= set(responses), f"{method.upper()} {path}: {sorted(responses)}"
    locked = schema["paths"]["/api/route/production"]["put"]["responses"]["423"]
    assert "holds the engine" in locked["description"]
    invalid = schema["paths"]["/api/profiles/{name}/children"]["post"]["responses"]["422"]
    assert "each as {field, message}" in invalid["description"]


def test_a_switch_answers_202_with_the_switch_and_200_with_the_plan(schema):
    for path in ("/api/route/production", "/api/route/rollback"):
        operation = schema["paths"][path]["put" if path.endswith("production") else "post"]
        started = operation["responses"]["202"]["content"]["application/json"]["schema"]
        planned = operation["responses"]["200"]["content"]["application/json"]["schema"]
        assert started["$ref"].endswith("/PromotionRead") and planned["$ref"].endswith("/PlanRead")


def test_the_readmes_switch_body_is_what_the_schema_takes(schema):
    readme = (ROOT / "README.md").read_text()
    curl = re.search(r"curl -s -X PUT \S+/api/route/production .*?-d '(\{.*?\})'", readme, re.S)
    assert curl, "the README shows the body of PUT /api/route/production"
    body = json.loads(curl.group(1))
    request = schema["paths"]["/api/route/production"]["put"]["requestBody"]["content"]["application/json"]
    ref = request["schema"]["$ref"].rsplit("/", 1)[1]
    properties = schema["components"]["schemas"][ref]
    assert set(body) <= set(properties["properties"]) and set(properties["required"]) <= set(body)


def test_head_healthz_answers_with_the_build(client):
    # docs/deploy.md checks the build with `curl -sI …/healthz`.
    got, head = client.get("/healthz"), client.head("/healthz")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["x-flashgate-build"] == got.headers["x-flashgate-build"]
