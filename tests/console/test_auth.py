"""Operators, roles and tokens: every mutating endpoint refuses anonymous (401) and under-privileged (403) callers;
tokens are shown once, stored hashed, and revocable; the console's forms need a CSRF token; the first admin comes
from FLASHGATE_ADMIN_TOKEN or a one-time setup token."""

from __future__ import annotations

import hashlib
import sqlite3

import pytest
from litestar.testing import TestClient
from structlog.testing import capture_logs

from app.auth.throttle import FAILURES
from tests.console.conftest import ADMIN_TOKEN
from tests.support import form_csrf

SAFE = {"GET", "HEAD", "OPTIONS"}
# Reachable without signing in, by design: they are how one signs in.
ANONYMOUS = {("POST", "/signin"), ("POST", "/setup"), ("POST", "/api/setup")}
# The agent route: no operator's, it takes agent keys (tests/route).
AGENT_ROUTE = {("POST", f"/v1/{endpoint}") for endpoint in ("chat/completions", "completions", "responses")}

# Every mutating endpoint, with a request that the given role may not make.
API_MATRIX = [
    ("POST", "/api/profiles", "operator", {"json": {"name": "x"}}),
    ("PATCH", "/api/profiles/{name}", "operator", {"json": {"max_num_seqs": 2}}),
    ("POST", "/api/profiles/{name}/children", "operator", {"json": {"name": "x", "rationale": "y"}}),
    ("POST", "/api/profiles/{name}/retire", "operator", {}),
    ("PUT", "/api/route/production", "operator", {"json": {"profile": "cpu-demo"}}),
    ("POST", "/api/engine/start", "operator", {"json": {"profile": "cpu-demo"}}),
    ("POST", "/api/engine/stop", "operator", {}),
    ("POST", "/api/engine/restart", "operator", {"json": {}}),
    ("POST", "/api/route/rollback", "operator", {"json": {"reason": "back"}}),
    ("POST", "/api/profiles/{name}/qualifications", "operator", {"json": {}}),
    ("POST", "/api/profiles/{name}/decisions", "operator", {"json": {"decision": "reject", "reason": "no"}}),
    ("POST", "/api/operators", "admin", {"json": {"name": "eve", "role": "admin"}}),
    # Someone else's tokens: only an admin may.
    ("POST", "/api/operators/{name}/tokens", "admin", {"json": {"name": "sneaky"}}),
    ("DELETE", "/api/tokens/{token_id}", "admin", {}),
    ("POST", "/api/keys", "operator", {"json": {"name": "pi"}}),
    ("DELETE", "/api/keys/{name}", "operator", {}),
    ("POST", "/api/route/alerts/{alert_id}/acknowledge", "operator", {}),
]
PAGE_MATRIX = [
    ("POST", "/profiles/{name}/children", "operator", {"data": {"name": "x", "rationale": "y"}}),
    ("POST", "/profiles/{name}/retire", "operator", {}),
    ("POST", "/engine/start", "operator", {"data": {"profile": "cpu-demo"}}),
    ("POST", "/engine/stop", "operator", {}),
    ("POST", "/engine/restart", "operator", {}),
    ("POST", "/profiles/{name}/qualifications", "operator", {}),
    ("POST", "/qualifications/{run_id}/decisions", "operator", {"data": {"decision": "reject"}}),
    ("POST", "/route/production", "operator", {"data": {"profile": "cpu-demo"}}),
    ("POST", "/route/rollback", "operator", {"data": {"reason": "back"}}),
    ("POST", "/route/agents/keys", "operator", {"data": {"name": "pi"}}),
    ("POST", "/route/agents/keys/{name}/revoke", "operator", {}),
    ("POST", "/route/alerts/{alert_id}/acknowledge", "operator", {}),
    ("POST", "/signout", "viewer", {}),
]
PATH_VALUES = {"{name}": "cpu-demo", "{token_id}": "1", "{run_id}": "1", "{alert_id}": "1"}


def concrete(path: str) -> str:
    for key, value in PATH_VALUES.items():
        path = path.replace(key, value)
    return path.replace("cpu-demo/tokens", "admin/tokens")


def test_the_matrices_cover_every_mutating_endpoint(client):
    routes = {
        (method, route.path.replace(":str", "").replace(":int", ""))
        for route in client.app.routes
        for method in getattr(route, "methods", ())
        if method not in SAFE
    }
    covered = {(m, p) for m, p, _, _ in API_MATRIX + PAGE_MATRIX} | ANONYMOUS | AGENT_ROUTE
    assert routes == covered


