"""Agent keys, the route's refusals before anything serves, the clamp's rules, and the Agents page, on a real SQLite
file without an engine. The route serving real engines is test_route.py."""

from __future__ import annotations

import hashlib
import sqlite3

import pytest

from app.route.clamp import BudgetError, clamp
from app.settings import load_settings
from tests.console.conftest import ADMIN_TOKEN
from tests.route.conftest import ADMIN

CHAT = {"model": "deepseek-v4-flash", "messages": [{"role": "user", "content": "hi"}]}


def test_keys_are_shown_once_stored_hashed_named_and_revocable(client, data_dir):
    made = client.post("/api/keys", json={"name": "pi-laptop"}, headers=ADMIN)
    assert made.status_code == 201, made.text
    secret = made.json()["key"]
    assert secret.startswith("fg-") and len(secret) > 40 and made.json()["created_by"] == "admin"
    with sqlite3.connect(data_dir / "flashgate.sqlite3") as conn:
        stored = conn.execute("SELECT key_sha256 FROM agent_key WHERE name = 'pi-laptop'").fetchone()[0]
    assert stored == hashlib.sha256(secret.encode()).hexdigest()
    listed = client.get("/api/keys", headers=ADMIN)
    assert secret not in listed.text
    assert [(k["name"], k["requests"], k["last_used_at"]) for k in listed.json()] == [("pi-laptop", 0, None)]

    taken = client.post("/api/keys", json={"name": "pi-laptop"}, headers=ADMIN)
    assert taken.status_code == 409 and "exists already" in taken.json()["detail"]
    bad = client.post("/api/keys", json={"name": "Pi Laptop"}, headers=ADMIN)
    assert bad.status_code == 422 and bad.json()["extra"][0]["field"] == "name"

    assert client.delete("/api/keys/pi-laptop", headers=ADMIN).status_code == 204
    assert client.delete("/api/keys/pi-laptop", headers=ADMIN).status_code == 404
    again = client.post("/api/keys", json={"name": "pi-laptop"}, headers=ADMIN)  # the name is free again
    assert again.status_code == 201 and again.json()["key"] != secret
    keys = client.get("/api/keys", headers=ADMIN).json()
    assert [k["revoked_at"] is None for k in keys] == [True, False] and keys[1]["revoked_by"] == "admin"
    actions = [r["action"] for r in client.get("/api/audit", params={"target": "key:pi-laptop"}, headers=ADMIN).json()]
    assert actions == ["key.create", "key.revoke", "key.create"]


def test_the_route_takes_only_live_agent_keys_and_never_falls_back(client, sign_in):
    anonymous = client.get("/v1/models")
    assert anonymous.status_code == 401 and anonymous.headers["www-authenticate"] == "Bearer"
    assert anonymous.json()["error"]["type"] == "authentication_error"
    assert "an agent key is required" in anonymous.json()["error"]["message"]
    operator = client.post("/v1/chat/completions", json=CHAT, headers=ADMIN)
    assert operator.status_code == 401 and "operator tokens do not work here" in operator.json()["error"]["message"]

    key = client.post("/api/keys", json={"name": "agent"}, headers=ADMIN).json()["key"]
    agent = {"Authorization": f"Bearer {key}"}
    # Nothing promoted: no profile to serve, and no other one stands in.
    refused = client.post("/v1/chat/completions", json=CHAT, headers=agent)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_production"
    assert "retry-after" not in refused.headers  # waiting does not promote anything
    assert client.get("/api/profiles", headers=agent).status_code == 401  # a key is no operator token

    sign_in("admin", ADMIN_TOKEN)  # a console session does not reach the route either
    assert client.get("/v1/models").status_code == 401
    client.cookies.clear()

    assert client.delete("/api/keys/agent", headers=ADMIN).status_code == 204
    revoked = client.get("/v1/models", headers=agent)
    assert revoked.status_code == 401 and "unknown or revoked agent key" in revoked.json()["error"]["message"]
    metrics = client.get("/api/route/metrics", headers=ADMIN).json()
    assert {u["name"]: u["errors"] for u in metrics["by_key"]} == {"agent": 1}
    assert metrics["by_profile"][0]["name"] == "(none)"


@pytest.mark.parametrize(
    ("endpoint", "body", "expected", "warning"),
    [
        ("/v1/chat/completions", {}, {"max_tokens": 64}, '299 - "max_tokens not given: set to 64 by the route"'),
        ("/v1/chat/completions", {"max_tokens": 10}, {"max_tokens": 10}, None),
        (
            "/v1/chat/completions",
            {"max_completion_tokens": 100, "max_tokens": 10},
            {"max_completion_tokens": 64, "max_tokens": 10},
            '299 - "max_completion_tokens clamped from 100 to 64 by the route"',
        ),
        (
            "/v1/completions",
            {"max_tokens": 65},
            {"max_tokens": 64},
            '299 - "max_tokens clamped from 65 to 64 by the route"',
        ),
        ("/v1/responses", {"max_output_tokens": 64}, {"max_output_tokens": 64}, None),
    ],
)
def test_the_clamp(endpoint, body, expected, warning):
    clamped = clamp(endpoint, body, 64)
    assert clamped.body == expected and clamped.warning == warning


@pytest.mark.parametrize("value", [0, -3, 2.5, "10", True])
def test_the_clamp_refuses_budgets_that_are_not_whole_positive_numbers(value):
    with pytest.raises(BudgetError) as refused:
        clamp("/v1/responses", {"max_output_tokens": value}, 64)
    assert refused.value.field == "max_output_tokens" and "from 1 to 64" in str(refused.value)


def test_the_alias_is_a_plain_identifier():
    with pytest.raises(ValueError, match="FLASHGATE_ROUTE_ALIAS"):
        load_settings({"FLASHGATE_ROUTE_ALIAS": "deepseek v4/flash"})
    assert load_settings({"FLASHGATE_ROUTE_ALIAS": "dsv4:flash-1"}).route_alias == "dsv4:flash-1"


def test_the_agents_page_makes_a_key_and_shows_it_once(client, sign_in):
    csrf = sign_in("admin", ADMIN_TOKEN)
    page = client.get("/route/agents")
    assert page.status_code == 200 and 'id="keys"' in page.text and 'id="route-metrics"' in page.text
    assert 'id="client-config-unavailable"' in page.text and "no profile holds the production role" in page.text
    made = client.post("/route/agents/keys", data={"name": "ci", "_csrf_token": csrf}, headers={"HX-Request": "true"})
    assert made.status_code == 200 and 'id="issued-key"' in made.text
    secret = made.text.split('id="issued-key">')[1].split("<")[0]
    assert secret.startswith("fg-") and secret not in client.get("/route/agents").text
    bad = client.post("/route/agents/keys", data={"name": "ci", "_csrf_token": csrf}, headers={"HX-Request": "true"})
    assert bad.status_code == 409 and "exists already" in bad.text
    revoked = client.post("/route/agents/keys/ci/revoke", data={"_csrf_token": csrf}, headers={"HX-Request": "true"})
    assert revoked.status_code == 200 and "revoked" in revoked.text
    assert client.get("/route/alerts").status_code == 200
    refused = client.get("/api/route/client-config", params={"client": "pi"}, headers=ADMIN)
    assert refused.status_code == 409 and "no profile holds the production role" in refused.json()["detail"]
    client.cookies.clear()