def audit_rows(data_dir) -> int:
    with sqlite3.connect(data_dir / "flashgate.sqlite3") as conn:
        return conn.execute("SELECT count(*) FROM audit").fetchone()[0]


@pytest.mark.parametrize(("method", "path", "role", "kwargs"), API_MATRIX, ids=lambda v: str(v))
def test_api_refuses_anonymous_401_and_viewer_403(client, viewer, data_dir, method, path, role, kwargs):
    before = audit_rows(data_dir)
    anonymous = client.request(method, concrete(path), **kwargs)
    assert anonymous.status_code == 401, anonymous.text
    assert anonymous.headers["www-authenticate"] == "Bearer"
    refused = client.request(method, concrete(path), headers=viewer, **kwargs)
    assert refused.status_code == 403, refused.text
    assert "vera" in refused.json()["detail"]
    assert audit_rows(data_dir) == before


@pytest.mark.parametrize(("method", "path", "role", "kwargs"), API_MATRIX, ids=lambda v: str(v))
def test_api_refuses_an_operator_where_admin_is_needed(client, operator, method, path, role, kwargs):
    response = client.request(method, concrete(path), headers=operator, **kwargs)
    if role == "admin":
        assert response.status_code == 403, response.text
    else:
        assert response.status_code not in (401, 403), response.text


@pytest.mark.parametrize(("method", "path", "role", "kwargs"), PAGE_MATRIX, ids=lambda v: str(v))
def test_pages_send_anonymous_to_sign_in_and_refuse_viewers(
    client, operator_token, sign_in, page_csrf, data_dir, method, path, role, kwargs
):
    csrf = page_csrf(client, "/signin")
    data = {**kwargs.get("data", {}), "_csrf_token": csrf}
    anonymous = client.request(method, concrete(path), data=data, follow_redirects=False)
    assert anonymous.status_code == 303 and anonymous.headers["location"].startswith("/signin?next=")
    if role == "viewer":
        return  # signing out needs only a session
    sign_in("vera", operator_token("vera", "viewer"))
    before = audit_rows(data_dir)
    refused = client.request(method, concrete(path), data=data, follow_redirects=False)
    assert refused.status_code == 403 and "needs the operator role" in refused.text
    assert audit_rows(data_dir) == before


def test_tokens_are_shown_once_stored_hashed_and_revocable(client, admin, bearer, data_dir):
    created = client.post("/api/operators", json={"name": "otto", "role": "operator"}, headers=admin).json()
    secret = created["token"]["secret"]
    assert secret.startswith("fg_") and created["operator"]["role"] == "operator"
    with sqlite3.connect(data_dir / "flashgate.sqlite3") as conn:
        stored = [row[0] for row in conn.execute("SELECT token_sha256 FROM token")]
    assert hashlib.sha256(secret.encode()).hexdigest() in stored and secret not in stored
    listing = client.get("/api/operators", headers=admin)
    assert listing.status_code == 200 and secret not in listing.text
    assert {o["name"] for o in listing.json()} == {"admin", "otto"}

    otto = bearer(secret)
    own = client.post("/api/operators/otto/tokens", json={"name": "laptop"}, headers=otto)
    assert own.status_code == 201
    laptop = bearer(own.json()["secret"])
    assert client.get("/api/profiles", headers=laptop).status_code == 200
    assert client.delete(f"/api/tokens/{own.json()['id']}", headers=otto).status_code == 204
    assert client.get("/api/profiles", headers=laptop).status_code == 401
    # An admin revokes anyone's token; the old one stops working at once.
    assert client.delete(f"/api/tokens/{created['token']['id']}", headers=admin).status_code == 204
    assert client.get("/api/profiles", headers=otto).status_code == 401
    assert client.get("/api/operators", headers=otto).status_code == 401
    assert client.delete("/api/tokens/999", headers=admin).status_code == 404


def test_operator_names_and_duplicates(client, admin):
    bad = client.post("/api/operators", json={"name": "Eve!", "role": "viewer"}, headers=admin)
    assert bad.status_code == 422 and "name must be a lowercase slug" in bad.json()["detail"]
    assert client.post("/api/operators", json={"name": "eve", "role": "viewer"}, headers=admin).status_code == 201
    again = client.post("/api/operators", json={"name": "eve", "role": "admin"}, headers=admin)
    assert again.status_code == 409
    role = client.post("/api/operators", json={"name": "mal", "role": "root"}, headers=admin)
    assert role.status_code == 400 and "role" in role.text


def test_console_session_signs_in_and_out(client, operator_token, sign_in, page_csrf, data_dir):
    token = operator_token("otto", "operator")
    assert client.get("/profiles", follow_redirects=False).status_code == 303
    sign_in("otto", token)
    page = client.get("/profiles")
    assert page.status_code == 200 and "otto" in page.text
    # The cookie is a console session: it never authenticates the API (so /api needs no CSRF check).
    assert client.get("/api/profiles").status_code == 401
    csrf = page_csrf(client, "/profiles")
    assert client.post("/signout", data={"_csrf_token": csrf}, follow_redirects=False).status_code == 303
    with sqlite3.connect(data_dir / "flashgate.sqlite3") as conn:
        (revoked,) = conn.execute("SELECT revoked_at FROM token WHERE kind = 'session'").fetchone()
    assert revoked is not None
    assert client.get("/profiles", follow_redirects=False).status_code == 303


def test_sign_in_refuses_wrong_and_revoked_tokens(client, admin, operator_token, page_csrf):
    token = operator_token("otto", "operator")
    csrf = page_csrf(client, "/signin")
    wrong = client.post("/signin", data={"name": "otto", "token": "fg_nope", "_csrf_token": csrf})
    assert wrong.status_code == 401 and "unknown operator or token" in wrong.text
    someone_else = client.post("/signin", data={"name": "admin", "token": token, "_csrf_token": csrf})
    assert someone_else.status_code == 401
    (listed,) = [o for o in client.get("/api/operators", headers=admin).json() if o["name"] == "otto"]
    client.delete(f"/api/tokens/{listed['tokens'][0]['id']}", headers=admin)
    revoked = client.post("/signin", data={"name": "otto", "token": token, "_csrf_token": csrf})
    assert revoked.status_code == 401


def test_forms_need_the_csrf_token(client, operator_token, sign_in, page_csrf, data_dir):
    sign_in("otto", operator_token("otto", "operator"))
    before = audit_rows(data_dir)
    forged = client.post("/profiles/maxseq1-1m/retire", follow_redirects=False)
    assert forged.status_code == 403 and "CSRF" in forged.text
    wrong = client.post("/profiles/maxseq1-1m/retire", data={"_csrf_token": "0" * 128}, follow_redirects=False)
    assert wrong.status_code == 403
    assert audit_rows(data_dir) == before
    csrf = page_csrf(client, "/profiles/maxseq1-1m")
    retired = client.post("/profiles/maxseq1-1m/retire", data={"_csrf_token": csrf}, follow_redirects=False)
    assert retired.status_code == 303 and retired.headers["location"] == "/profiles/maxseq1-1m"


def test_api_with_a_bearer_token_needs_no_csrf(client, operator):
    assert "csrftoken" not in client.cookies
    assert client.post("/api/profiles/maxseq1-1m/retire", headers=operator).status_code == 200


def test_setup_token_is_logged_once_and_exchanged_for_the_admin(make_app, bearer):
    with capture_logs() as logs:
        app = make_app(FLASHGATE_ADMIN_TOKEN="")
    (event,) = [e for e in logs if e["event"] == "setup_token"]
    setup_token = event["token"]
    with capture_logs() as logs:
        make_app(FLASHGATE_ADMIN_TOKEN="")  # a restart before the exchange does not print it again
    assert not [e for e in logs if e["event"] == "setup_token"]
    assert [e for e in logs if e["event"] == "setup_pending"]

    with TestClient(app) as client:
        wrong = client.post("/api/setup", json={"setup_token": "fg_wrong", "name": "ada"})
        assert wrong.status_code == 403
        response = client.post("/api/setup", json={"setup_token": setup_token, "name": "ada"})
        assert response.status_code == 201, response.text
        assert response.json()["operator"]["role"] == "admin"
        ada = bearer(response.json()["token"]["secret"])
        assert client.get("/api/operators", headers=ada).status_code == 200
        reused = client.post("/api/setup", json={"setup_token": setup_token, "name": "mallory"})
        assert reused.status_code == 403 and "already been used" in reused.json()["detail"]
    with capture_logs() as logs:
        make_app(FLASHGATE_ADMIN_TOKEN="")
    assert not [e for e in logs if e["event"] in ("setup_token", "setup_pending")]


def test_setup_page_exchanges_the_token(make_app, bearer, page_csrf):
    with capture_logs() as logs:
        app = make_app(FLASHGATE_ADMIN_TOKEN="")
    setup_token = next(e["token"] for e in logs if e["event"] == "setup_token")
    with TestClient(app) as client:
        csrf = page_csrf(client, "/setup")
        page = client.post("/setup", data={"setup_token": setup_token, "name": "ada", "_csrf_token": csrf})
        assert page.status_code == 200 and "shown <strong>once</strong>" in page.text
        secret = page.text.split('<pre class="secret">')[1].split("</pre>")[0]
        assert client.get("/api/operators", headers=bearer(secret)).status_code == 200
        assert client.get("/setup", follow_redirects=False).status_code == 302


def test_changing_the_admin_token_variable_replaces_the_old_one(make_app, admin, bearer):
    with TestClient(make_app()) as client:
        assert client.get("/api/operators", headers=admin).status_code == 200
    with TestClient(make_app(FLASHGATE_ADMIN_TOKEN="fg_rotated")) as client:
        assert client.get("/api/operators", headers=admin).status_code == 401
        assert client.get("/api/operators", headers=bearer("fg_rotated")).status_code == 200


def test_a_failed_sign_in_is_an_audit_row_and_repeated_failures_answer_429(client, operator_token, page_csrf, admin):
    token = operator_token("otto", "operator")
    csrf = page_csrf(client, "/signin")
    for attempt in range(FAILURES):
        wrong = client.post("/signin", data={"name": "otto", "token": f"fg_guess-{attempt}", "_csrf_token": csrf})
        assert wrong.status_code == 401, attempt
    failed = client.get("/api/audit", params={"target": "operator:otto"}, headers=admin).json()
    rows = [r for r in failed if r["action"] == "operator.sign_in_failed"]
    assert len(rows) == FAILURES and rows[0]["actor"] == "otto"
    assert rows[0]["after"] == {"reason": "not a token of this operator", "client": "testclient"}
    assert not any("fg_guess" in str(r) for r in failed)  # the token tried is never kept
    # Then the address waits, even with the right token: guessing goes no faster than FAILURES per window.
    held = client.post("/signin", data={"name": "otto", "token": token, "_csrf_token": csrf})
    assert held.status_code == 429 and int(held.headers["retry-after"]) > 0
    assert f"{FAILURES} failed attempts from testclient" in held.text


def test_wrong_setup_tokens_are_limited_too(make_app):
    with TestClient(make_app(FLASHGATE_ADMIN_TOKEN="")) as client:
        for attempt in range(FAILURES):
            assert client.post("/api/setup", json={"setup_token": f"fg_{attempt}", "name": "ada"}).status_code == 403
        limited = client.post("/api/setup", json={"setup_token": "fg_more", "name": "ada"})
        assert limited.status_code == 429 and limited.headers["retry-after"]


def test_every_answer_refuses_framing(client):
    for path in ("/signin", "/static/htmx.min.js", "/no-such-page", "/api/profiles"):
        answer = client.get(path)
        assert answer.headers["x-frame-options"] == "DENY", path
        assert answer.headers["content-security-policy"] == "frame-ancestors 'none'", path
        assert answer.headers["x-content-type-options"] == "nosniff", path


def test_cookies_are_secure_behind_a_tls_proxy(make_app):
    # The proxy terminates TLS: the console sees http, but its public URL is https, so cookies must say Secure.
    with TestClient(make_app(FLASHGATE_PUBLIC_URL="https://gpu-box.example")) as client:
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        made = client.post("/api/operators", json={"name": "otto", "role": "operator"}, headers=admin).json()
        page = client.get("/signin")
        csrf_cookie = page.headers["set-cookie"]
        assert "Secure" in csrf_cookie  # the CSRF cookie too
        # A client over plain http (this one) would not send a Secure cookie back; the proxy's clients are on https.
        signed_in = client.post(
            "/signin",
            data={"name": "otto", "token": made["token"]["secret"], "_csrf_token": form_csrf(page.text)},
            headers={"Cookie": csrf_cookie.split(";")[0]},
            follow_redirects=False,
        )
        assert signed_in.status_code == 303
        session_cookie = next(c for c in signed_in.headers.get_list("set-cookie") if c.startswith("flashgate_session="))
        assert "Secure" in session_cookie and "HttpOnly" in session_cookie
